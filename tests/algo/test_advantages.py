"""Reward processing and advantage estimators against per-group float64 references (pitfall 20)."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from megatron_gspo.algo import (
    AdvantageSettings,
    RunningMoments,
    add_token_level_kl,
    compute_advantages,
    estimate_advantages,
    finish_advantages,
    normalize_rewards,
    whiten,
)

from .reference import (
    groups_of,
    reference_advantages,
    reference_token_level_kl,
    reference_whiten,
    std_of,
)

# Shuffled, ragged prompt ids: groups 7 (3), 3 (4), 11 (3), and singletons 42 and 5.
GROUP_IDS = [7, 3, 7, 11, 3, 7, 42, 11, 3, 3, 5, 11]
REWARDS = [0.3, 1.0, -0.4, 2.5, 0.0, 1.7, 0.9, -1.2, 0.5, 0.25, -0.6, 0.8]
LENGTHS = [5, 1, 7, 3, 3, 2, 6, 4, 1, 2, 5, 3]
SINGLETONS = [6, 10]


def tensors(rewards=REWARDS, group_ids=GROUP_IDS):
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_ids)


def assert_list_close(actual: torch.Tensor, expected: list[float], rel=1e-12, abs_=1e-14):
    assert actual.shape == (len(expected),)
    for got, want in zip(actual.tolist(), expected):
        assert got == pytest.approx(want, rel=rel, abs=abs_)


@pytest.mark.parametrize("eps", [1e-6, 1e-4])
@pytest.mark.parametrize("unbiased", [True, False], ids=["bessel", "population"])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators(estimator, unbiased, eps):
    rewards, ids = tensors()
    result = estimate_advantages(rewards, ids, estimator=estimator, unbiased=unbiased, eps=eps)
    expected = reference_advantages(REWARDS, GROUP_IDS, estimator, unbiased=unbiased, eps=eps)
    assert result.dtype == torch.float64
    assert_list_close(result, expected)
    # Through the public entry point: float32, same values.
    public, _ = compute_advantages(
        rewards, ids, AdvantageSettings(estimator=estimator, std_unbiased=unbiased, std_eps=eps)
    )
    assert public.dtype == torch.float32
    assert_list_close(public.double(), expected, rel=1e-6, abs_=1e-7)


@pytest.mark.parametrize("baseline", ["none", "group", "batch"])
def test_reinforce_baselines(baseline):
    rewards, ids = tensors()
    result = estimate_advantages(rewards, ids, estimator="reinforce", reinforce_baseline=baseline)
    assert_list_close(
        result, reference_advantages(REWARDS, GROUP_IDS, "reinforce", baseline=baseline)
    )


def test_rloo_is_leave_one_out():
    """rloo written out for group 3 (indices 1, 4, 8, 9): r_i - mean of the other three."""
    rewards, ids = tensors()
    result = estimate_advantages(rewards, ids, estimator="rloo")
    members = [1, 4, 8, 9]
    for i in members:
        others = [REWARDS[j] for j in members if j != i]
        assert float(result[i]) == pytest.approx(REWARDS[i] - sum(others) / 3, rel=1e-12)


@pytest.mark.parametrize(
    "estimator,baseline",
    [("grpo", "none"), ("dr_grpo", "none"), ("rloo", "none"), ("reinforce", "group")],
)
def test_singleton_groups_get_zero(estimator, baseline):
    rewards, ids = tensors()
    result = estimate_advantages(rewards, ids, estimator=estimator, reinforce_baseline=baseline)
    for i in SINGLETONS:
        assert float(result[i]) == 0.0


@pytest.mark.parametrize("reward_norm", [None, "group"])
@pytest.mark.parametrize(
    "estimator,baseline",
    [("grpo", "none"), ("dr_grpo", "none"), ("rloo", "none"), ("reinforce", "group")],
)
def test_all_equal_groups_get_exactly_zero(estimator, baseline, reward_norm):
    """Documented: groups whose rewards are all equal get advantage exactly 0. Rewards like 0.1
    whose float sum is inexact (0.1 + 0.1 + 0.1 != 0.3) must not leak ~1e-11 advantages."""
    rewards = [0.1, 0.1, 0.1, 1 / 3, 1 / 3, 1 / 3, 1 / 3, 0.7, 0.7, 0.2, 0.9]
    group_ids = [4, 4, 4, 9, 9, 9, 9, 2, 2, 6, 6]
    result, _ = compute_advantages(
        *tensors(rewards, group_ids),
        AdvantageSettings(
            estimator=estimator, reinforce_baseline=baseline, reward_norm=reward_norm
        ),
    )
    assert result[:9].tolist() == [0.0] * 9
    assert (result[9:] != 0).all()


@pytest.mark.parametrize("mode", ["full", "shift", "scale"])
@pytest.mark.parametrize("unbiased", [True, False], ids=["bessel", "population"])
@pytest.mark.parametrize("scope", ["batch", "group"])
def test_normalize_rewards(scope, unbiased, mode):
    rewards, ids = tensors()
    eps = 1e-6
    result = normalize_rewards(
        rewards, ids, scope=scope, shift_only=mode == "shift", scale_only=mode == "scale",
        unbiased=unbiased, eps=eps,
    )  # fmt: skip
    expected = [0.0] * len(REWARDS)
    members_of = groups_of(GROUP_IDS) if scope == "group" else {0: list(range(len(REWARDS)))}
    for members in members_of.values():
        values = [REWARDS[i] for i in members]
        mean, std = statistics.fmean(values), std_of(values, unbiased)
        for i in members:
            expected[i] = {
                "full": (REWARDS[i] - mean) / (std + eps),
                "shift": REWARDS[i] - mean,
                # Scale-only leaves rewards without spread unscaled (no std to divide by).
                "scale": REWARDS[i] / (std + eps) if std > 0 else REWARDS[i],
            }[mode]
    assert_list_close(result, expected)


def test_normalize_none_is_identity():
    rewards, ids = tensors()
    assert normalize_rewards(rewards, ids, scope=None).tolist() == REWARDS


@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("mode", ["full", "shift", "scale"])
def test_running_normalisation_and_state(mode, unbiased):
    """After each batch the state holds the mean and population variance of every reward seen so
    far, and the batch is normalised with the state that already includes it (its std Bessel-
    corrected when ``unbiased``)."""
    batches = [REWARDS[:5], REWARDS[5:6], REWARDS[6:]]
    running = RunningMoments()
    seen: list[float] = []
    for batch in batches:
        seen += batch
        rewards = torch.tensor(batch, dtype=torch.float64)
        result = normalize_rewards(
            rewards, torch.zeros(len(batch), dtype=torch.long), scope="running",
            shift_only=mode == "shift", scale_only=mode == "scale", running=running,
            unbiased=unbiased,
        )  # fmt: skip
        mean = statistics.fmean(seen)
        std = statistics.stdev(seen) if unbiased and len(seen) > 1 else statistics.pstdev(seen)
        assert running.count == len(seen)
        assert running.mean == pytest.approx(mean, rel=1e-12)
        assert running.var == pytest.approx(statistics.pvariance(seen), rel=1e-12)
        expected = {
            "full": [(r - mean) / (std + 1e-6) for r in batch],
            "shift": [r - mean for r in batch],
            "scale": [r / (std + 1e-6) for r in batch],
        }[mode]
        assert_list_close(result, expected, rel=1e-10)


def test_running_state_dict_round_trip():
    running = RunningMoments()
    running.update(torch.tensor(REWARDS[:7]))
    state = json.loads(json.dumps(running.state_dict()))  # plain data, checkpointable
    restored = RunningMoments()
    restored.load_state_dict(state)
    ids = torch.zeros(5, dtype=torch.long)
    next_batch = torch.tensor(REWARDS[7:], dtype=torch.float64)
    a = normalize_rewards(next_batch, ids, scope="running", running=running)
    b = normalize_rewards(next_batch, ids, scope="running", running=restored)
    assert a.tolist() == b.tolist()
    assert running.state_dict() == restored.state_dict()


def test_running_needs_state():
    rewards, ids = tensors()
    with pytest.raises(ValueError, match="RunningMoments"):
        normalize_rewards(rewards, ids, scope="running")


def test_reward_clip_and_its_fraction():
    rewards, ids = tensors()
    clip = 1.0
    advantages, metrics = compute_advantages(
        rewards, ids, AdvantageSettings(estimator="dr_grpo", reward_norm="batch", reward_clip=clip)
    )
    mean, std = statistics.fmean(REWARDS), statistics.stdev(REWARDS)
    normalised = [(r - mean) / (std + 1e-6) for r in REWARDS]
    outside = sum(abs(v) > clip for v in normalised)
    assert 0 < outside < len(REWARDS)
    assert float(metrics["reward_clip_frac"]) == pytest.approx(outside / len(REWARDS), rel=1e-12)
    clipped = [min(max(v, -clip), clip) for v in normalised]
    expected = reference_advantages(clipped, GROUP_IDS, "dr_grpo")
    assert_list_close(advantages.double(), expected, rel=1e-6, abs_=1e-7)


def test_advantage_clip_sequence_fraction():
    """Without whitening the advantage clip fraction counts sequences."""
    rewards, ids = tensors()
    clip = 0.6
    advantages, metrics = compute_advantages(
        rewards, ids, AdvantageSettings(estimator="dr_grpo", advantage_clip=clip)
    )
    raw = reference_advantages(REWARDS, GROUP_IDS, "dr_grpo")
    outside = sum(abs(a) > clip for a in raw)
    assert 0 < outside < len(raw)
    assert float(metrics["advantage_clip_frac"]) == pytest.approx(outside / len(raw), rel=1e-12)
    assert_list_close(advantages.double(), [min(max(a, -clip), clip) for a in raw], 1e-6, 1e-7)


def test_whitening_then_advantage_clip_token_weighted():
    """Whitening weights each sequence by its tokens; the clip fraction then counts tokens."""
    rewards, ids = tensors()
    clip = 1.0
    advantages, metrics = compute_advantages(
        rewards,
        ids,
        AdvantageSettings(estimator="grpo", whiten=True, advantage_clip=clip),
        response_lengths=torch.tensor(LENGTHS),
    )
    white = reference_whiten(reference_advantages(REWARDS, GROUP_IDS, "grpo"), LENGTHS)
    outside_tokens = sum(n for a, n in zip(white, LENGTHS) if abs(a) > clip)
    assert 0 < outside_tokens < sum(LENGTHS)
    assert float(metrics["advantage_clip_frac"]) == pytest.approx(
        outside_tokens / sum(LENGTHS), rel=1e-12
    )
    assert_list_close(advantages.double(), [min(max(a, -clip), clip) for a in white], 1e-6, 1e-7)


def test_whiten_needs_lengths():
    rewards, ids = tensors()
    with pytest.raises(ValueError, match="response_lengths"):
        compute_advantages(rewards, ids, AdvantageSettings(estimator="grpo", whiten=True))


def test_whiten_sequence_values_by_token_counts():
    values = torch.tensor(REWARDS, dtype=torch.float64)
    result = whiten(values, torch.tensor(LENGTHS))
    assert_list_close(result, reference_whiten(REWARDS, LENGTHS))
    # Token-weighted: mean over tokens is 0 and the unbiased token variance is ~1.
    tokens = [a for a, n in zip(result.tolist(), LENGTHS) for _ in range(n)]
    assert statistics.fmean(tokens) == pytest.approx(0.0, abs=1e-12)
    assert statistics.variance(tokens) == pytest.approx(1.0, rel=1e-6)


def test_whiten_per_token_values_with_mask():
    generator = torch.Generator().manual_seed(14)
    values = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) > 0.4
    values_masked = torch.where(mask, values, torch.full_like(values, 1e6))  # never counted
    result = whiten(values_masked, mask)
    valid = values[mask].tolist()
    mean, var = statistics.fmean(valid), statistics.variance(valid)
    expected = torch.where(mask, (values - mean) / math.sqrt(var + 1e-8), 0.0)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-14)


def test_whiten_fewer_than_two_tokens_is_identity():
    values = torch.tensor([0.7, -0.2], dtype=torch.float64)
    assert whiten(values, torch.tensor([1, 0])).tolist() == values.tolist()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_add_token_level_kl(estimator):
    generator = torch.Generator().manual_seed(15)
    mask = torch.tensor(
        [[1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]],
        dtype=torch.bool,
    )
    old = -3 * torch.rand(4, 6, generator=generator, dtype=torch.float64)
    ref = old + torch.randn(4, 6, generator=generator, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    coef = 0.2
    result, kl = add_token_level_kl(advantages, old, ref, mask, coef=coef, estimator=estimator)
    expected = reference_token_level_kl(advantages.tolist(), old, ref, mask, coef, estimator)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-14)
    assert bool((kl[~mask] == 0).all())


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
def test_add_token_level_kl_ignores_masked_positions(fill):
    """Values at non-response positions (padding) must not leak into the reverse cumulative sum."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 0, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0, 0.0], [0.0, -1.5, 0.0, -0.2, 0.0]])
    ref = old + 0.3
    advantages = torch.tensor([1.0, -1.0])
    clean, _ = add_token_level_kl(advantages, old, ref, mask, coef=0.1, estimator="k3")
    dirty_old = torch.where(mask, old, torch.full_like(old, fill))
    dirty_ref = torch.where(mask, ref, torch.full_like(ref, fill))
    dirty, kl = add_token_level_kl(advantages, dirty_old, dirty_ref, mask, coef=0.1, estimator="k3")
    assert torch.isfinite(kl).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def test_finish_advantages_per_token():
    """The token-level-KL path: [B, T] advantages whitened over the mask, clip counted by tokens."""
    generator = torch.Generator().manual_seed(16)
    values = 2 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    result, metrics = finish_advantages(values, mask, whiten_advantages=True, advantage_clip=1.0)
    valid = values[mask].tolist()
    mean, var = statistics.fmean(valid), statistics.variance(valid)
    white = torch.where(mask, (values - mean) / math.sqrt(var + 1e-8), 0.0)
    torch.testing.assert_close(result, white.clamp(-1.0, 1.0), rtol=1e-12, atol=1e-14)
    outside = int(((white.abs() > 1.0) & mask).sum())
    assert 0 < outside < int(mask.sum())
    assert float(metrics["advantage_clip_frac"]) == pytest.approx(outside / int(mask.sum()))


def test_unknown_estimator_and_baseline():
    rewards, ids = tensors()
    with pytest.raises(ValueError, match="ppo"):
        estimate_advantages(rewards, ids, estimator="ppo")
    with pytest.raises(ValueError, match="median"):
        estimate_advantages(rewards, ids, estimator="reinforce", reinforce_baseline="median")


def test_token_level_kl_through_compute_advantages():
    """KL-in-reward on: sequence advantages, then the per-token KL return, then whitening and the
    advantage clip over the response tokens (step 4 before 5 and 6)."""
    generator = torch.Generator().manual_seed(17)
    rewards, ids = tensors()
    width = max(LENGTHS)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    old = -3 * torch.rand(len(REWARDS), width, generator=generator, dtype=torch.float64)
    ref = old + torch.randn(len(REWARDS), width, generator=generator, dtype=torch.float64)
    coef, clip = 0.2, 1.0
    settings = AdvantageSettings(
        estimator="grpo", token_level_kl_coef=coef, whiten=True, advantage_clip=clip
    )
    assert settings.per_token
    advantages, metrics = compute_advantages(
        rewards, ids, settings, response_lengths=torch.tensor(LENGTHS),
        old_log_probs=old, ref_log_probs=ref, response_mask=mask,
    )  # fmt: skip
    sequence = reference_advantages(REWARDS, GROUP_IDS, "grpo")
    token = reference_token_level_kl(sequence, old, ref, mask, coef, "k1")
    valid = token[mask].tolist()
    mean, var = statistics.fmean(valid), statistics.variance(valid)
    white = torch.where(mask, (token - mean) / math.sqrt(var + 1e-8), 0.0)
    assert advantages.shape == mask.shape and advantages.dtype == torch.float32
    torch.testing.assert_close(advantages.double(), white.clamp(-clip, clip), rtol=1e-5, atol=1e-6)
    kl = torch.where(mask, old - ref, 0.0)
    assert float(metrics["token_level_kl"]) == pytest.approx(float(kl.sum() / mask.sum()))
    outside = int(((white.abs() > clip) & mask).sum())
    assert 0 < outside < int(mask.sum())
    assert float(metrics["advantage_clip_frac"]) == pytest.approx(outside / int(mask.sum()))
    with pytest.raises(ValueError, match="KL-in-reward"):
        compute_advantages(rewards, ids, settings, response_lengths=torch.tensor(LENGTHS))


def test_unknown_settings_raise():
    with pytest.raises(ValueError, match="estimator"):
        AdvantageSettings(estimator="ppo")
    with pytest.raises(ValueError, match="reward_norm"):
        AdvantageSettings(estimator="grpo", reward_norm="global")
