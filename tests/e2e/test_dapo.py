"""DAPO's data path end to end: dynamic sampling, over-long shaping and over-long filtering on,
and a resume after a dynamic-sampling step continues the prompt stream where it stopped."""

from __future__ import annotations

import pytest

from .harness import TINY, assert_records_equal, assert_required_metrics, run_train

DAPO = (
    *TINY,
    "algo.num_return_sequences_in_group=2",
    "algo.dynamic_sampling=true",
    "algo.mask_truncated=true",
    "reward.overlong_buffer=4",
    "reward.functions=[tests.production.binary_rewards:first_digit_is_even]",
)


@pytest.mark.slow
def test_dapo_options_run_and_resume_exactly(tmp_path):
    reference = run_train(tmp_path / "reference", ["steps=2", *DAPO]).metrics()
    assert_required_metrics(reference, steps=2)
    for record in reference:
        assert record["dynamic_sampling/prompts_consumed"] >= 2
        assert record["dynamic_sampling/filled_groups"] == 0
        assert -1.0 <= record["reward_overlong_penalty_mean"] <= 0.0
        assert 0.0 <= record["truncated_masked_frac"] <= 1.0
    assert any(r["dynamic_sampling/rounds"] >= 2 for r in reference), "nothing was dropped"
    # A run stopped after step 0 (checkpointed) and resumed makes step 1 exactly as the
    # uninterrupted run: the checkpointed cursor is past every prompt step 0 drew, dropped ones
    # included.
    output_dir = tmp_path / "resumed"
    run_train(output_dir, ["steps=1", *DAPO, "checkpoint.interval=1"])
    resumed = run_train(output_dir, ["steps=2", *DAPO, "checkpoint.interval=1", "resume=true"])
    records = resumed.metrics()
    assert [r["step"] for r in records] == [0, 1]
    for expected, actual in zip(reference, records):
        assert_records_equal(expected, actual)
