"""A step's rollout batch on disk (``rollout.save_rollouts`` / ``rollout.replay_dir``): every
field read back bit for bit, absent fields absent, damaged files named."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_gspo.samples import TrainSample
from megatron_gspo.samples.recorded_batch import (
    RecordedBatch,
    RecordedBatchError,
    check_recorded_batch,
    read_recorded_batch,
    recorded_batch_path,
    write_recorded_batch,
)


def _samples() -> list[TrainSample]:
    generator = torch.Generator().manual_seed(0)
    first = TrainSample(
        tokens=torch.tensor([5, 6, 7, 8, 9], dtype=torch.int64),
        prompt_length=2,
        group_id=3,
        loss_mask=torch.tensor([True, False, True]),
        rollout_log_probs=torch.randn(3, generator=generator),
        rollout_weight_versions=torch.tensor([4, 4, 5]),
        rollout_routes=torch.randint(0, 200, (4, 2, 2), generator=generator, dtype=torch.uint8),
        # R3 with replayed weights: the engine's combine weights beside the ids, float32.
        rollout_route_weights=torch.rand(4, 2, 2, generator=generator),
        turns=torch.tensor([0, -1, 1], dtype=torch.int16),
        turn_rewards=torch.tensor([0.25, 1 / 3], dtype=torch.float64),
        reward=1 / 7,
        finish_reason="length",
        weight_version=4,
        metadata={"task": "copy", "source": "a.jsonl:3"},
    )
    # No loss mask, no routes, no turns: what a single completion of an engine without R3 has.
    second = TrainSample(
        tokens=torch.tensor([1, 2, 3], dtype=torch.int64),
        prompt_length=1,
        group_id=3,
        rollout_log_probs=torch.tensor([-math.pi, -1e-30]),
        reward=-0.0,
    )
    return [first, second]


def _assert_samples_equal(want: TrainSample, got: TrainSample) -> None:
    for field in dataclasses.fields(TrainSample):
        expected, actual = getattr(want, field.name), getattr(got, field.name)
        if isinstance(expected, torch.Tensor):
            assert actual.dtype == expected.dtype and torch.equal(actual, expected), field.name
        else:
            assert actual == expected and type(actual) is type(expected), field.name


def test_a_batch_reads_back_bit_for_bit(tmp_path):
    samples = _samples()
    metrics = {"time/rollout_s": 0.125, "data_epoch": 0.0, "partial_sample_frac": 1 / 3}
    path = write_recorded_batch(tmp_path, RecordedBatch(7, samples, [3], [9], metrics))
    assert path == recorded_batch_path(tmp_path, 7) and check_recorded_batch(tmp_path, 7) is None
    batch = read_recorded_batch(tmp_path, 7)
    assert (batch.step, batch.trained_prompts, batch.dropped_prompts) == (7, [3], [9])
    assert batch.metrics == metrics
    assert len(batch.samples) == len(samples)
    for want, got in zip(samples, batch.samples):
        _assert_samples_equal(want, got)
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_and_damaged_files_are_named(tmp_path):
    with pytest.raises(
        RecordedBatchError, match="step_000002.safetensors is missing; record the step again"
    ):
        read_recorded_batch(tmp_path, 2)
    path = write_recorded_batch(tmp_path, RecordedBatch(2, _samples(), [3]))
    path.write_bytes(path.read_bytes()[:-10])  # cut short, as by a full disk
    with pytest.raises(RecordedBatchError, match="step_000002.safetensors is damaged"):
        read_recorded_batch(tmp_path, 2)
    assert "damaged" in check_recorded_batch(tmp_path, 2)
    path.write_bytes(b"not a safetensors file")
    assert "damaged" in check_recorded_batch(tmp_path, 2)
    assert "missing" in check_recorded_batch(tmp_path, 3)


def test_a_file_of_another_step_is_refused(tmp_path):
    path = write_recorded_batch(tmp_path, RecordedBatch(1, _samples(), [3]))
    path.rename(recorded_batch_path(tmp_path, 4))
    with pytest.raises(RecordedBatchError, match="step 1; expected .* step 4"):
        read_recorded_batch(tmp_path, 4)
    assert "step 1" in check_recorded_batch(tmp_path, 4)
