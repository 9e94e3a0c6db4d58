"""The embedded engine on GLM-4.5 (``glm4_moe``): routes and the correction bias.

The recorder reads the expert ids that ``Glm4MoeTopkRouter`` selected; they are checked against
GLM-4.5's routing rule written here from its definition (docs/glm4-moe.md, "Routing") in float64:
sigmoid scores, selection by scores + correction bias, groups ranked by the sum of their two best
biased scores, top-k inside the chosen groups. The bias is a buffer that the weight sync must
carry, in float32 whatever the engine's dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config

BIAS = "mlp.gate.e_score_correction_bias"


def reference_routes(
    router_logits: torch.Tensor, bias: torch.Tensor, topk: int, groups: int, group_topk: int
) -> torch.Tensor:
    """``[T, topk]`` expert ids, sorted, of GLM-4.5's group-limited biased sigmoid routing."""
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


def test_routes_follow_the_biased_group_limited_rule():
    config = tiny_model_config("glm4_moe")
    engine = EmbeddedEngine(config, seed=5)
    # A bias large enough to override the sigmoid scores' ranking (|scores| < 1).
    generator = torch.Generator().manual_seed(3)
    layer = engine.hf_model.model.layers[1]
    bias = 0.6 * torch.randn(config.num_experts, generator=generator)
    layer.mlp.gate.e_score_correction_bias.copy_(bias)
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
    # The bias mattered: without it other experts win.
    assert unbiased_differs


def test_weight_sync_carries_the_bias_in_float32(tmp_path):
    config = tiny_model_config("glm4_moe")
    source = EmbeddedEngine(config, seed=1)
    source.hf_model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(
        torch.linspace(-0.5, 0.5, config.num_experts)
    )
    target = EmbeddedEngine(config, seed=2, dtype=torch.bfloat16)
    name = f"model.layers.1.{BIAS}"
    assert name in target._layout.disk_names
    target.sync_weights(source.hf_state(), version=1)
    synced = target.hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert synced.dtype == torch.float32
    assert torch.equal(synced, torch.linspace(-0.5, 0.5, config.num_experts))
    assert target.hf_model.model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
