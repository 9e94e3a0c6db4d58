"""Reward processing and advantage estimators (pure torch, no Megatron).

Shapes: ``B`` samples in a rollout batch, ``T`` response tokens. Rewards are one scalar per
sample ``[B]``; ``group_ids`` ``[B]`` (int) name each sample's prompt. Groups are formed from
these ids, never by reshaping, so ragged or shuffled groups are handled exactly.

Pipeline (ROLL's order, rlvr_pipeline / functionals.py):

1. ``normalize_rewards``: ``reward_norm`` in {batch, group, running, None}; full
   ``(r - mean) / (std + eps)``, shift-only ``r - mean`` or scale-only ``r / (std + eps)``.
2. ``reward_clip``: clamp to ``[-c, c]``.
3. estimator: ``grpo`` ``(r - mean_g) / (std_g + eps)``; ``dr_grpo`` ``r - mean_g``;
   ``reinforce`` ``r - b`` with ``b`` in {0, mean_g, mean_batch}; ``rloo``
   ``r - mean_{g, j != i}`` = ``n / (n - 1) (r - mean_g)``.
4. optional per-token KL-in-reward (:func:`add_token_level_kl`), making advantages ``[B, T]``.
5. ``whiten``: token-weighted masked whitening ``(A - mu) / sqrt(var + 1e-8)``.
6. ``advantage_clip``: clamp to ``[-c, c]``.

Per-turn advantages (``AdvantageSettings.per_turn``, multi-turn episodes; docs/algorithms.md):
sample ``i`` has ``K_i`` model turns with reward parts ``r_ik`` (the last one also holding the
outcome part of the reward). The reward-to-go ``G_ik = sum_{k' >= k} r_ik'`` (so ``G_i0`` is the
sample's reward) replaces the reward in step 3, and the estimator runs over the samples of the
group that have a turn ``k`` (:func:`turn_advantages`); every token of turn ``k`` gets
``A_ik``, observation tokens 0. With one turn per sample, or equal turn counts and only an
outcome reward, this is the per-sequence advantage on every token.

Groups of size one have no baseline to compare against: grpo, dr_grpo, rloo and reinforce with a
group baseline give them advantage 0. Groups whose rewards are all equal get advantage exactly 0
(the std is 0 and so is every numerator).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch

from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.config.loss_rules import ADV_ESTIMATORS, check_advantages

WHITEN_EPS = 1e-8  # ROLL's masked_whiten (rsqrt(var + 1e-8))


@dataclass
class RunningMoments:
    """Running mean / variance of rewards (Chan et al. parallel update), for reward_norm=running.

    Kept by the caller and saved in checkpoints so resumed runs normalise identically.
    """

    mean: float = 0.0
    var: float = 1.0
    count: float = 0.0

    def update(self, values: torch.Tensor) -> None:
        values = values.double()
        n = float(values.numel())
        if n == 0:
            return
        batch_mean = values.mean().item()
        batch_var = values.var(unbiased=False).item() if n > 1 else 0.0
        total = self.count + n
        delta = batch_mean - self.mean
        new_mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = new_mean, m2 / total, total

    def std(self, unbiased: bool = True) -> float:
        """Std of everything seen so far (Bessel-corrected when ``unbiased``)."""
        if unbiased and self.count > 1:
            return (self.var * self.count / (self.count - 1)) ** 0.5
        return self.var**0.5

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense index ``[B]`` in ``[0, G)`` for arbitrary group ids, and the number of groups G."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def group_statistics(
    values: torch.Tensor, group_ids: torch.Tensor, *, unbiased: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, group std and group size, each ``[B]``.

    The std of a group of size one is 0 (it has no spread to normalise by).
    """
    index, num_groups = _group_index(group_ids)
    values = values.to(torch.float64)
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(
        0, index, torch.ones_like(values)
    )
    sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, values)
    means = sums / counts
    # A group whose values are all equal must get a mean equal to that value bit for bit (sum /
    # count is not exact for e.g. 0.1), so that its std and advantages come out exactly 0.
    maxima = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(
        0, index, values, reduce="amax"
    )
    minima = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(
        0, index, values, reduce="amin"
    )
    means = torch.where(maxima == minima, maxima, means)
    squared = (values - means[index]) ** 2
    sq_sums = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, index, squared)
    denominators = (counts - 1).clamp(min=1) if unbiased else counts
    stds = torch.where(counts > 1, (sq_sums / denominators).sqrt(), torch.zeros_like(sq_sums))
    return means[index], stds[index], counts[index]


def _batch_statistics(values: torch.Tensor, *, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    values = values.to(torch.float64)
    if values.numel() < 2:
        return values.mean(), torch.zeros((), dtype=torch.float64)
    return values.mean(), values.std(unbiased=unbiased)


def normalize_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scope: Optional[str],
    shift_only: bool = False,
    scale_only: bool = False,
    unbiased: bool = True,
    eps: float = 1e-6,
    running: Optional[RunningMoments] = None,
) -> torch.Tensor:
    """Normalised rewards ``[B]`` (float64).

    ``scope`` None returns the rewards unchanged. ``running`` is updated with this batch *before*
    it normalises it (ROLL's RunningMoments order).
    """
    rewards = rewards.to(torch.float64)
    if scope is None:
        return rewards
    if scope == "group":
        mean, std, _ = group_statistics(rewards, group_ids, unbiased=unbiased)
    elif scope == "batch":
        mean, std = _batch_statistics(rewards, unbiased=unbiased)
    elif scope == "running":
        if running is None:
            raise ValueError("reward_norm='running' needs a RunningMoments state")
        running.update(rewards)
        mean = torch.tensor(running.mean, dtype=torch.float64)
        std = torch.tensor(running.std(unbiased), dtype=torch.float64)
    else:
        raise ValueError(f"unknown reward normalisation scope {scope!r}")
    if shift_only:
        return rewards - mean
    if scale_only:
        # Without spread (a group of one, all-equal rewards) there is no scale to divide by:
        # dividing by eps alone would multiply those rewards by 1/eps.
        return torch.where(std > 0, rewards / (std + eps), rewards)
    return (rewards - mean) / (std + eps)


def estimate_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str,
    unbiased: bool = True,
    eps: float = 1e-6,
    reinforce_baseline: str = "none",
) -> torch.Tensor:
    """Sequence advantages ``[B]`` (float64) from processed rewards (see module docstring)."""
    rewards = rewards.to(torch.float64)
    if estimator == "reinforce":
        if reinforce_baseline == "none":
            return rewards.clone()
        if reinforce_baseline == "batch":
            return rewards - rewards.mean()
        if reinforce_baseline != "group":
            raise ValueError(f"unknown reinforce baseline {reinforce_baseline!r}")
    mean, std, size = group_statistics(rewards, group_ids, unbiased=unbiased)
    singleton = size <= 1
    if estimator == "grpo":
        advantages = (rewards - mean) / (std + eps)
    elif estimator in ("dr_grpo", "reinforce"):
        advantages = rewards - mean
    elif estimator == "rloo":
        advantages = size / (size - 1).clamp(min=1) * (rewards - mean)
    else:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; known: {', '.join(ADV_ESTIMATORS)}"
        )
    return torch.where(singleton, torch.zeros_like(advantages), advantages)


def turn_advantages(
    turn_rewards: torch.Tensor,
    turn_mask: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str,
    unbiased: bool = True,
    eps: float = 1e-6,
    reinforce_baseline: str = "none",
) -> torch.Tensor:
    """Per-turn advantages ``[B, K]`` (float64; 0 where ``turn_mask`` is False).

    ``turn_rewards [B, K]``: each model turn's reward part (padding beyond a sample's turns is
    ignored); ``turn_mask [B, K]``: the turns that exist (a prefix of each row). The
    reward-to-go ``G_ik = sum_{k' >= k} r_ik'`` of turn ``k`` is compared, by ``estimator``
    (:func:`estimate_advantages`), with the reward-to-go of turn ``k`` of the other samples of
    its group that reached a turn ``k``; a ``batch`` baseline is the mean over the batch's
    samples that reached turn ``k``.
    """
    mask = turn_mask.bool()
    rewards = torch.where(
        mask, turn_rewards.to(torch.float64), torch.zeros((), dtype=torch.float64)
    )
    returns = torch.flip(torch.cumsum(torch.flip(rewards, dims=[1]), dim=1), dims=[1])
    advantages = torch.zeros_like(returns)
    for turn in range(returns.shape[1]):
        rows = mask[:, turn]
        if rows.any():
            advantages[rows, turn] = estimate_advantages(
                returns[rows, turn],
                group_ids[rows],
                estimator=estimator,
                unbiased=unbiased,
                eps=eps,
                reinforce_baseline=reinforce_baseline,
            )
    return advantages


def add_token_level_kl(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
    k3_clamp: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward (ROLL ``add_token_level_kl``): per-token advantages ``[B, T]``.

    Token rewards are ``-coef * KL_t(old || ref)`` with the sequence reward at the last response
    token; with gamma = 1 the REINFORCE return is the reverse cumulative sum, so
    ``A_{i,t} = A_i - coef * sum_{t' >= t} KL_{i,t'}``. Returns ``(advantages [B, T], kl [B, T])``.
    """
    mask = response_mask.to(torch.float64)
    kl = kl_estimate(old_log_probs.double(), ref_log_probs.double(), estimator, k3_clamp=k3_clamp)
    kl = torch.where(response_mask.bool(), kl, torch.zeros_like(kl))  # padding may hold inf/nan
    future_kl = torch.flip(torch.cumsum(torch.flip(kl, dims=[1]), dim=1), dims=[1])
    token_advantages = (advantages.double().unsqueeze(1) - coef * future_kl) * mask
    return token_advantages, kl


def whiten(advantages: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """Token-weighted whitening: ``(A - mu) / sqrt(var + 1e-8)``.

    ``advantages`` is ``[B]`` (one value per sequence, weighted by its ``token_counts`` ``[B]``) or
    ``[B, T]`` with ``token_counts`` the ``[B, T]`` mask. Mean and (unbiased) variance are over
    valid tokens, as ROLL's masked_whiten. With fewer than two valid tokens nothing changes.
    """
    weights = token_counts.to(torch.float64)
    values = advantages.to(torch.float64)
    total = weights.sum()
    if total < 2:
        return values
    mean = (values * weights).sum() / total
    var = ((values - mean) ** 2 * weights).sum() / (total - 1)
    whitened = (values - mean) * torch.rsqrt(var + WHITEN_EPS)
    return whitened * (weights > 0) if values.dim() == 2 else whitened


@dataclass(frozen=True)
class AdvantageSettings:
    """What :func:`compute_advantages` computes, fixed for a run (built once, e.g. from the
    configuration by :func:`megatron_gspo.algo.settings.advantage_settings`; checked by the rules
    the configuration checks too, :mod:`megatron_gspo.config.loss_rules`). Field ``n`` below is
    step ``n`` of the module docstring.

    ``estimator`` has no default; the other fields default to "off" or to the value their
    docstring names. A new option is a new field with an "off" default.
    """

    estimator: str
    """Step 3: ``grpo`` ``(r - mean_g) / (std_g + eps)``; ``dr_grpo`` ``r - mean_g`` (Liu et al.
    2025); ``reinforce`` ``r - b``; ``rloo`` ``r - mean_{g, j != i}``."""
    reward_norm: Optional[str] = None
    """Step 1: statistics of the reward normalisation: ``batch``, ``group``, ``running`` or None
    (rewards unchanged)."""
    reward_shift: bool = False
    """Step 1: only subtract the mean (``r - mean``)."""
    reward_scale: bool = False
    """Step 1: only divide by the spread (``r / (std + eps)``)."""
    reward_clip: Optional[float] = None
    """Step 2: clamp the normalised reward to ``+-reward_clip``; None: off."""
    std_unbiased: bool = True
    """Bessel-corrected group/batch std (torch.std, ROLL, verl, TRL) or the population std."""
    std_eps: float = 1e-6
    """Added to the std before dividing (ROLL, verl, slime)."""
    reinforce_baseline: str = "none"
    """Baseline ``b`` of ``reinforce``: ``none`` (0), ``group`` (mean_g) or ``batch``."""
    per_turn: bool = False
    """Step 3 per model turn (multi-turn episodes; module docstring): per-token advantages from
    the turns' rewards-to-go. Excludes reward normalisation, reward clip and KL-in-reward."""
    token_level_kl_coef: Optional[float] = None
    """Step 4, KL-in-reward (ROLL ``add_token_level_kl``): ``A_it = A_i - coef * sum_{t' >= t}
    KL(old || ref)_it'``; advantages become per token. None: off."""
    token_level_kl_estimator: str = "k1"
    """Estimator of the KL-in-reward term (:func:`megatron_gspo.algo.kl.kl_estimate`)."""
    kl_clamp: Optional[float] = None
    """Cap of the k3 estimate of the KL-in-reward term (as :class:`~megatron_gspo.algo.losses.
    PolicyLossSettings`); None: no cap."""
    whiten: bool = False
    """Step 5: token-weighted whitening ``(A - mu) / sqrt(var + 1e-8)`` over the batch."""
    advantage_clip: Optional[float] = None
    """Step 6: clamp the advantages to ``+-advantage_clip``; None: off."""

    def __post_init__(self) -> None:
        check_advantages(**{field.name: getattr(self, field.name) for field in fields(self)})

    @property
    def per_token(self) -> bool:
        """Whether the advantages are per token ``[B, T]`` (KL-in-reward, per turn) or per
        sequence."""
        return self.token_level_kl_coef is not None or self.per_turn


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    settings: AdvantageSettings,
    *,
    response_lengths: Optional[torch.Tensor] = None,
    running: Optional[RunningMoments] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    response_mask: Optional[torch.Tensor] = None,
    turn_rewards: Optional[torch.Tensor] = None,
    turn_mask: Optional[torch.Tensor] = None,
    token_turns: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Advantages (float32) from rewards ``[B]`` and prompt ids ``group_ids [B]``: steps 1-6 of
    the module docstring.

    Args:
        rewards, group_ids: ``[B]`` one reward and one prompt id per sample.
        settings: the estimator's configuration (:class:`AdvantageSettings`).
        response_lengths: ``[B]`` tokens per response; weights whitening by tokens (required
            with ``settings.whiten`` and per-sequence advantages).
        running: the running reward moments of ``reward_norm=running`` (updated in place).
        old_log_probs, ref_log_probs, response_mask: ``[B, T]`` (padded) inputs of KL-in-reward,
            required when ``settings.token_level_kl_coef`` is set.
        turn_rewards, turn_mask: ``[B, K]`` the turns' reward parts and which turns exist;
            token_turns ``[B, T]`` the turn of each response token (-1: an observation or
            padding); with response_mask, required when ``settings.per_turn`` is set.

    Returns:
        ``(advantages, metrics)``: ``[B]`` (or ``[B, T]`` with KL-in-reward, 0 at masked
        positions) and float64 0-d metrics ``reward_clip_frac``, ``advantage_clip_frac``,
        ``token_level_kl`` (each only when its step is on).
    """
    if settings.per_turn:
        return _per_turn_advantages(
            settings, group_ids, turn_rewards, turn_mask, token_turns, response_mask
        )
    processed = normalize_rewards(
        rewards,
        group_ids,
        scope=settings.reward_norm,
        shift_only=settings.reward_shift,
        scale_only=settings.reward_scale,
        unbiased=settings.std_unbiased,
        eps=settings.std_eps,
        running=running,
    )
    metrics = {}
    if settings.reward_clip is not None:
        metrics["reward_clip_frac"] = (processed.abs() > settings.reward_clip).double().mean()
        processed = processed.clamp(-settings.reward_clip, settings.reward_clip)
    advantages = estimate_advantages(
        processed,
        group_ids,
        estimator=settings.estimator,
        unbiased=settings.std_unbiased,
        eps=settings.std_eps,
        reinforce_baseline=settings.reinforce_baseline,
    )
    token_weights = response_lengths
    if settings.per_token:
        if old_log_probs is None or ref_log_probs is None or response_mask is None:
            raise ValueError(
                "token_level_kl_coef (KL-in-reward) needs old_log_probs, ref_log_probs and "
                "response_mask"
            )
        # With KL-in-reward, whitening and clipping apply to the per-token advantages. The
        # sequence advantages enter in float32, the precision the loss receives them in.
        advantages, kl = add_token_level_kl(
            advantages.float(),
            old_log_probs,
            ref_log_probs,
            response_mask,
            coef=settings.token_level_kl_coef,
            estimator=settings.token_level_kl_estimator,
            k3_clamp=settings.kl_clamp,
        )
        token_weights = response_mask.bool()
        metrics["token_level_kl"] = (kl * token_weights).sum() / token_weights.sum().clamp(min=1)
    elif settings.whiten and response_lengths is None:
        raise ValueError("whiten_advantages needs response_lengths to weight sequences by tokens")
    advantages, clip_metrics = finish_advantages(
        advantages,
        token_weights,
        whiten_advantages=settings.whiten,
        advantage_clip=settings.advantage_clip,
    )
    metrics.update(clip_metrics)
    return advantages.float(), metrics


def _per_turn_advantages(
    settings: AdvantageSettings,
    group_ids: torch.Tensor,
    turn_rewards: Optional[torch.Tensor],
    turn_mask: Optional[torch.Tensor],
    token_turns: Optional[torch.Tensor],
    response_mask: Optional[torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if turn_rewards is None or turn_mask is None or token_turns is None or response_mask is None:
        raise ValueError(
            "per-turn advantages need turn_rewards, turn_mask, token_turns and response_mask"
        )
    by_turn = turn_advantages(
        turn_rewards,
        turn_mask,
        group_ids,
        estimator=settings.estimator,
        unbiased=settings.std_unbiased,
        eps=settings.std_eps,
        reinforce_baseline=settings.reinforce_baseline,
    )
    mask = response_mask.bool() & (token_turns >= 0)
    tokens = by_turn.gather(1, token_turns.long().clamp(min=0))
    tokens = torch.where(mask, tokens, torch.zeros((), dtype=torch.float64))
    advantages, metrics = finish_advantages(
        tokens,
        response_mask.bool(),
        whiten_advantages=settings.whiten,
        advantage_clip=settings.advantage_clip,
    )
    return advantages.float(), metrics


def finish_advantages(
    advantages: torch.Tensor,
    token_weights: Optional[torch.Tensor],
    *,
    whiten_advantages: bool,
    advantage_clip: Optional[float],
) -> tuple[torch.Tensor, dict]:
    """Steps 5 and 6: optional whitening and clipping.

    ``token_weights`` are the response lengths ``[B]`` (sequence advantages) or the mask ``[B, T]``
    (token advantages); they weight whitening and the token-weighted ``advantage_clip_frac``.
    Without them the clip fraction counts sequences.
    """
    metrics = {}
    if whiten_advantages:
        if token_weights is None:
            raise ValueError("whitening needs token weights (response lengths or the mask)")
        advantages = whiten(advantages, token_weights)
    if advantage_clip is not None:
        clipped = advantages.abs() > advantage_clip
        if token_weights is not None and token_weights.dim() == advantages.dim():
            weights = token_weights.double()
            metrics["advantage_clip_frac"] = (clipped * weights).sum() / weights.sum().clamp(min=1)
        else:
            metrics["advantage_clip_frac"] = clipped.double().mean()
        advantages = advantages.clamp(-advantage_clip, advantage_clip)
    return advantages, metrics
