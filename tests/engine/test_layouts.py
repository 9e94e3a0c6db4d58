"""Every parallel layout gives the loss, gradients, updated weights and log-probs of one process.

One torchrun launch per world size runs several layouts one after the other (Megatron groups are
rebuilt between them); ``layout_worker.py`` compares each with the one-process reference and
writes its errors per rank. Model: tiny Qwen3-MoE (4 layers, hidden 64, 8 experts top-2, vocab
64, load-balancing loss on), Qwen2-MoE (shared expert, q/k/v bias, dense first layer) and dense
Qwen3 with tied embeddings; 8 samples of different lengths, two micro-batches in every layout.
The MoE case also runs with each rollout correction (token TIS, token mask, geometric-mean
sequence truncate and mask: the weights of sequences split by cp need the all-reduced mean) in
dp2, cp2 and pp2, and with the CISPO and GMPO surrogates.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from worker_launch import run_worker, worker_command

WORKER = Path(__file__).with_name("layout_worker.py")

TOLERANCE = 1e-5
"""Relative (gradients: norm-relative per tensor) error allowed against one process, fp32."""

CORRECTIONS = ("tis", "icepop", "geo_truncate", "geo_mask")
"""MoE cases with a rollout correction (layout_worker.VARIANTS), in dp2, cp2 and pp2."""
SURROGATES = ("cispo", "gmpo")
CASES = ("moe", "qwen2", "dense", *CORRECTIONS, *SURROGATES)

LAUNCHES = {
    2: [
        "moe:dp2",
        "moe:dp2.distopt",
        "moe:tp2",
        "moe:pp2",
        "moe:pp2.vpp2",
        "moe:ep2",
        "moe:cp2",
        "qwen2:tp2",
        "qwen2:ep2",
        "qwen2:pp2",
        "dense:pp2",
        "dense:cp2",
        *(f"{case}:{layout}" for case in CORRECTIONS for layout in ("dp2", "cp2", "pp2")),
        "cispo:cp2",
        "gmpo:cp2",
        "gmpo:pp2",
    ],
    4: [
        "moe:tp2.ep2",
        "moe:tp2.ep2.etp2",
        "moe:pp2.ep2",
        "moe:tp2.pp2",
        "moe:tp2.ep2.cp2",
        "moe:tp2.ep2.distopt",
        "qwen2:tp2.pp2",
        "dense:tp2.pp2",
    ],
    8: ["moe:tp2.pp2.ep2.cp2"],
}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layouts")
    run_worker(
        [sys.executable, str(WORKER), "--out", str(out), "--reference", *CASES],
        timeout=300,
    )
    return out


def _launch(world: int, reference_dir: Path) -> dict:
    out = reference_dir / f"world{world}"
    out.mkdir(exist_ok=True)
    for case in CASES:
        link = out / f"reference_{case}.pt"
        if not link.exists():
            link.symlink_to(reference_dir / f"reference_{case}.pt")
    run_worker(
        [*worker_command(WORKER, world), "--out", str(out), "--runs", *LAUNCHES[world]],
        timeout=600,
    )
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)}


def test_one_vs_four_micro_batches(reference_dir):
    """Same gradient whether the mini-batch is one micro-batch or four (global denominators)."""
    results = json.loads((reference_dir / "micro_batch_invariance.json").read_text())
    for case, result in results.items():
        assert result["micro_batches"] == [1.0, 4.0], case
        assert result["grad_max_rel"] < TOLERANCE, (case, result)
        assert math.isclose(*result["loss"], rel_tol=1e-6), (case, result)


def _check_launch(world: int, reports: dict, reference_dir: Path) -> None:
    import torch

    for run in LAUNCHES[world]:
        case = run.split(":")[0]
        reference = torch.load(reference_dir / f"reference_{case}.pt", weights_only=False)
        names = set()
        for rank, per_run in reports.items():
            report = per_run[run]
            where = f"{run} rank {rank}"
            # Seed-determined init: the same full weights in every layout, bit for bit.
            assert report["weights0_max_abs"] == 0.0, where
            if "grad_max_rel" in report:
                assert report["grad_max_rel"] < TOLERANCE, (where, report["grad_worst"])
            # After one AdamW step (lr 1e-3): a wrong gradient moves weights by ~lr.
            assert report["weights1_max_abs"] < 5e-6, where
            assert report["log_probs_max_abs"] < TOLERANCE, where
            for name, error in report["metric_rel"].items():
                assert error < TOLERANCE, (where, name, report["metrics"][name])
            assert report["metrics"]["skipped"] == 0.0
            names.update(report["names"])
        # Every parameter of the one-process model was compared somewhere.
        assert names == set(reference["grads"]), (run, set(reference["grads"]) ^ names)


@pytest.mark.distributed
def test_two_process_layouts(reference_dir):
    _check_launch(2, _launch(2, reference_dir), reference_dir)


@pytest.mark.distributed
def test_four_process_layouts(reference_dir):
    _check_launch(4, _launch(4, reference_dir), reference_dir)


@pytest.mark.distributed
def test_eight_process_layout(reference_dir):
    """tp2 + pp2 + ep2 + cp2: every kind of parallelism at once."""
    _check_launch(8, _launch(8, reference_dir), reference_dir)
