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
* full activation recompute replays the same routes in the backward (same gradients);
* the KL reference model never replays; Megatron's registry holds only the policy's instances;
* missing / malformed routes, and routes not consumed exactly once, raise naming sample or layer.

Several processes (gloo): the old-log-prob forward (R2: record; R3: replay random routes and
record), a training step replaying random routes and a one-sample step (filler micro-batches on
the other data-parallel rank) in ep2 (R2), cp2 (R3), pp2 x vpp2 with full recompute (R2) and
tp2 x ep2 x cp2 (R2) give the one-process recorded routes bit for bit, and its log-probs,
gradients, loss and routing metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from worker_launch import run_worker, worker_command

from megatron_gspo.engine.routing_replay import (
    RoutingReplayError,
    balanced_pad_routes,
    check_routes,
    route_dtype,
    topk_sets_differ,
)

WORKER = Path(__file__).with_name("routing_replay_worker.py")
CHECKS = [
    "recorded_routes_are_the_routes_used",
    "r2_replays_recorded_routes_after_router_perturbation",
    "without_replay_perturbed_router_changes_routes",
    "r3_replay_forces_the_given_routes",
    "r3_log_probs_match_the_embedded_engine",
    "activation_recompute_replays_in_backward",
    "reference_forward_never_replays",
    "missing_or_malformed_routes_are_rejected",
    "routes_not_consumed_exactly_once_raise",
]
LAUNCHES = {
    2: ["r2:ep2", "r3:cp2", "r2:pp2.vpp2.recompute"],
    4: ["r2:tp2.ep2.cp2"],
}


# ---------------------------------------------------------------------------------------------
# Pure functions
# ---------------------------------------------------------------------------------------------


def test_balanced_pad_routes_are_distinct_and_spread_evenly():
    for topk, experts in ((2, 8), (8, 128), (3, 7), (8, 8)):
        pad = balanced_pad_routes(torch.arange(1000), topk, experts)
        assert pad.shape == (1000, topk)
        assert not topk_sets_differ(pad.sort(-1).values, pad).any()
        assert all(len(set(row)) == topk for row in pad.tolist())  # no duplicate in a row
        counts = torch.bincount(pad.view(-1), minlength=experts)
        assert int(counts.max() - counts.min()) <= topk, counts  # no hot expert


def test_topk_sets_differ_ignores_column_order():
    first = torch.tensor([[1, 2], [3, 4], [0, 5]])
    second = torch.tensor([[2, 1], [3, 5], [5, 0]], dtype=torch.uint8)
    assert topk_sets_differ(first, second).tolist() == [False, True, False]


def test_route_dtype():
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16


def test_check_routes_names_the_problem():
    good = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    kwargs = dict(where="sample 7 (group 1)", num_moe_layers=1, topk=2, num_experts=4, source="x")
    assert check_routes(good, num_positions=2, **kwargs) is good
    cases = [
        (None, 2, "missing"),
        (good, 3, "shape"),
        (good.float(), 2, "integer"),
        (good + 2, 2, "outside"),
        (torch.tensor([[[1, 1]], [[2, 3]]]), 2, "repeat"),
    ]
    for routes, positions, fragment in cases:
        with pytest.raises(RoutingReplayError, match=fragment) as error:
            check_routes(routes, num_positions=positions, **kwargs)
        assert "sample 7 (group 1)" in str(error.value)


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
        [sys.executable, str(WORKER), "--out", str(out), "--reference", "r2", "r3"], timeout=300
    )
    return out


def _launch(world: int, reference_dir: Path) -> None:
    out = reference_dir / f"world{world}"
    out.mkdir(exist_ok=True)
    for mode in ("r2", "r3"):
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
            assert report["grad_max_rel"] < 1e-5, (where, report)
            assert report["single_loss_rel"] < 1e-5, (where, report)
            for name, error in report["metric_abs"].items():
                tolerance = 1e-5 * max(1.0, abs(report["metrics"]["loss"] or 0.0))
                assert error <= (tolerance if name == "loss" else 1e-12), (where, name, report)
            assert "routing_change_frac" in report["metrics"], where


@pytest.mark.distributed
def test_two_process_layouts(reference_dir):
    _launch(2, reference_dir)


@pytest.mark.distributed
def test_four_process_layouts(reference_dir):
    _launch(4, reference_dir)
