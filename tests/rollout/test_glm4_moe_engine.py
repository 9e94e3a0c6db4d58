"""The embedded engine on GLM-4.5 (``glm4_moe``): routes and the correction bias.

The recorder reads the expert ids that ``Glm4MoeTopkRouter`` selected; they are checked against
GLM-4.5's routing rule written from its definition (docs/glm4-moe.md, "Routing") in float64
(``tests/rollout/conftest.py``, ``reference_routes``: sigmoid scores, selection by scores +
correction bias, groups ranked by the sum of their two best biased scores, top-k inside the
chosen groups). The bias is a buffer that the weight sync must
carry, in float32 whatever the engine's dtype.
"""

from __future__ import annotations

import torch

from megatron_gspo.rollout.embedded import EmbeddedEngine
from tests.rollout.conftest import assert_engine_routes_follow_the_biased_rule, tiny_model_config

BIAS = "mlp.gate.e_score_correction_bias"


def test_routes_follow_the_biased_group_limited_rule():
    assert_engine_routes_follow_the_biased_rule("glm4_moe")


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
