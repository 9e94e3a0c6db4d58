"""Policy losses: GSPO, GSPO-token and GRPO/PPO, with aggregation over global denominators.

Shapes: ``B`` sequences, ``T`` (padded) response tokens. ``log_probs``, ``old_log_probs``,
``response_mask``, optional ``ref_log_probs`` and ``entropy`` are ``[B, T]``; advantages are
``[B]`` (one per sequence) or ``[B, T]`` (per token). ``m`` is the mask, ``n_i = sum_t m_it`` the
response length of sequence i.

Importance ratios, selected by ``PolicyLossSettings.importance_sampling`` (the one switch between
the algorithms):

* ``seq`` (GSPO, arXiv 2507.18071 eq. 5-7):
  ``s_i = exp(clamp((1/n_i) sum_t m_it (lp_it - lp_old_it)))``, one ratio per sequence; its gradient
  flows through the whole sequence mean.
* ``seq_token`` (GSPO-token, eq. 13-14): ``s_it = exp(lp_it - sg(lp_it) + sg(log s_i))``; value
  ``s_i``, gradient ``s_i * grad lp_it``. With one advantage per sequence and seq-mean-token-mean it
  equals GSPO in value and gradient; with per-token advantages it weighs each token by its own
  advantage, which GSPO cannot.
* ``token`` (GRPO/PPO): ``r_it = exp(clamp(lp_it - lp_old_it))``.

Surrogates, selected by ``PolicyLossSettings.surrogate``:

* ``clip`` (PPO / GRPO / GSPO): per token ``pg = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``
  with the ratio above; with dual clip (Ye et al. 2020) ``pg = min(pg, -c A)`` where ``A < 0``.
* ``cispo`` (CISPO, MiniMax-M1, arXiv 2506.13585 eq. 4): ``pg = -sg(clip(r_it, w_low, w_high))
  A lp_it`` with the token ratio ``r_it``: the clipped ratio is a detached weight on the
  log-likelihood gradient, so no token's gradient is ever dropped (only its weight bounded). The
  value includes ``lp`` as in the paper; only its gradient ``-w A grad lp`` is meaningful.
* ``gmpo`` (GMPO, arXiv 2507.20673 eq. 4): per sequence ``pg_i = -A_i exp((1/n_i) sum_t m_it
  c_it)`` with the token log ratio ``d_it = lp - lp_old`` clipped in log space on the side that
  binds for the sign of ``A_i``: ``c_it = min(d_it, eps)`` for ``A_i >= 0``, ``max(d_it, -eps)``
  for ``A_i < 0`` (the geometric mean of the token terms of PPO's min). One term per sequence,
  so it needs sequence advantages and seq-mean-token-mean.

With ``rollout_correction`` set, ``pg`` is multiplied by the detached importance weights of
:mod:`megatron_gspo.algo.corrections` between the old policy and the rollout engine's behaviour
log-probs. The token loss is ``L = pg + kl_coef * KL(lp, ref) - entropy_coef * H`` and is
aggregated by ``loss_agg_mode``:

* ``token-mean``: ``sum_it m L / N_tok``
* ``seq-mean-token-sum``: ``sum_it m L / N_seq``
* ``seq-mean-token-mean``: ``sum_i (sum_t m L / n_i) / N_seq``
* ``seq-mean-token-sum-norm`` (ROLL's and verl's meaning): ``sum_it m L / T_norm`` with
  ``T_norm`` a constant (the configured response length), not the padded width, which changes
  with packing; no division by the number of sequences (ROLL ``agg_loss``, verl ``agg_loss``).
* ``dr-grpo`` (TRL's ``loss_type="dr_grpo"``, Liu et al. 2025): ``sum_it m L / (N_seq * T_norm)``,
  the same direction as seq-mean-token-sum-norm, ``N_seq`` times smaller.

``N_seq`` (sequences with at least one response token), ``N_tok`` (response tokens) and ``n_i`` are
*global* for the optimizer step: callers pass them all-reduced over data (and context) parallel
ranks, so summing this loss over micro-batches and ranks gives the exact loss of the whole batch
and the gradient does not depend on how the batch was cut (pitfall 5).

Context parallel: each rank holds some tokens of every sequence. With ``sequence_group`` set, the
per-sequence sums ``sum_t m (lp - lp_old)`` are formed locally and combined by one differentiable
all-reduce per micro-batch, so every rank sees the exact ``s_i`` and gradients reach every rank's
tokens; ``n_i`` must then be the full lengths.

Metrics are 0-d tensors pre-normalised for SUM reduction across micro-batches and ranks (token
metrics divided by ``N_tok``, sequence metrics by ``N_seq`` with each sequence's tokens weighted
``1/n_i``), except names ending in ``_max`` and ``_min``, which reduce with MAX and MIN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from megatron_gspo.algo.corrections import (
    RolloutCorrection,
    correction_metrics,
    correction_weights,
    sequence_log_ratio,
)
from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.config.loss_rules import LOSS_AGG_MODES, check_policy_loss

Number = Union[float, int, torch.Tensor]


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: a masked -inf log-prob times 0 would be NaN.
    return torch.where(mask, values, torch.zeros_like(values))


def sequence_ratio(log_probs, old_log_probs, mask, lengths, clamp, sequence_group):
    """GSPO: ``s_i`` expanded to ``[B, T]``; returns ``(ratio, log s_i [B])``."""
    log_ratio = sequence_log_ratio(log_probs, old_log_probs, mask, lengths, sequence_group)
    clamped = log_ratio.clamp(-clamp, clamp)
    return torch.exp(clamped).unsqueeze(-1).expand_as(log_probs), log_ratio


def sequence_token_ratio(log_probs, old_log_probs, mask, lengths, clamp, sequence_group):
    """GSPO-token: ``exp(lp - sg(lp) + sg(log s_i))``; returns ``(ratio, log s_i [B])``."""
    with torch.no_grad():
        log_ratio = sequence_log_ratio(log_probs, old_log_probs, mask, lengths, sequence_group)
    # Clamp the whole token log ratio (not only its stop-gradient part), so that beyond the clamp
    # the gradient stops exactly where GSPO's does and the two stay equal.
    token_log_ratio = _masked(log_probs - log_probs.detach(), mask) + log_ratio.unsqueeze(-1)
    return torch.exp(token_log_ratio.clamp(-clamp, clamp)), log_ratio


def token_ratio(log_probs, old_log_probs, mask, lengths, clamp, sequence_group):
    """GRPO/PPO: ``exp(lp - lp_old)`` per token; returns ``(ratio, sequence mean log ratio [B])``."""
    with torch.no_grad():
        log_ratio = sequence_log_ratio(log_probs, old_log_probs, mask, lengths, sequence_group)
    token_log_ratio = _masked(log_probs - old_log_probs, mask).clamp(-clamp, clamp)
    return torch.exp(token_log_ratio), log_ratio


# Keyed by config.loss_rules.IMPORTANCE_SAMPLING, the names the settings accept.
RATIO_FUNCTIONS: dict[str, Callable] = {
    "seq": sequence_ratio,
    "seq_token": sequence_token_ratio,
    "token": token_ratio,
}


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    lengths: torch.Tensor,
    num_sequences: Number,
    num_tokens: Number,
    norm_length: Number,
) -> torch.Tensor:
    """Aggregate per-token ``values [B, T]`` by ``mode`` (see the module docstring)."""
    masked = _masked(values, mask)
    if mode == "token-mean":
        return masked.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return masked.sum() / num_sequences
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / lengths.clamp(min=1)).sum() / num_sequences
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / norm_length
    if mode == "dr-grpo":
        return masked.sum() / (num_sequences * norm_length)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {', '.join(LOSS_AGG_MODES)}")


@dataclass(frozen=True)
class PolicyLossSettings:
    """What :func:`policy_loss` computes, fixed for a run (built once, e.g. from the
    configuration by :func:`megatron_gspo.algo.settings.policy_loss_settings`). Tensors and
    process groups stay arguments. Which fields go together is checked when it is built, by the
    rules the configuration checks too (:mod:`megatron_gspo.config.loss_rules`).

    Fields without a default choose the algorithm; the others default to "off" (no dual clip, no
    KL term, no entropy bonus, the clipped surrogate, no rollout correction) or to the value the
    formulas below name. A new loss option is a new field with an "off" default, so that existing
    settings keep their numbers.
    """

    importance_sampling: str
    """Ratio function: ``seq`` (GSPO ``s_i``, arXiv 2507.18071 eq. 5-7), ``seq_token``
    (GSPO-token, eq. 13-14) or ``token`` (GRPO/PPO ``r_it``); see the module docstring."""
    clip_low: float
    """``eps_low``: the ratio is clipped from below at ``1 - clip_low``."""
    clip_high: float
    """``eps_high``: the ratio is clipped from above at ``1 + clip_high``."""
    loss_agg_mode: str
    """How per-token losses become one number (module docstring): ``token-mean``,
    ``seq-mean-token-sum``, ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` or ``dr-grpo``."""
    dual_clip_constant: Optional[float] = None
    """``c`` of dual clip (Ye et al. 2020): where ``A < 0``, ``pg = min(pg, -c A)``; None: off."""
    kl_coef: float = 0.0
    """Weight of ``KL(policy || reference)`` per token (needs ``ref_log_probs``)."""
    kl_estimator: str = "k3"
    """Schulman's k1, k2 or k3 (:func:`megatron_gspo.algo.kl.kl_estimate`)."""
    kl_clamp: Optional[float] = None
    """Cap of the k3 estimate per token, ``clamp(k3, -c, c)`` (verl's and slime's ``low_var_kl``,
    ROLL's ``k3``: c = 10); beyond it the token's KL gradient is 0. None: no cap."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``-entropy_coef * H`` per token (needs ``entropy``)."""
    norm_length: Optional[float] = None
    """``T_norm`` of seq-mean-token-sum-norm and dr-grpo: a constant (the configured response
    length), not the padded width, which changes with packing. None: the padded width ``T`` of
    the call."""
    log_ratio_clamp: float = 10.0
    """Log ratios are clamped to ``+-log_ratio_clamp`` before ``exp`` (verl clamps at 10)."""
    surrogate: str = "clip"
    """``clip`` (PPO-clipped, with ``importance_sampling``'s ratio), ``cispo`` or ``gmpo`` (module
    docstring); the last two use the token ratio (``importance_sampling="token"``)."""
    cispo_weight_bounds: Optional[tuple[float, float]] = None
    """``(w_low, w_high)``: CISPO's detached weight is ``clip(r_it, w_low, w_high)``."""
    gmpo_log_clip: Optional[float] = None
    """``eps`` of GMPO: token log ratios are clipped at ``+-eps`` (on the binding side)."""
    rollout_correction: Optional[RolloutCorrection] = None
    """Importance weights between the old policy and the rollout engine's behaviour policy
    (:mod:`megatron_gspo.algo.corrections`); needs ``behaviour_log_probs``. None: off."""

    def __post_init__(self) -> None:
        fields = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "rollout_correction"
        }
        correction = self.rollout_correction
        check_policy_loss(
            **fields, correction_level=None if correction is None else correction.level
        )


class _Surrogate(NamedTuple):
    """One surrogate's per-token loss ``[B, T]`` and what the clip metrics count."""

    pg: torch.Tensor
    ratio: torch.Tensor
    """The ratio that multiplies the advantage (``ratio_mean``)."""
    seq_log_ratio: torch.Tensor
    """``[B]`` ``(1/n_i) sum_t m (lp - lp_old)``, unclipped."""
    low: torch.Tensor
    """Tokens below the clip range."""
    high: torch.Tensor
    """Tokens above the clip range."""
    binding_low: torch.Tensor
    binding_high: torch.Tensor
    dual_bound: Optional[torch.Tensor] = None
    unbounded: Optional[torch.Tensor] = None


def _clip_surrogate(log_probs, old_log_probs, advantages, mask, lengths, settings, sequence_group):
    ratio, seq_log_ratio = RATIO_FUNCTIONS[settings.importance_sampling](
        log_probs, old_log_probs, mask, lengths, settings.log_ratio_clamp, sequence_group
    )
    clip_low, clip_high = settings.clip_low, settings.clip_high
    unclipped = -advantages * ratio
    clipped_ratio = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = -advantages * clipped_ratio
    pg = torch.maximum(unclipped, clipped)
    dual_bound = unbounded = None
    if settings.dual_clip_constant is not None:
        dual_bound = -settings.dual_clip_constant * advantages
        unbounded = pg
        pg = torch.where(advantages < 0, torch.minimum(pg, dual_bound), pg)
    with torch.no_grad():
        ratio_value = ratio.detach()
        low = ratio_value < 1.0 - clip_low
        high = ratio_value > 1.0 + clip_high
    return _Surrogate(
        pg=pg,
        ratio=ratio,
        seq_log_ratio=seq_log_ratio,
        low=low,
        high=high,
        binding_low=low & (advantages < 0),
        binding_high=high & (advantages > 0),
        dual_bound=dual_bound,
        unbounded=unbounded,
    )


def _cispo_surrogate(log_probs, old_log_probs, advantages, mask, lengths, settings, sequence_group):
    ratio, seq_log_ratio = token_ratio(
        log_probs, old_log_probs, mask, lengths, settings.log_ratio_clamp, sequence_group
    )
    weight_low, weight_high = settings.cispo_weight_bounds
    ratio = ratio.detach()
    weight = ratio.clamp(weight_low, weight_high)
    pg = -weight * advantages * _masked(log_probs, mask)
    low, high = ratio < weight_low, ratio > weight_high
    # The weight is bounded whatever the sign of A, and no gradient is dropped: every bounded
    # weight "binds".
    return _Surrogate(pg, weight, seq_log_ratio, low, high, low, high)


def _gmpo_surrogate(log_probs, old_log_probs, advantages, mask, lengths, settings, sequence_group):
    epsilon = settings.gmpo_log_clip
    token_log_ratio = _masked(log_probs - old_log_probs, mask).clamp(
        -settings.log_ratio_clamp, settings.log_ratio_clamp
    )
    positive = advantages >= 0
    clipped = torch.where(
        positive, token_log_ratio.clamp(max=epsilon), token_log_ratio.clamp(min=-epsilon)
    )
    local_sums = _masked(clipped, mask).sum(dim=-1)
    if sequence_group is not None and dist.get_world_size(sequence_group) > 1:
        from torch.distributed.nn.functional import all_reduce

        local_sums = all_reduce(local_sums, op=dist.ReduceOp.SUM, group=sequence_group)
    log_ratio = (local_sums / lengths.clamp(min=1)).clamp(
        -settings.log_ratio_clamp, settings.log_ratio_clamp
    )
    ratio = torch.exp(log_ratio).unsqueeze(-1).expand_as(log_probs)
    pg = -advantages * ratio
    with torch.no_grad():
        seq_log_ratio = sequence_log_ratio(log_probs, old_log_probs, mask, lengths, sequence_group)
        values = token_log_ratio.detach()
        low, high = values < -epsilon, values > epsilon
    return _Surrogate(
        pg, ratio, seq_log_ratio, low, high, low & (advantages < 0), high & (advantages > 0)
    )


SURROGATE_FUNCTIONS: dict[str, Callable] = {
    "clip": _clip_surrogate,
    "cispo": _cispo_surrogate,
    "gmpo": _gmpo_surrogate,
}


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    settings: PolicyLossSettings,
    *,
    ref_log_probs: Optional[torch.Tensor] = None,
    entropy: Optional[torch.Tensor] = None,
    behaviour_log_probs: Optional[torch.Tensor] = None,
    num_sequences: Optional[Number] = None,
    num_tokens: Optional[Number] = None,
    sequence_lengths: Optional[torch.Tensor] = None,
    sequence_group: Optional[dist.ProcessGroup] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss (clipped GSPO / GSPO-token / GRPO, CISPO or GMPO) and its metrics.

    Args:
        log_probs: ``[B, T]`` current log-probs of the sampled tokens (requires grad).
        old_log_probs: ``[B, T]`` log-probs under the sampling (old) policy.
        advantages: ``[B]`` or ``[B, T]`` (GMPO: ``[B]``).
        response_mask: ``[B, T]`` bool; only these tokens enter the loss, its gradient and metrics.
        settings: the loss's configuration (:class:`PolicyLossSettings`).
        ref_log_probs: ``[B, T]`` reference log-probs: adds ``settings.kl_coef * KL`` per token.
        entropy: ``[B, T]`` entropy of the policy: adds ``-settings.entropy_coef * H`` per token.
        behaviour_log_probs: ``[B, T]`` the rollout engine's log-probs ``mu`` (needed by
            ``settings.rollout_correction``; never read at masked positions).
        num_sequences, num_tokens: global denominators ``N_seq``, ``N_tok`` (default: this batch's).
        sequence_lengths: global ``n_i`` ``[B]`` (default: ``response_mask.sum(-1)``).
        sequence_group: context-parallel group over which sequences are split (or None).

    Returns:
        ``(loss, metrics)``: the 0-d loss and 0-d metric tensors (see module docstring).
    """
    mask = response_mask.bool()
    maskf = mask.to(log_probs.dtype)
    lengths = maskf.sum(-1) if sequence_lengths is None else sequence_lengths.to(log_probs.dtype)
    if num_sequences is None:
        num_sequences = (lengths > 0).sum().clamp(min=1).to(log_probs.dtype)
    if num_tokens is None:
        num_tokens = maskf.sum().clamp(min=1)
    norm_length = log_probs.shape[-1] if settings.norm_length is None else settings.norm_length

    if settings.surrogate == "gmpo" and advantages.dim() != 1:
        raise ValueError("GMPO needs one advantage per sequence ([B]), got per-token advantages")
    advantages = advantages.to(log_probs.dtype).detach()
    token_advantages = (
        advantages.unsqueeze(-1).expand_as(log_probs) if advantages.dim() == 1 else advantages
    )
    # Zero the advantages of masked positions: a non-finite value there would otherwise reach the
    # sequence ratio's gradient as 0 * nan.
    token_advantages = _masked(token_advantages, mask)
    surrogate = SURROGATE_FUNCTIONS[settings.surrogate](
        log_probs,
        old_log_probs.detach(),
        token_advantages,
        mask,
        lengths,
        settings,
        sequence_group,
    )
    pg = surrogate.pg
    correction = None
    if settings.rollout_correction is not None:
        if behaviour_log_probs is None:
            raise ValueError(
                "rollout_correction needs behaviour_log_probs (the engine's log-probs)"
            )
        correction = correction_weights(
            old_log_probs,
            behaviour_log_probs,
            mask,
            settings.rollout_correction,
            lengths=lengths,
            sequence_group=sequence_group,
        )
        pg = pg * correction.weights.to(pg.dtype)

    def agg(values: torch.Tensor) -> torch.Tensor:
        return aggregate(
            values,
            mask,
            settings.loss_agg_mode,
            lengths=lengths,
            num_sequences=num_sequences,
            num_tokens=num_tokens,
            norm_length=norm_length,
        )

    pg_loss = agg(pg)
    loss = pg_loss
    metrics: dict[str, torch.Tensor] = {"pg_loss": pg_loss.detach()}

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return _masked(values.detach().to(log_probs.dtype), mask).sum() / num_tokens

    def sequence_mean(values: torch.Tensor) -> torch.Tensor:
        per_token = _masked(values.detach().to(log_probs.dtype), mask)
        return (per_token.sum(-1) / lengths.clamp(min=1)).sum() / num_sequences

    if ref_log_probs is not None:
        kl = kl_estimate(
            log_probs, ref_log_probs.detach(), settings.kl_estimator, k3_clamp=settings.kl_clamp
        )
        kl_loss = agg(kl)
        loss = loss + settings.kl_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
        metrics["kl"] = token_mean(kl)
    if entropy is not None:
        entropy_loss = agg(entropy)
        loss = loss - settings.entropy_coef * entropy_loss
        metrics["entropy_loss"] = entropy_loss.detach()
        metrics["entropy"] = token_mean(entropy)

    with torch.no_grad():
        binding_low, binding_high = surrogate.binding_low, surrogate.binding_high
        for name, flags in (
            ("clip_frac", binding_low | binding_high),
            ("clip_frac_low", binding_low),
            ("clip_frac_high", binding_high),
            ("ratio_out_of_range", surrogate.low | surrogate.high),
        ):
            metrics[f"{name}_token"] = token_mean(flags)
            metrics[f"{name}_seq"] = sequence_mean(flags)
        if surrogate.dual_bound is not None:
            dual = (token_advantages < 0) & (surrogate.unbounded > surrogate.dual_bound)
            metrics["dual_clip_frac_token"] = token_mean(dual)
        seq_log_ratio = surrogate.seq_log_ratio.detach()
        seq_values = seq_log_ratio.unsqueeze(-1).expand_as(log_probs)
        metrics["seq_log_ratio_mean"] = sequence_mean(seq_values)
        metrics["seq_log_ratio_abs_mean"] = sequence_mean(seq_values.abs())
        valid_sequences = lengths > 0
        metrics["seq_log_ratio_abs_max"] = (
            seq_log_ratio.abs()[valid_sequences].max()
            if bool(valid_sequences.any())
            else torch.zeros((), dtype=log_probs.dtype)
        )
        metrics["ratio_mean"] = token_mean(surrogate.ratio)
        if correction is not None:
            metrics.update(
                correction_metrics(
                    correction,
                    mask,
                    lengths=lengths,
                    num_tokens=num_tokens,
                    num_sequences=num_sequences,
                )
            )
    return loss, metrics
