"""Tiny models and engines shared by the rollout tests (hidden 32, 2 layers, vocab 96)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.config import ModelConfig


def tiny_model_config(architecture: str = "qwen3_moe", **overrides) -> ModelConfig:
    """A 2-layer model; Qwen3-MoE gets a dense first layer so dense-layer skipping is exercised.

    ``init_std=0.2`` makes the random logits peaked enough (|logit| ~ 5) that samples are not
    uniform noise, yet keeps fp32 within ~3e-6 of fp64 (at 0.5 activations grow until fp32 is
    off by 1e-4).
    """
    fields = dict(
        architecture=architecture,
        vocab_size=96,
        hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=8,
        ffn_hidden_size=48,
        num_experts=4,
        moe_ffn_hidden_size=24,
        moe_router_topk=2,
        max_position_embeddings=256,
        init_std=0.2,
    )
    if architecture == "qwen3_moe":
        fields["first_k_dense_layers"] = 1
    if architecture in ("mixtral", "qwen2_moe"):
        fields["qk_layernorm"] = False
    if architecture == "qwen2_moe":
        fields.update(
            shared_expert_intermediate_size=40, add_qkv_bias=True, moe_renormalize_topk=False
        )
    if architecture == "glm4_moe":
        # GLM-4.5's features away from their neutral values: a first dense layer, two shared
        # experts, groups (top-1 of 2 groups of 2 experts), routed_scaling_factor, partial
        # RoPE, q/k/v bias and q/k norm (GLM-4.5's use_qk_norm).
        fields.update(
            first_k_dense_layers=1,
            shared_expert_intermediate_size=48,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5,
            rotary_percent=0.5,
            add_qkv_bias=True,
        )
    if architecture == "deepseek_v3":
        # DeepSeek-V3's features: the GLM-4.5 router (groups, scaling, a shared expert, a first
        # dense layer) with multi-head latent attention (low-rank query, a value width of its
        # own) and YaRN with the softmax mscale.
        fields.update(
            first_k_dense_layers=1,
            num_query_groups=4,
            head_dim=4,
            shared_expert_intermediate_size=24,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5,
            qk_layernorm=False,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            rope_theta=10000.0,
            rope_scaling_factor=4.0,
            rope_scaling_original_max_position_embeddings=64,
            yarn_mscale_all_dim=1.0,
        )
    fields.update(overrides)
    return ModelConfig(**fields)


def reference_routes(
    router_logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, group_topk: int
) -> torch.Tensor:
    """``[T, topk]`` expert ids, sorted, of GLM-4.5's and DeepSeek-V3's group-limited biased
    sigmoid routing, written from its definition (docs/glm4-moe.md, "Routing") in float64:
    selection by sigmoid scores + correction bias, groups ranked by the sum of their two best
    biased scores, top-k inside the chosen groups."""
    scores = torch.sigmoid(router_logits.double()) + bias.double()
    tokens, experts = scores.shape
    grouped = scores.view(tokens, groups, experts // groups)
    group_rank = grouped.topk(2, dim=-1).values.sum(-1)
    chosen_groups = group_rank.topk(group_topk, dim=-1).indices
    allowed = torch.zeros(tokens, groups, dtype=torch.bool)
    allowed.scatter_(1, chosen_groups, True)
    allowed = allowed.repeat_interleave(experts // groups, dim=1)
    masked = scores.masked_fill(~allowed, float("-inf"))
    return masked.topk(topk, dim=-1).indices.sort(-1).values


def assert_engine_routes_follow_the_biased_rule(architecture: str) -> None:
    """The embedded engine of ``architecture`` (a sigmoid router with the correction bias on
    layer 1) records, for generated samples, the experts of :func:`reference_routes` under a
    random bias large enough (0.6 x N(0, 1) against sigmoid scores in (0, 1)) to change the
    choice: without the bias other experts win on at least one sample."""
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.types import GenerateRequest

    config = tiny_model_config(architecture)
    engine = EmbeddedEngine(config, seed=5)
    generator = torch.Generator().manual_seed(3)
    bias = 0.6 * torch.randn(config.num_experts, generator=generator)
    engine.hf_model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(bias)
    requests = [
        GenerateRequest(
            input_ids=[(5 * i + j) % 90 + 1 for j in range(i + 3)],
            max_new_tokens=6,
            temperature=1.0,
            seed=40 + i,
            return_routed_experts=True,
        )
        for i in range(3)
    ]
    rule = (config.moe_router_topk, config.moe_router_num_groups, config.moe_router_group_topk)
    unbiased_differs = False
    try:
        for request, result in zip(requests, engine.generate(requests)):
            tokens = list(request.input_ids) + result.output_ids
            assert result.routed_experts.shape == (len(tokens) - 1, 1, config.moe_router_topk)
            with torch.no_grad():
                output = engine.hf_model(
                    input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True
                )
            (router_logits,) = output.router_logits
            expected = reference_routes(router_logits, bias, *rule)
            routed = torch.from_numpy(result.routed_experts[:, 0, :].astype(np.int64))
            assert torch.equal(routed.sort(-1).values, expected)
            unbiased = reference_routes(router_logits, torch.zeros_like(bias), *rule)
            unbiased_differs |= not torch.equal(unbiased, expected)
    finally:
        engine.close()
    # The bias mattered: without it other experts win.
    assert unbiased_differs


@pytest.fixture
def model_config() -> ModelConfig:
    return tiny_model_config()


@pytest.fixture
def engine(model_config):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_config, seed=1)
    yield engine
    engine.close()
