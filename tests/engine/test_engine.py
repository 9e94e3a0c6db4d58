"""TrainEngine behaviour in one process (``engine_checks_worker.py``, in a fresh process).

* log-probs are next-token aligned and at the rollout temperature (float64 reference);
* packing isolates sequences (packed together == each alone);
* recomputed old log-probs give a ratio of exactly 1 in the training forward;
* a non-finite loss skips the step (weights, lr untouched), N in a row stop the run;
* learning-rate warm-up; ``fixed_lr`` (the cold start's own lr) overrides the schedule; the load-balancing loss reaches the router;
* ``moe_enable_routing_replay`` is set on the policy (one RouterReplay per MoE layer);
* on one process the ``auto`` MoE token dispatcher is allgather, bit-identical to alltoall;
* the metric reduction's one-micro-batch shortcut gives the general reduction's numbers;
* the KL reference model is a frozen copy; malformed samples are rejected by index and field.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_launch import run_json_worker

WORKER = Path(__file__).with_name("engine_checks_worker.py")
CHECKS = [
    "next_token_alignment_and_temperature",
    "packing_isolates_sequences",
    "recomputed_old_log_probs_give_ratio_one",
    "non_finite_steps_are_skipped_then_stop_the_run",
    "lr_warmup",
    "fixed_lr_overrides_the_schedule_inside_its_block",
    "load_balancing_loss_reaches_the_router",
    "auto_dispatcher_is_allgather_alone_and_exact",
    "one_micro_batch_metrics_reduce_like_several",
    "routing_replay_is_settable",
    "reference_model_is_frozen_copy",
    "bad_samples_are_rejected_with_the_field_named",
]


@pytest.fixture(scope="module")
def results() -> dict:
    return run_json_worker(WORKER, timeout=600)


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_engine(results, check):
    assert results[check] == "ok", results[check]
