"""The embedded engine on DeepSeek-V3 (``deepseek_v3``): routes and the correction bias.

``DeepseekV3TopkRouter`` returns ``(router_logits, topk_weights, topk_indices)`` like GLM-4.5's
router, so the recorder reads the expert ids it selected; they are checked against the rule of
docs/glm4-moe.md, "Routing" (``tests/rollout/test_glm4_moe_engine.py``'s float64 reference),
through a model with multi-head latent attention and YaRN. The engine's log-probs against a
float64 forward are in ``test_embedded.py`` (``deepseek_v3`` is one of its architectures).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config
from tests.rollout.test_glm4_moe_engine import reference_routes


def test_engine_is_deepseek_v3_with_latent_attention_and_yarn():
    config = tiny_model_config("deepseek_v3")
    engine = EmbeddedEngine(config, seed=5)
    attention = engine.hf_model.model.layers[0].self_attn
    assert type(attention).__name__ == "DeepseekV3Attention"
    assert attention.q_a_proj.out_features == config.q_lora_rank
    assert attention.kv_b_proj.out_features == 4 * (8 + 6)
    assert engine.hf_model.config.rope_parameters["rope_type"] == "yarn"
    # The YaRN softmax mscale m(4)^2 = (0.1 ln 4 + 1)^2 on 1 / sqrt(12).
    expected = (0.1 * np.log(4.0) + 1.0) ** 2 / np.sqrt(8 + 4)
    assert abs(attention.scaling - expected) < 1e-12
    engine.close()


def test_routes_follow_the_biased_group_limited_rule():
    config = tiny_model_config("deepseek_v3")
    engine = EmbeddedEngine(config, seed=5)
    generator = torch.Generator().manual_seed(3)
    gate = engine.hf_model.model.layers[1].mlp.gate
    bias = 0.6 * torch.randn(config.num_experts, generator=generator)
    gate.e_score_correction_bias.copy_(bias)
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
    unbiased_differs = False
    for request, result in zip(requests, engine.generate(requests)):
        tokens = list(request.input_ids) + result.output_ids
        assert result.routed_experts.shape == (len(tokens) - 1, 1, config.moe_router_topk)
        with torch.no_grad():
            output = engine.hf_model(
                input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True
            )
        (router_logits,) = output.router_logits
        expected = reference_routes(
            router_logits,
            bias,
            config.moe_router_topk,
            config.moe_router_num_groups,
            config.moe_router_group_topk,
        )
        routed = torch.from_numpy(result.routed_experts[:, 0, :].astype(np.int64))
        assert torch.equal(routed.sort(-1).values, expected)
        unbiased = reference_routes(router_logits, torch.zeros_like(bias), 2, 2, 1)
        unbiased_differs |= not torch.equal(unbiased, expected)
    assert unbiased_differs
    engine.close()
