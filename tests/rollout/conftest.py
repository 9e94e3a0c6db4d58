"""Tiny models and engines shared by the rollout tests (hidden 32, 2 layers, vocab 96)."""

from __future__ import annotations

import pytest

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


@pytest.fixture
def model_config() -> ModelConfig:
    return tiny_model_config()


@pytest.fixture
def engine(model_config):
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model_config, seed=1)
    yield engine
    engine.close()
