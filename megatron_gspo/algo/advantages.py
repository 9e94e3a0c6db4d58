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

Groups of size one have no baseline to compare against: grpo, dr_grpo, rloo and reinforce with a
group baseline give them advantage 0. Groups whose rewards are all equal get advantage exactly 0
(the std is 0 and so is every numerator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.algo.kl import kl_estimate

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
            f"unknown advantage estimator {estimator!r}; known: grpo, dr_grpo, reinforce, rloo"
        )
    return torch.where(singleton, torch.zeros_like(advantages), advantages)


def add_token_level_kl(
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL-in-reward (ROLL ``add_token_level_kl``): per-token advantages ``[B, T]``.

    Token rewards are ``-coef * KL_t(old || ref)`` with the sequence reward at the last response
    token; with gamma = 1 the REINFORCE return is the reverse cumulative sum, so
    ``A_{i,t} = A_i - coef * sum_{t' >= t} KL_{i,t'}``. Returns ``(advantages [B, T], kl [B, T])``.
    """
    mask = response_mask.to(torch.float64)
    kl = kl_estimate(old_log_probs.double(), ref_log_probs.double(), estimator)
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


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    estimator: str,
    response_lengths: Optional[torch.Tensor] = None,
    reward_norm: Optional[str] = None,
    reward_shift: bool = False,
    reward_scale: bool = False,
    reward_clip: Optional[float] = None,
    running: Optional[RunningMoments] = None,
    std_unbiased: bool = True,
    std_eps: float = 1e-6,
    reinforce_baseline: str = "none",
    whiten_advantages: bool = False,
    advantage_clip: Optional[float] = None,
    return_metrics: bool = False,
):
    """Sequence advantages ``[B]`` (float32) from rewards ``[B]`` and prompt ids ``group_ids [B]``.

    Runs steps 1-3, 5 and 6 of the module docstring (token-level KL, step 4, needs log-probs; the
    loop applies it with :func:`add_token_level_kl` then :func:`finish_advantages`).
    ``response_lengths [B]`` weights whitening by tokens (required when ``whiten_advantages``).
    With ``return_metrics`` returns ``(advantages, metrics)`` where metrics hold
    ``reward_clip_frac`` and ``advantage_clip_frac``.
    """
    processed = normalize_rewards(
        rewards,
        group_ids,
        scope=reward_norm,
        shift_only=reward_shift,
        scale_only=reward_scale,
        unbiased=std_unbiased,
        eps=std_eps,
        running=running,
    )
    metrics = {}
    if reward_clip is not None:
        metrics["reward_clip_frac"] = (processed.abs() > reward_clip).double().mean()
        processed = processed.clamp(-reward_clip, reward_clip)
    advantages = estimate_advantages(
        processed,
        group_ids,
        estimator=estimator,
        unbiased=std_unbiased,
        eps=std_eps,
        reinforce_baseline=reinforce_baseline,
    )
    if whiten_advantages and response_lengths is None:
        raise ValueError("whiten_advantages needs response_lengths to weight sequences by tokens")
    advantages, clip_metrics = finish_advantages(
        advantages,
        response_lengths,
        whiten_advantages=whiten_advantages,
        advantage_clip=advantage_clip,
    )
    metrics.update(clip_metrics)
    advantages = advantages.float()
    return (advantages, metrics) if return_metrics else advantages


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
