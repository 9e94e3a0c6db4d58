"""Routing Replay (R2 / R3) and the expert-volatility metrics (``engine/routing_replay.py``).

One process (``routing_replay_worker.py --checks``, a fresh process):

* R2 records ``[L - 1, M, K]`` uint8 per sample, exactly the experts Megatron's routers used;
* after perturbing every router, R2 training forwards still dispatch to the recorded experts, and
  ``routing_change_frac`` (overall and per layer) equals the share of loss (token, layer) pairs
  whose native top-k set moved, computed independently from the router logits;
* without replay the perturbed routers route natively and the metric sees it (> 0);
* R3 replays given (random) routes in the old-log-prob and the training forwards;
* R3 with the embedded engine loaded with the trainer's weights (``iter_hf_weights``): the
  trainer's recomputed log-probs equal the engine's to fp32 tolerance, ratio exactly 1;
* with a bfloat16 engine (a real mismatch) R3 brings the trainer-vs-engine log-prob gap below
  R2's, and the experts the training forward uses match the engine's everywhere under R3 and
  not under R2 (``routing_mismatch_vs_rollout``);
* full activation recompute replays the same routes in the backward (same gradients);
* the KL reference model never replays; Megatron's registry holds only the policy's instances;
* missing / malformed routes, and routes not consumed exactly once, raise naming sample or layer.
* GLM-4.5 (group-limited sigmoid routing with a non-zero correction bias): the recorded experts
  and combine weights equal a float64 evaluation of the routing rule; R2 with
  ``routing_replay_weights=replayed`` reproduces the old forward bit for bit after the router and
  the bias moved (no router gradient), with ``recompute`` a bias-only move changes nothing under
  replay (the bias selects, never weighs) while a router move changes the weights; the metric
  ``routing_replay_weights_replayed`` says which; R3 with the embedded engine loaded with the
  trainer's weights and bias gives the engine's log-probs to fp32 tolerance.
* R3 with ``routing_replay_weights=replayed`` (the embedded engine's combine weights, reported
  beside its ids): in float32 the engine's weights equal Megatron's recomputed ones at the same
  ids to rounding, and R3 + replayed gives R3 + recompute's old log-probs, loss and the
  gradients the routers' path does not reach, for Qwen3-MoE (softmax) and GLM-4.5 (sigmoid,
  correction bias, groups, scaling); with a bfloat16 engine the trainer's routers hand exactly
  the engine's weights (bf16 values, not the trainer's recompute) to the dispatcher, and scaling
  them changes the ratio.

Several processes (gloo): the old-log-prob forward (R2: record; R3: replay random routes and
record), a training step replaying random routes and a one-sample step (filler micro-batches on
the other data-parallel rank) in ep2 (R2), cp2 (R3), pp2 x vpp2 with full recompute (R2) and
tp2 x ep2 x cp2 (R2) give the one-process recorded routes bit for bit, and its log-probs,
gradients, loss and routing metrics; R2 replaying the recorded combine weights too
(``r2w``: ``routing_replay_weights=replayed``) in pp2 x vpp2 with full recompute (the weights
queued for the backward recomputation beside the ids) gives its recorded weights and the rest.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from worker_launch import run_worker, worker_command

WORKER = Path(__file__).with_name("routing_replay_worker.py")
CHECKS = [
    "recorded_routes_are_the_routes_used",
    "r2_replays_recorded_routes_after_router_perturbation",
    "without_replay_perturbed_router_changes_routes",
    "r3_replay_forces_the_given_routes",
    "r3_log_probs_match_the_embedded_engine",
    "bf16_engine_gap_r3_below_r2",
    "activation_recompute_replays_in_backward",
    "reference_forward_never_replays",
    "missing_or_malformed_routes_are_rejected",
    "routes_not_consumed_exactly_once_raise",
    "glm4_r2_replayed_weights_reproduce_the_old_forward",
    "glm4_r2_recomputed_weights_follow_the_router_not_the_bias",
    "glm4_r3_log_probs_match_the_embedded_engine",
    "r3_replayed_engine_weights_equal_recompute_qwen3_moe",
    "r3_replayed_engine_weights_equal_recompute_glm4",
    "r3_replays_a_bf16_engines_weights",
]
LAUNCHES = {
    2: ["r2:ep2", "r3:cp2", "r2:pp2.vpp2.recompute", "r2w:pp2.vpp2.recompute"],
    4: ["r2:tp2.ep2.cp2"],
}


# ---------------------------------------------------------------------------------------------
# One process
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results() -> dict:
    stdout = run_worker([sys.executable, str(WORKER), "--checks"], timeout=600)
    return json.loads(stdout.strip().splitlines()[-1])


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_routing_replay(results, check):
    assert results[check] == "ok", results[check]


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("routing_replay")
    run_worker(
        [sys.executable, str(WORKER), "--out", str(out), "--reference", "r2", "r3", "r2w"],
        timeout=300,
    )
    return out


def _launch(world: int, reference_dir: Path) -> None:
    out = reference_dir / f"world{world}"
    out.mkdir(exist_ok=True)
    for mode in ("r2", "r3", "r2w"):
        link = out / f"reference_{mode}.pt"
        if not link.exists():
            link.symlink_to(reference_dir / f"reference_{mode}.pt")
    run_worker(
        [*worker_command(WORKER, world), "--out", str(out), "--runs", *LAUNCHES[world]],
        timeout=600,
    )
    for rank in range(world):
        reports = json.loads((out / f"rank{rank}.json").read_text())
        for run in LAUNCHES[world]:
            report, where = reports[run], f"{run} rank {rank}"
            # Gathered over tp (sequence parallel), cp, dp and pp: the same bits everywhere.
            assert report["recorded_equal"], where
            assert report["log_probs_max_abs"] < 1e-5, (where, report)
            assert report.get("recorded_weights_max_abs", 0.0) < 1e-6, (where, report)
            assert report["grad_max_rel"] < 1e-5, (where, report)
            assert report["single_loss_rel"] < 1e-5, (where, report)
            for name, error in report["metric_abs"].items():
                tolerance = 1e-5 * max(1.0, abs(report["metrics"]["loss"] or 0.0))
                assert error <= (tolerance if name == "loss" else 1e-12), (where, name, report)
            assert "routing_change_frac" in report["metrics"], where


@pytest.mark.distributed
def test_two_process_layouts(reference_dir):
    _launch(2, reference_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_four_process_layouts(reference_dir):
    """The full run: each replayed dimension runs in CI at 2 processes (above)."""
    _launch(4, reference_dir)
