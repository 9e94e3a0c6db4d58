"""Rollout replay (``rollout.replay_dir``): a run trains the batches another run recorded
(``rollout.save_rollouts``) instead of generating them, with no rollout engine."""

from __future__ import annotations

import pytest

from megatron_gspo.driver.ledger import read_trained_prompts

from .harness import (
    GRPO,
    LAYOUT_DEPENDENT,
    TINY,
    assert_records_close,
    assert_records_equal,
    run_train,
)

WEIGHT_SYNC = frozenset({"weight_sync_bytes", "weight_sync_tensors", "weight_sync_buckets"})
"""What a weight sync moved: a replayed run sends its weights to no engine."""


def test_replaying_a_run_reproduces_its_metrics_bit_for_bit(gspo_run, tmp_path):
    """The recording's own settings: every metric but wall times and the weight syncs' sizes
    equals the recording's, and so do the trained prompts; no engine was built."""
    launch = run_train(
        tmp_path / "replay",
        ["steps=3", *TINY, "checkpoint.interval=2", f"rollout.replay_dir={gspo_run.output_dir}"],
    )
    records = launch.metrics()
    assert [record["step"] for record in records] == [0, 1, 2]
    for want, got in zip(gspo_run.metrics(), records):
        assert_records_equal(want, got, skip=WEIGHT_SYNC)
        assert not WEIGHT_SYNC & got.keys(), got
    assert read_trained_prompts(tmp_path / "replay") == read_trained_prompts(gspo_run.output_dir)
    assert not (tmp_path / "replay" / "rollout").exists()  # the embedded engine's work folder
    assert not (tmp_path / "replay" / "rollouts").exists()  # it records nothing of its own


@pytest.mark.slow
def test_the_same_batches_fed_to_another_loss(gspo_run, grpo_run, tmp_path):
    """GSPO's recorded batches trained with GRPO's loss: step 0's batch is the one GRPO itself
    generated (the same initial weights and seeds), so step 0 is GRPO's run bit for bit; later
    steps train GSPO's samples, so their rollout metrics are GSPO's and their losses are not.
    The full run's: CI replays a recording bit for bit above (the loss is the config's)."""
    launch = run_train(
        tmp_path / "replay",
        ["steps=2", *TINY, *GRPO, f"rollout.replay_dir={gspo_run.output_dir}"],
    )
    replayed, gspo, grpo = launch.metrics(), gspo_run.metrics(), grpo_run.metrics()
    assert_records_equal(grpo[0], replayed[0], skip=WEIGHT_SYNC)
    for key in ("reward_mean", "reward_std", "response_len_mean", "response_len_max"):
        assert replayed[1][key] == gspo[1][key], key
    assert replayed[1]["policy_loss"] != gspo[1]["policy_loss"]
    assert replayed[1]["policy_loss"] != grpo[1]["policy_loss"]


@pytest.mark.slow
@pytest.mark.distributed
def test_the_same_batches_on_another_layout(gspo_run, tmp_path):
    """The one-process recording replayed by four processes (tp2 x ep2): every step trains the
    same samples, so every step's rollout metrics are the recording's exactly and the trainer's
    agree within the layout contract (tests/e2e/test_parallel_runs.py: step 0 to 1e-5, later
    steps, whose weights differ by rounding, to 1e-4)."""
    launch = run_train(
        tmp_path / "replay",
        [
            "steps=3", *TINY, "parallel.tp=2", "parallel.ep=2",
            f"rollout.replay_dir={gspo_run.output_dir}",
        ],
        nproc=4,
        timeout=300,
    )  # fmt: skip
    replayed, recorded = launch.metrics(), gspo_run.metrics()
    assert_records_close(
        recorded[0], replayed[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT | WEIGHT_SYNC
    )
    for want, got in zip(recorded, replayed):
        for key in ("reward_mean", "response_len_mean", "response_len_max"):
            assert got[key] == want[key], key
        for key in ("policy_loss", "grad_norm", "entropy", "clip_frac_token"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
