"""Distributed checkpoints: exact resume, resharding, atomic directories, clear errors.

Four launches of ``checkpoint_worker.py`` (1, 4, 2, then 1 process), each loading what the
earlier ones saved. Model: tiny Qwen2-MoE (dense first layer, shared expert, tied embeddings),
AdamW with weight decay, warm-up and cosine decay; checkpoints after 2 optimizer steps, then 2
more steps. "Exact" means the same floats: loss, grad norm, lr and every weight.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from worker_launch import run_worker, worker_command

WORKER = Path(__file__).with_name("checkpoint_worker.py")

LOSS_TOLERANCE = 1e-6
"""Relative: the same weights at another layout give the same loss up to fp32 reduction order."""
WEIGHT_TOLERANCE = 1e-6
"""Absolute, after 2 AdamW steps (lr ~1e-3) continued at another layout. A lost Adam state moves
weights by ~1e-4 (checked by the weights-only control)."""


def _launch(out: Path, phase: str, world: int) -> dict:
    run_worker([*worker_command(WORKER, world), "--phase", phase, "--out", str(out)], 600)
    return json.loads((out / f"{phase}.json").read_text())


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def one(out) -> dict:
    return _launch(out, "one", 1)


@pytest.fixture(scope="module")
def four(out, one) -> dict:
    return _launch(out, "four", 4)


@pytest.fixture(scope="module")
def two(out, four) -> dict:
    return _launch(out, "two", 2)


@pytest.fixture(scope="module")
def last(out, two) -> dict:
    return _launch(out, "last", 1)


def _check_exact_resume(report: dict, tag: str) -> None:
    assert report[f"{tag}/loaded_weights_max_abs"] == 0.0
    assert report[f"{tag}/extra_state_equal"] is True
    assert report[f"{tag}/step_count"] == 2
    continued, resumed = report[f"{tag}/continued"], report[f"{tag}/resumed"]
    assert resumed == continued  # loss, grad norm and lr, float for float
    assert report[f"{tag}/resumed_weights_max_abs"] == 0.0
    # The schedule moved on (warm-up then cosine): a wrong restored step would change the lr.
    assert continued[0]["lr"] != continued[1]["lr"]


def _check_cross_load(report: dict, tag: str, source: dict, source_tag: str) -> None:
    """Loaded at another layout: bit-identical weights; the same next loss; the continued run
    follows the source run's trajectory (optimizer state and schedule carried over)."""
    assert report[f"{tag}/loaded_weights_max_abs"] == 0.0, tag
    assert report[f"{tag}/step_count"] == 2
    resumed, reference = report[f"{tag}/resumed"], source[f"{source_tag}/continued"]
    for got, want in zip(resumed, reference):
        assert math.isclose(got["loss"], want["loss"], rel_tol=LOSS_TOLERANCE), (tag, got, want)
        assert math.isclose(got["grad_norm"], want["grad_norm"], rel_tol=1e-5), (tag, got, want)
        assert got["lr"] == want["lr"]
    assert report[f"{tag}/resumed_weights_max_abs"] < WEIGHT_TOLERANCE, tag


def test_exact_resume_one_process(one):
    _check_exact_resume(one, "one")


def test_lost_optimizer_state_is_detectable(one):
    """Control: weights without the optimizer state continue elsewhere, far beyond tolerance."""
    assert one["control/extra_state_returned"] is True
    assert one["control/weights_only_max_abs"] > 100 * WEIGHT_TOLERANCE


def test_weights_only_loads(one):
    """``load_weights_only`` (checkpoint.load_path) from a checkpoint root and from a plain
    torch_dist directory without checkpoint.json (the hf-to-megatron format)."""
    assert one["weights_only/max_abs"] == 0.0
    assert one["weights_only/optimizer_state_empty"] is True
    assert one["control/plain_torch_dist_max_abs"] == 0.0


def test_rng_states_restored(one):
    """python, numpy, torch and Megatron's tensor-parallel tracker draw the same numbers."""
    assert one["rng/restored"] is True


def test_optimizer_keys_match_megatron_non_distributed_format(one):
    assert one["format/same_keys_as_megatron"] is True


def test_directories_are_atomic_and_pruned(one):
    """A leftover .tmp dir and a step dir without checkpoint.json are never the latest, cannot
    be loaded, and are removed by the next save; keep_last prunes; ``latest`` is followed, and a
    stale ``latest`` falls back to the newest complete checkpoint; saving a step again replaces
    it."""
    for name in (
        "latest_ignores_incomplete",
        "incomplete_refused",
        "stale_removed",
        "pruned_to_keep_last",
        "latest_file",
        "latest",
        "latest_fallback",
        "latest_followed",
        "same_step_replaced",
    ):
        assert one[f"dirs/{name}"] is True, name


def test_clear_errors(one):
    for name in (
        "non_json_extra_state",
        "int_keys_extra_state",
        "nothing_written",
        "schedule_change",
        "model_change",
    ):
        assert one[f"errors/{name}"] is True, name


def test_allowed_schedule_change_continues_the_new_schedule(one):
    """lr 1e-3 -> 2e-3 (min 1e-4) at the saved step: the cosine factor is kept, the peak is new."""
    old_lr = one["one/continued"][0]["lr"]
    factor = (old_lr - 1e-4) / (1e-3 - 1e-4)
    assert math.isclose(one["schedule/new_lr_after_load"], 1e-4 + factor * (2e-3 - 1e-4))


@pytest.mark.distributed
def test_exact_resume_tp2_ep2_both_optimizers(four):
    _check_exact_resume(four, "four")
    _check_exact_resume(four, "four_distopt")


@pytest.mark.distributed
def test_one_process_checkpoint_loads_at_tp2_ep2(four, one):
    _check_cross_load(four, "one_to_four", one, "one")


@pytest.mark.distributed
def test_exact_resume_pp2_and_dp2_distributed_optimizer(two):
    """pp2: the first stage has no experts (one chained optimizer fewer than the last stage)
    and the last holds the tied output copy."""
    _check_exact_resume(two, "two")
    _check_exact_resume(two, "two_distopt")


@pytest.mark.distributed
def test_tp2_ep2_checkpoints_load_at_pp2_and_dp2(two, four):
    _check_cross_load(two, "four_to_pp2", four, "four")
    _check_cross_load(two, "four_distopt_to_dp2", four, "four_distopt")


@pytest.mark.distributed
def test_multi_process_checkpoints_load_at_one_process(last, four, two):
    """tp2.ep2 (both optimizers; the distributed optimizer's state goes to the non-distributed
    one) and pp2 checkpoints resume in one process."""
    _check_cross_load(last, "four_to_one", four, "four")
    _check_cross_load(last, "four_distopt_to_one", four, "four_distopt")
    _check_cross_load(last, "two_to_one", two, "two")
