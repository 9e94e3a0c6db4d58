"""DAPO dynamic sampling (``production.collect_informative_groups``) with the embedded engine on
the synthetic task: which groups are kept, the data accounting, seeds across rounds, filling."""

from __future__ import annotations

import logging

import pytest

from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.production.producer import ScoredSamples
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.single_turn import SingleTurnProducer
from megatron_gspo.production.step_batch import (
    collect_step_batch,
    is_informative,
    merge_round_metrics,
)
from megatron_gspo.production.task import build_task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout.embedded import EmbeddedEngine

MODULE = f"{__name__.rpartition('.')[0]}.binary_rewards".lstrip(".")


class RecordingProducer(SingleTurnProducer):
    """The single-turn producer, remembering every call (prompts, first_index, samples)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls: list[tuple[list, int, ScoredSamples]] = []

    def produce(self, prompts, step, *, first_index=0):
        scored = super().produce(prompts, step, first_index=first_index)
        self.calls.append((list(prompts), first_index, scored))
        return scored


def make(reward: str, **algo):
    cfg = from_dict(
        TrainConfig,
        {
            "algo": {
                "rollout_batch_size": 4,
                "num_return_sequences_in_group": 2,
                "num_mini_batches": 1,
                "dynamic_sampling": True,
                **algo,
            },
            "reward": {"functions": [f"{MODULE}:{reward}"], "executor": "thread"},
            "model": {"init_std": 0.2},
        },
    )
    task = build_task(cfg)
    engine = EmbeddedEngine(cfg.model, seed=3)
    rewards = RewardRunner(cfg.reward)
    producer = RecordingProducer(engine, task, rewards, Sampling.training(cfg))
    return cfg, task, producer, (engine, rewards)


@pytest.fixture(scope="module")
def collected():
    cfg, task, producer, owned = make("first_digit_is_even")
    batches = [collect_step_batch(producer, task.stream, step, cfg) for step in range(1)]
    yield cfg, task, producer, batches
    for resource in owned:
        resource.close()


def test_the_batch_holds_the_first_informative_groups_in_order(collected):
    cfg, _, producer, batches = collected
    calls_of_step = [producer.calls[: int(batches[0].metrics["dynamic_sampling/rounds"])]]
    produced = [
        scored.samples[i * 2 : (i + 1) * 2]
        for _, _, scored in calls_of_step[0]
        for i in range(len(scored.samples) // 2)
    ]
    informative = [group for group in produced if is_informative(group)]
    assert len(informative) >= cfg.algo.rollout_batch_size, "the seed gives too few: pick another"
    expected = [s for group in informative[: cfg.algo.rollout_batch_size] for s in group]
    assert batches[0].samples == expected
    assert len(informative) < len(produced), "nothing was dropped: the test shows nothing"
    metrics = batches[0].metrics
    assert metrics["dynamic_sampling/filled_groups"] == 0.0
    assert metrics["dynamic_sampling/prompts_consumed"] == len(produced)
    assert metrics["dynamic_sampling/informative_group_frac"] == len(informative) / len(produced)
    assert metrics["dynamic_sampling/kept_group_frac"] == 4 / len(produced)
    rewards = [s.reward for group in produced for s in group]
    assert metrics["dynamic_sampling/reward_mean_produced"] == pytest.approx(
        sum(rewards) / len(rewards)
    )


def test_every_drawn_prompt_is_consumed_exactly_once(collected):
    _, task, producer, batches = collected
    consumed = sum(b.metrics["dynamic_sampling/prompts_consumed"] for b in batches)
    assert task.stream.consumed == consumed  # the checkpointed cursor is past every drawn prompt
    group_ids = [p.group_id for prompts, _, _ in producer.calls for p in prompts]
    assert group_ids == list(range(int(consumed)))  # no prompt served twice, none skipped
    kept_ids = [s.group_id for b in batches for s in b.samples]
    assert kept_ids == sorted(kept_ids)


def test_later_rounds_of_a_step_sample_with_new_seeds(collected):
    _, _, producer, batches = collected
    rounds = int(batches[0].metrics["dynamic_sampling/rounds"])
    assert rounds >= 2, "one round: the test shows nothing"
    first_indices = [first_index for _, first_index, _ in producer.calls[:rounds]]
    sizes = [len(prompts) for prompts, _, _ in producer.calls[:rounds]]
    assert first_indices == [sum(sizes[:k]) for k in range(rounds)]


def test_a_step_short_of_informative_groups_is_filled_and_warned(caplog):
    cfg, task, producer, owned = make("constant", dynamic_sampling_max_rounds=2)
    try:
        with caplog.at_level(logging.WARNING):
            batch = collect_step_batch(producer, task.stream, 0, cfg)
    finally:
        for resource in owned:
            resource.close()
    metrics = batch.metrics
    assert len(batch.samples) == 8
    assert metrics["dynamic_sampling/rounds"] == 2.0
    assert metrics["dynamic_sampling/filled_groups"] == 4.0
    assert metrics["dynamic_sampling/kept_group_frac"] == 0.0
    assert task.stream.consumed == metrics["dynamic_sampling/prompts_consumed"] == 8.0
    assert "filled the batch with 4 groups" in caplog.text


def test_round_metrics_merge():
    merged = merge_round_metrics(
        [
            (
                {
                    "time/rollout_s": 1.0,
                    "reward_errors": 1.0,
                    "reward_x_mean": 0.0,
                    "reward_min": 0.2,
                },
                2,
            ),
            (
                {
                    "time/rollout_s": 2.0,
                    "reward_errors": 0.0,
                    "reward_x_mean": 1.0,
                    "reward_min": 0.1,
                },
                6,
            ),
        ]
    )
    assert merged == {
        "time/rollout_s": 3.0,
        "reward_errors": 1.0,
        "reward_x_mean": 0.75,
        "reward_min": 0.1,
    }
