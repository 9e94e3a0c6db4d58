"""GLM-4.5 (``glm4_moe``) end to end: two GSPO steps from the command line, one process, the
embedded rollout engine, R3 replaying the engine's routes under group-limited sigmoid routing.

Slow tier (about 18 s): its parts have cheaper tests: the engine's GLM routes
(``tests/rollout/test_glm4_moe_engine.py``), the engine step and the weight sync into the
embedded engine (``tests/convert``, ``glm4_moe_trained``), R3 with the embedded engine's routes and
log-probs (``tests/engine/test_routing_replay.py``, ``glm4_r3_log_probs_match_the_embedded_engine``).
"""

from __future__ import annotations

import pytest

from .harness import TINY, assert_required_metrics, run_train

GLM4_MOE = (
    "model.architecture=glm4_moe",
    "model.first_k_dense_layers=1",
    "model.shared_expert_intermediate_size=48",
    "model.moe_router_num_groups=2",
    "model.moe_router_group_topk=1",
    "model.moe_router_topk_scaling_factor=2.5",
    "model.rotary_percent=0.5",
    "model.add_qkv_bias=true",
)
"""The default tiny model as GLM-4.5: layer 0 dense, layer 1 routed (8 experts in 2 groups, one
group per token, top-2 scaled by 2.5) with a shared expert, partial RoPE, q/k/v bias."""


@pytest.mark.slow
def test_gspo_with_r3_on_glm4_moe(tmp_path):
    run = run_train(tmp_path / "out", ["steps=2", *TINY, *GLM4_MOE, "algo.routing_replay=r3"])
    records = run.metrics()
    assert_required_metrics(records, steps=2)
    for record in records:
        # The trainer computes the engine's network: the same log-probs before the first update
        # and after the weight sync that follows it (correction bias included).
        assert record["kl"] < 1e-9, record["kl"]
        # R3: the training forwards used exactly the engine's experts.
        assert record["routing_mismatch_vs_rollout"] == 0.0
        assert record["grad_norm"] > 0
