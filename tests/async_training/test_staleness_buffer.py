"""The staleness buffer: groups fresh enough for a weight version, the others handed back."""

from __future__ import annotations

import torch

from megatron_gspo.data.prompts import Prompt
from megatron_gspo.driver.staleness import ScoredGroup, StalenessBuffer
from megatron_gspo.metrics.step import staleness_metrics
from megatron_gspo.samples import TrainSample


def sample(*versions: int) -> TrainSample:
    return TrainSample(
        tokens=torch.arange(2 + len(versions)),
        prompt_length=2,
        rollout_weight_versions=torch.tensor(versions),
        weight_version=min(versions),
    )


def group(prompt_id: int, *samples: TrainSample) -> ScoredGroup:
    prompt = Prompt([1], "", None, {}, "test", group_id=prompt_id)
    return ScoredGroup(prompt, list(samples), chunk=0)


def test_take_hands_out_fresh_groups_in_order_and_removes_stale_ones():
    buffer = StalenessBuffer(max_staleness=1)
    buffer.put([group(0, sample(3, 3)), group(1, sample(4), sample(2, 4)), group(2, sample(4))])
    buffer.put([group(3, sample(5, 5)), group(4, sample(4, 5))])
    # At version 5 the bound is 4: group 1 has a sample whose first token came from version 2.
    batch, stale = buffer.take(version=5, count=2)
    assert [g.prompt.group_id for g in stale] == [0, 1]
    assert [g.prompt.group_id for g in batch] == [2, 3]
    assert [g.oldest_version for g in batch] == [4, 5]
    # Not enough fresh groups: nothing handed out, nothing lost.
    batch, stale = buffer.take(version=5, count=2)
    assert batch is None and stale == [] and len(buffer) == 1
    batch, stale = buffer.take(version=6, count=1)
    assert batch is None and [g.prompt.group_id for g in stale] == [4]


def test_bound_zero_takes_only_samples_of_the_trainers_version():
    buffer = StalenessBuffer(max_staleness=0)
    buffer.put([group(0, sample(2)), group(1, sample(3))])
    batch, stale = buffer.take(version=3, count=1)
    assert [g.prompt.group_id for g in batch] == [1] and [g.prompt.group_id for g in stale] == [0]


def test_staleness_metrics_count_versions_and_segments():
    samples = [sample(5, 5, 5), sample(4, 4, 5), sample(3, 4, 4, 5)]
    metrics = staleness_metrics(samples, version=5, max_staleness=2)
    assert metrics["staleness_mean"] == (0 + 1 + 2) / 3 and metrics["staleness_max"] == 2
    assert [metrics[f"staleness_hist/{k}"] for k in range(3)] == [1 / 3, 1 / 3, 1 / 3]
    assert metrics["token_staleness_mean"] == (0 + 0 + 0 + 1 + 1 + 0 + 2 + 1 + 1 + 0) / 10
    assert metrics["partial_sample_frac"] == 2 / 3
    assert metrics["segments_per_sample"] == (1 + 2 + 3) / 3


def test_busy_time_within_a_window_counts_overlaps_only():
    from megatron_gspo.driver.background import BusyWindow

    window = BusyWindow(intervals=[(0.0, 2.0), (3.0, 5.0)], busy_since=7.0)
    assert window.busy_within(1.0, 4.0) == 1.0 + 1.0
    assert window.busy_within(5.0, 6.0) == 0.0
    assert window.busy_within(6.0, 8.0) == 1.0  # the interval still running counts up to the end
    window.forget_before(2.5)
    assert window.intervals == [(3.0, 5.0)]
