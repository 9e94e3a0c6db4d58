"""Per-turn advantages (multi-turn episodes) against hand-computed float64 values, and their
reduction to per-sequence advantages."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import AdvantageSettings, compute_advantages, turn_advantages

EPS = 1e-6


def padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    rewards = torch.zeros(len(rows), width, dtype=torch.float64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        rewards[index, : len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[index, : len(row)] = True
    return rewards, mask


# Group 0: three episodes of 2, 3 and 1 turns; group 7: two one-turn episodes.
TURN_REWARDS = [[0.5, 1.0], [0.0, 0.0, 2.0], [1.0], [3.0], [1.0]]
GROUPS = torch.tensor([0, 0, 0, 7, 7])


def test_grpo_per_turn_hand_computed():
    rewards, mask = padded(TURN_REWARDS)
    advantages = turn_advantages(rewards, mask, GROUPS, estimator="grpo", eps=EPS)
    # Rewards-to-go: group 0 -> [1.5, 1.0], [2, 2, 2], [1]; group 7 -> [3], [1].
    # Turn 0 of group 0: {1.5, 2, 1}, mean 1.5, unbiased std 0.5.
    # Turn 1 of group 0: {1, 2}, mean 1.5, std sqrt(0.5). Turn 2: {2} alone -> 0.
    # Turn 0 of group 7: {3, 1}, mean 2, std sqrt(2).
    half, root2 = 0.5 + EPS, math.sqrt(0.5) + EPS
    expected = torch.tensor(
        [
            [0.0, -0.5 / root2, 0.0],
            [0.5 / half, 0.5 / root2, 0.0],
            [-0.5 / half, 0.0, 0.0],
            [1.0 / (math.sqrt(2) + EPS), 0.0, 0.0],
            [-1.0 / (math.sqrt(2) + EPS), 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-12)


def test_rloo_and_batch_reinforce_per_turn_hand_computed():
    rewards, mask = padded(TURN_REWARDS)
    rloo = turn_advantages(rewards, mask, GROUPS, estimator="rloo")
    # RLOO: r - mean of the others. Turn 0 group 0: 1.5 - 1.5, 2 - 1.25, 1 - 1.75.
    assert rloo[:, 0].tolist() == pytest.approx([0.0, 0.75, -0.75, 2.0, -2.0])
    assert rloo[:2, 1].tolist() == pytest.approx([-1.0, 1.0])
    batch = turn_advantages(
        rewards, mask, GROUPS, estimator="reinforce", reinforce_baseline="batch"
    )
    # Turn 0 over the batch: {1.5, 2, 1, 3, 1}, mean 1.7; turn 1: {1, 2}; turn 2: {2}.
    assert batch[:, 0].tolist() == pytest.approx([-0.2, 0.3, -0.7, 1.3, -0.7])
    assert batch[:2, 1].tolist() == pytest.approx([-0.5, 0.5])
    assert batch[1, 2] == 0.0


def token_inputs():
    """Response tokens per sample: turn of each token (-1: observation), and the loss mask."""
    turns = [
        [0, 0, -1, -1, 1],
        [0, -1, 1, -1, 2],
        [0, 0, 0, -2, -2],  # one turn of 3 tokens, then padding
        [0, -2, -2, -2, -2],
        [0, 0, -2, -2, -2],
    ]
    token_turns = torch.tensor(turns).clamp(min=-1)
    mask = torch.tensor(turns) >= 0
    return token_turns, mask


def test_tokens_take_their_turns_advantage_and_observations_zero():
    rewards, turn_mask = padded(TURN_REWARDS)
    token_turns, mask = token_inputs()
    settings = AdvantageSettings(estimator="grpo", per_turn=True)
    advantages, _ = compute_advantages(
        torch.zeros(5),
        GROUPS,
        settings,
        turn_rewards=rewards,
        turn_mask=turn_mask,
        token_turns=token_turns,
        response_mask=mask,
    )
    by_turn = turn_advantages(rewards, turn_mask, GROUPS, estimator="grpo").float()
    for row in range(5):
        for column in range(5):
            turn = int(token_turns[row, column])
            expected = by_turn[row, turn] if mask[row, column] else 0.0
            assert advantages[row, column] == expected, (row, column)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_one_turn_per_sample_is_the_sequence_advantage(estimator):
    rewards = torch.tensor([0.1, 0.9, 0.4, 1.0, 0.0, 0.3], dtype=torch.float64)
    groups = torch.tensor([3, 3, 3, 5, 5, 5])
    sequence, _ = compute_advantages(rewards, groups, AdvantageSettings(estimator=estimator))
    per_turn = turn_advantages(
        rewards.unsqueeze(1), torch.ones(6, 1, dtype=torch.bool), groups, estimator=estimator
    )
    assert torch.equal(per_turn[:, 0].float(), sequence)


def test_equal_turns_with_an_outcome_reward_only_is_the_sequence_advantage():
    """Every sample of a group has three turns and only the last one is rewarded: every turn's
    reward-to-go is the reward, so every token gets the sequence advantage (GSPO-token with
    these equals GSPO)."""
    outcome = torch.tensor([0.2, 0.7, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 1, 1])
    rewards = torch.zeros(4, 3, dtype=torch.float64)
    rewards[:, 2] = outcome
    per_turn = turn_advantages(
        rewards, torch.ones(4, 3, dtype=torch.bool), groups, estimator="grpo"
    )
    sequence, _ = compute_advantages(outcome, groups, AdvantageSettings(estimator="grpo"))
    for turn in range(3):
        assert torch.equal(per_turn[:, turn].float(), sequence)


def test_per_turn_excludes_reward_normalisation():
    with pytest.raises(ValueError, match="per-turn"):
        AdvantageSettings(estimator="grpo", per_turn=True, reward_norm="group")
