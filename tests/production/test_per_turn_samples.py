"""Per-turn samples (``agent.per_turn_samples``) get the advantages their episode would: the
advantage stage counts an episode's turn samples as the one episode, per sequence and per turn."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gspo.algo.advantages import AdvantageSettings, RunningMoments
from megatron_gspo.samples import TrainSample
from megatron_gspo.trainer.stages import assign_advantages


def _episode(group: int, reward: float, turn_lengths: list[int]) -> TrainSample:
    turns = torch.cat([torch.full((n,), k, dtype=torch.int16) for k, n in enumerate(turn_lengths)])
    return TrainSample(
        tokens=torch.arange(2 + len(turns)),
        prompt_length=2,
        group_id=group,
        loss_mask=torch.ones(len(turns), dtype=torch.bool),
        turns=turns,
        turn_rewards=torch.zeros(len(turn_lengths), dtype=torch.float64),
        reward=reward,
    )


def _split(episode: TrainSample, key: str) -> list[TrainSample]:
    samples, start = [], 0
    for turn in range(len(episode.turn_rewards)):
        length = int((episode.turns == turn).sum())
        samples.append(
            dataclasses.replace(
                episode,
                tokens=torch.arange(3 + length),
                prompt_length=3,
                loss_mask=torch.ones(length, dtype=torch.bool),
                turns=episode.turns[start : start + length],
                metadata={"episode": key},
            )
        )
        start += length
    return samples


@pytest.mark.parametrize("per_turn", [False, True])
def test_turn_samples_get_their_episodes_advantages(per_turn):
    settings = AdvantageSettings(estimator="grpo", per_turn=per_turn)
    episodes = [
        _episode(0, 1.0, [2, 3, 1]),
        _episode(0, 0.0, [4]),
        _episode(0, 0.5, [1, 1]),
        _episode(1, 0.2, [2, 2]),
        _episode(1, 0.9, [3]),
    ]
    whole = [dataclasses.replace(e) for e in episodes]
    assign_advantages(whole, settings, RunningMoments())
    split = [_split(e, str(i)) for i, e in enumerate(episodes)]
    assign_advantages([s for parts in split for s in parts], settings, RunningMoments())
    for episode, parts in zip(whole, split):
        joined = torch.cat(
            [part.advantages.reshape(-1).expand(part.response_length) for part in parts]
        )
        expected = episode.advantages.reshape(-1).expand(episode.response_length)
        torch.testing.assert_close(joined, expected, rtol=0, atol=0)
