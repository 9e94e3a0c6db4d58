"""DAPO's over-long reward shaping and the truncation mask, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import ConfigError, TrainConfig, from_dict
from megatron_gspo.production.producer import finish_samples
from megatron_gspo.production.sampling import FinishSettings
from megatron_gspo.reward.shaping import overlong_penalty
from megatron_gspo.samples import TrainSample


@pytest.mark.parametrize(
    "num_tokens, expected",
    # L_max = 20, L_cache = 5: no penalty up to 15 tokens, then -(n - 15) / 5, -1 from 20 on.
    [(1, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (19, -0.8), (20, -1.0), (21, -1.0)],
)
def test_overlong_penalty_hand_computed(num_tokens, expected):
    assert overlong_penalty(num_tokens, 20, 5) == pytest.approx(expected, abs=1e-12)
    assert overlong_penalty(num_tokens, 20, 5, factor=0.5) == pytest.approx(expected / 2)


def test_overlong_penalty_off_and_bad_buffers():
    assert overlong_penalty(20, 20, 0) == 0.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(5, 10, 11)


def sample(response: int, finish_reason: str = "stop", reward: float = 1.0) -> TrainSample:
    return TrainSample(
        tokens=torch.arange(3 + response),
        prompt_length=3,
        reward=reward,
        finish_reason=finish_reason,
        loss_mask=torch.zeros(response, dtype=torch.bool) if finish_reason == "abort" else None,
    )


def config(**algo_and_reward) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "algo": {"response_length": 10, **algo_and_reward.get("algo", {})},
            "reward": algo_and_reward.get("reward", {}),
        },
    )


def test_finish_samples_shapes_rewards_and_masks_truncated_responses():
    samples = [sample(4), sample(8), sample(10, "length"), sample(9, "abort", reward=0.0)]
    cfg = config(
        algo={"mask_truncated": True},
        reward={"overlong_buffer": 4, "overlong_penalty_factor": 2.0},
    )
    metrics = finish_samples(samples, FinishSettings.from_config(cfg))
    # Penalty from 6 tokens on: -2 * (n - 6) / 4; the aborted sample is left alone.
    assert [s.reward for s in samples] == pytest.approx([1.0, 0.0, -1.0, 0.0])
    assert metrics["reward_overlong_penalty_mean"] == pytest.approx((0 - 1 - 2) / 4)
    assert metrics["reward_overlong_penalized_frac"] == 0.5
    assert metrics["truncated_masked_frac"] == 0.25
    assert [bool(s.response_mask().any()) for s in samples] == [True, True, False, False]


def test_finish_samples_off_changes_nothing():
    samples = [sample(10, "length"), sample(3)]
    assert finish_samples(samples, FinishSettings.from_config(config())) == {}
    assert [s.reward for s in samples] == [1.0, 1.0]
    assert all(s.loss_mask is None for s in samples)


def test_a_buffer_longer_than_the_response_limit_is_a_config_error():
    with pytest.raises(ConfigError, match="reward.overlong_buffer"):
        config(reward={"overlong_buffer": 11})
