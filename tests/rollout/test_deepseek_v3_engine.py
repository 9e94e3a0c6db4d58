"""The embedded engine on DeepSeek-V3 (``deepseek_v3``): routes and the correction bias.

``DeepseekV3TopkRouter`` returns ``(router_logits, topk_weights, topk_indices)`` like GLM-4.5's
router, so the recorder reads the expert ids it selected; they are checked against the rule of
docs/glm4-moe.md, "Routing" (``tests/rollout/conftest.py``'s float64 reference, shared with
GLM-4.5), through a model with multi-head latent attention and YaRN. The engine's log-probs against a
float64 forward are in ``test_embedded.py`` (``deepseek_v3`` is one of its architectures).
"""

from __future__ import annotations

import numpy as np

from megatron_gspo.rollout.embedded import EmbeddedEngine
from tests.rollout.conftest import assert_engine_routes_follow_the_biased_rule, tiny_model_config


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
    assert_engine_routes_follow_the_biased_rule("deepseek_v3")
