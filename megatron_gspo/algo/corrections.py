"""Training-inference mismatch corrections: importance weights between the trainer and the engine.

The rollout engine samples from a behaviour policy ``mu`` (its per-token log-probs, reported with
every sample) that differs from the trainer's old policy ``pi_old`` even with the same weights:
another precision (a bf16 engine against an fp32 trainer), other kernels, other MoE routes. The
corrections re-weight (or drop) each token's policy-gradient term by how far the two disagree.

Shapes: ``B`` sequences, ``T`` (padded) response tokens; ``old_log_probs`` (``log pi_old``),
``behaviour_log_probs`` (``log mu``) and the loss mask ``m`` are ``[B, T]``; ``n_i`` is the
global loss-token count of sequence ``i`` (all context-parallel ranks), ``N_tok`` / ``N_seq`` the
global denominators of the optimizer step. Values of ``mu`` at masked positions are never read
(they may be NaN: observation tokens of a multi-turn sample have no behaviour log-prob).

Ratios (log ratios are clamped to ``+-SAFETY_LOG_RATIO`` before ``exp``, as verl's and slime's
``SAFETY_BOUND``):

* token: ``rho_it = exp(log pi_old_it - log mu_it)``;
* sequence: the geometric mean ``s_i = exp((1/n_i) sum_t m_it (log pi_old_it - log mu_it))`` --
  ``exp`` of the MEAN, never of the sum: the product of token ratios (``exp(sum)``) collapses or
  explodes on long sequences (NeMo-RL PR 2269: weight 0.06 at step 1; TRL PR 5815: mean weight
  0.569 -> 0.993 after switching to the mean). Under context parallel the per-sequence sum is
  all-reduced over ``sequence_group`` first, so every rank sees the exact ``s_i``.

Modes, applied to the ratio ``x`` (``rho_it`` or ``s_i``):

* ``truncate`` (TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training"; slime ``--use-tis``, verl ``rollout_is``): ``w = min(x, C)``.
* ``mask`` (MIS: masked importance sampling; the two-sided mask of IcePop, Ling team 2025,
  "Small Leak Can Sink a Great Ship"; slime ``mis.py`` mode ``mask``, verl IcePop / Geo-RS,
  NeMo-RL ``icepop`` / ``seq-mask-tis``): ``w = x * 1[low <= x <= high]``; at sequence level the
  whole sequence is kept or dropped.

The weight is detached and multiplies each token's policy-gradient term (the KL and entropy terms
regularise the current policy and are left alone). A weight of 0 removes a token's signal but
NOT its place in the denominators: ``N_tok``, ``N_seq`` and ``n_i`` stay those of the loss mask,
so dropping tokens never re-weights the others and the loss stays independent of how the batch
is cut into micro-batches and ranks.

Metrics follow :mod:`megatron_gspo.algo.losses`: 0-d tensors pre-normalised for a SUM over
micro-batches and ranks (token-weighted ones divided by ``N_tok``, sequence-weighted ones by
``N_seq`` with each token weighted ``1/n_i``), except names ending in ``_max`` (MAX) and
``_min`` (MIN). :func:`finish_correction_metrics` turns the reduced sums into the effective
sample size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.config.loss_rules import check_correction

Number = Union[float, int, torch.Tensor]

SAFETY_LOG_RATIO = 20.0
"""|log ratio| bound before ``exp`` (verl ``rollout_corr_helper.SAFETY_BOUND``, slime
``mis.py``): ``e^20`` is about 5e8, far beyond any threshold."""

METRIC_PREFIX = "rollout_correction/"


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: mu may be NaN or -inf at masked positions.
    return torch.where(mask, values, torch.zeros_like(values))


@dataclass(frozen=True)
class RolloutCorrection:
    """Which correction :func:`correction_weights` applies (built once from the config, by
    :func:`megatron_gspo.algo.settings.rollout_correction`; checked by the rules the
    configuration checks too, :func:`megatron_gspo.config.loss_rules.check_correction`)."""

    level: str
    """``token`` (one weight per token) or ``sequence`` (the geometric mean, one per sequence)."""
    mode: str
    """``truncate`` (``min(x, high)``) or ``mask`` (``x`` inside ``[low, high]``, else 0)."""
    high: float
    """``C`` of truncate, the upper bound of mask."""
    low: Optional[float] = None
    """The lower bound of mask; must be None for truncate (TIS caps from above only)."""

    def __post_init__(self) -> None:
        check_correction(level=self.level, mode=self.mode, low=self.low, high=self.high)


@dataclass
class CorrectionWeights:
    """What :func:`correction_weights` computed, every tensor ``[B, T]`` and detached."""

    weights: torch.Tensor
    """The applied weight of each token (0 at positions outside the loss mask)."""
    ratios: torch.Tensor
    """The ratio before truncation or masking: ``rho_it``, or ``s_i`` repeated over the row."""
    truncated: torch.Tensor
    """bool: loss tokens whose weight was capped."""
    masked: torch.Tensor
    """bool: loss tokens dropped by the mask."""
    sequence_ratios: Optional[torch.Tensor]
    """``[B]`` ``s_i`` at sequence level, else None."""


def sequence_log_ratio(
    log_probs: torch.Tensor,
    other_log_probs: torch.Tensor,
    mask: torch.Tensor,
    lengths: torch.Tensor,
    sequence_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """``[B]`` ``(1/n_i) sum_t m_it (log_probs - other_log_probs)``, the token sums added over
    ``sequence_group`` (context parallel); differentiable. The policy's sequence ratio (GSPO,
    ``lp - lp_old``) and the sequence-level correction (``log pi_old - log mu``) both use it."""
    sums = _masked(log_probs - other_log_probs, mask).sum(dim=-1)
    if sequence_group is not None and dist.get_world_size(sequence_group) > 1:
        from torch.distributed.nn.functional import all_reduce

        sums = all_reduce(sums, op=dist.ReduceOp.SUM, group=sequence_group)
    return sums / lengths.to(sums.dtype).clamp(min=1)


@torch.no_grad()
def correction_weights(
    old_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    mask: torch.Tensor,
    correction: RolloutCorrection,
    *,
    lengths: Optional[torch.Tensor] = None,
    sequence_group: Optional[dist.ProcessGroup] = None,
) -> CorrectionWeights:
    """The detached importance weights of ``correction`` (see the module docstring).

    Args:
        old_log_probs: ``[B, T]`` ``log pi_old`` of the sampled tokens.
        behaviour_log_probs: ``[B, T]`` ``log mu`` reported by the rollout engine.
        mask: ``[B, T]`` bool loss mask (only these positions are read).
        correction: level, mode and bounds.
        lengths: global ``n_i`` ``[B]`` (default: ``mask.sum(-1)``); sequence level only.
        sequence_group: context-parallel group the sequences are split over (or None).
    """
    mask = mask.bool()
    old = old_log_probs.detach()
    behaviour = behaviour_log_probs.detach().to(old.dtype)
    sequence_ratios = None
    if correction.level == "token":
        log_ratio = _masked(old - behaviour, mask).clamp(-SAFETY_LOG_RATIO, SAFETY_LOG_RATIO)
        ratios = torch.exp(log_ratio)
    else:
        if lengths is None:
            lengths = mask.sum(-1)
        mean_log_ratio = sequence_log_ratio(old, behaviour, mask, lengths, sequence_group)
        sequence_ratios = torch.exp(mean_log_ratio.clamp(-SAFETY_LOG_RATIO, SAFETY_LOG_RATIO))
        ratios = sequence_ratios.unsqueeze(-1).expand_as(old)
    if correction.mode == "truncate":
        truncated = mask & (ratios > correction.high)
        masked = torch.zeros_like(mask)
        weights = ratios.clamp(max=correction.high)
    else:
        keep = (ratios >= correction.low) & (ratios <= correction.high)
        truncated = torch.zeros_like(mask)
        masked = mask & ~keep
        weights = torch.where(keep, ratios, torch.zeros_like(ratios))
    return CorrectionWeights(
        weights=_masked(weights, mask),
        ratios=_masked(ratios, mask),
        truncated=truncated,
        masked=masked,
        sequence_ratios=sequence_ratios,
    )


@torch.no_grad()
def correction_metrics(
    correction: CorrectionWeights,
    mask: torch.Tensor,
    *,
    lengths: torch.Tensor,
    num_tokens: Number,
    num_sequences: Number,
) -> dict[str, torch.Tensor]:
    """Per-call metrics, pre-normalised for a SUM over micro-batches and ranks (``_max``: MAX,
    ``_min``: MIN). ``lengths`` are the global ``n_i``; ``num_tokens`` / ``num_sequences`` the
    global ``N_tok`` / ``N_seq``.

    ``weight_mean`` / ``weight_sq_mean`` are token-weighted moments of the applied weights,
    ``weight_seq_mean`` / ``weight_sq_seq_mean`` sequence-weighted ones; ``ratio_max`` /
    ``ratio_min`` the extremes of the ratio before truncation or masking (over loss tokens, or
    over sequences at sequence level); ``truncated_frac_*`` and ``masked_frac_*`` the share of
    loss tokens affected, token- and sequence-weighted.
    """
    mask = mask.bool()
    dtype = correction.weights.dtype
    sequence_weight = (1.0 / lengths.to(dtype).clamp(min=1)).unsqueeze(-1)

    def token_mean(values: torch.Tensor) -> torch.Tensor:
        return _masked(values.to(dtype), mask).sum() / num_tokens

    def sequence_mean(values: torch.Tensor) -> torch.Tensor:
        return (_masked(values.to(dtype), mask) * sequence_weight).sum() / num_sequences

    weights = correction.weights
    if correction.sequence_ratios is not None:
        # One ratio per sequence, complete on every context-parallel rank: the extremes over the
        # sequences that have loss tokens anywhere.
        valid = lengths > 0
        extremes = correction.sequence_ratios[valid]
    else:
        extremes = correction.ratios[mask]
    if extremes.numel():
        ratio_max, ratio_min = extremes.max(), extremes.min()
    else:  # neutral for the MAX / MIN reductions; removed if nothing anywhere had a token
        ratio_max = torch.full((), -torch.inf, dtype=dtype)
        ratio_min = torch.full((), torch.inf, dtype=dtype)
    prefix = METRIC_PREFIX
    return {
        f"{prefix}weight_mean": token_mean(weights),
        f"{prefix}weight_sq_mean": token_mean(weights.square()),
        f"{prefix}weight_seq_mean": sequence_mean(weights),
        f"{prefix}weight_sq_seq_mean": sequence_mean(weights.square()),
        f"{prefix}ratio_max": ratio_max,
        f"{prefix}ratio_min": ratio_min,
        f"{prefix}truncated_frac_token": token_mean(correction.truncated),
        f"{prefix}truncated_frac_seq": sequence_mean(correction.truncated),
        f"{prefix}masked_frac_token": token_mean(correction.masked),
        f"{prefix}masked_frac_seq": sequence_mean(correction.masked),
    }


def finish_correction_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """After the SUM / MAX / MIN reduction: add the relative effective sample sizes
    ``ess_token = E[w]^2 / E[w^2]`` (token-weighted) and ``ess_seq`` (sequence-weighted), in
    ``(0, 1]``, 1 when every weight is equal (verl ``rollout_is_eff_sample_size``), in place of the
    second moments they come from; drop ratio extremes that saw no token. Returns a new dict; metrics without corrections pass unchanged.
    """
    prefix = METRIC_PREFIX
    if f"{prefix}weight_mean" not in metrics:
        return metrics
    finished = dict(metrics)
    for suffix, mean_name, square_name in (
        ("token", "weight_mean", "weight_sq_mean"),
        ("seq", "weight_seq_mean", "weight_sq_seq_mean"),
    ):
        mean, square = float(metrics[prefix + mean_name]), float(metrics[prefix + square_name])
        finished[f"{prefix}ess_{suffix}"] = mean * mean / square if square > 0 else 0.0
    for name in ("weight_sq_mean", "weight_sq_seq_mean"):
        del finished[prefix + name]  # the ESS's inputs, not worth a curve of their own
    for name in ("ratio_max", "ratio_min"):
        value = finished.get(prefix + name)
        if value is not None and abs(float(value)) == float("inf"):
            del finished[prefix + name]
    return finished


# ---------------------------------------------------------------------------------------------
# The trainer-vs-engine gap (measured every step)
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def log_prob_gap(
    trainer_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    masks: list[torch.Tensor],
) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's on the same tokens (float64).

    Per sample ``[R]`` tensors and loss masks. Returns ``rollout_log_prob_abs_diff`` (token mean
    of ``|lp_trainer - lp_rollout|``), ``rollout_kl_k3`` (token mean of k3 with the trainer as
    the policy and the engine as the reference, :func:`~megatron_gspo.algo.kl.kl_estimate`) and
    the log-perplexity gap ``rollout_log_ppl_diff`` / ``rollout_log_ppl_abs_diff``: the mean over
    sequences of ``log PPL_rollout - log PPL_trainer = mean_t lp_trainer - mean_t lp_rollout``
    (positive: the trainer finds the text more likely than the engine did; verl and slime log the
    same ``log_ppl_diff``). Empty when no sample has a loss token.
    """
    if not masks:
        return {}
    # All sequences at once (one by one, these small operations cost the trainer several
    # percent of a CPU demo step): the loss tokens in sequence order, each with its sequence.
    mask = torch.cat([sequence_mask.bool() for sequence_mask in masks])
    trainer_all = torch.cat(list(trainer_log_probs)).double()[mask]
    rollout_all = torch.cat(list(rollout_log_probs)).double()[mask]
    lengths = torch.tensor([sequence_mask.numel() for sequence_mask in masks])
    sequence = torch.repeat_interleave(torch.arange(len(masks)), lengths)[mask]
    tokens = torch.bincount(sequence, minlength=len(masks)).double()
    has_tokens = tokens > 0
    if not bool(has_tokens.any()):
        return {}
    sums = torch.zeros(2, len(masks), dtype=torch.float64)
    sums[0].index_add_(0, sequence, trainer_all)
    sums[1].index_add_(0, sequence, rollout_all)
    means = sums[:, has_tokens] / tokens[has_tokens]
    ppl_gap = means[0] - means[1]
    return {
        "rollout_log_prob_abs_diff": float((trainer_all - rollout_all).abs().mean()),
        "rollout_kl_k3": float(kl_estimate(trainer_all, rollout_all, "k3").mean()),
        "rollout_log_ppl_diff": float(ppl_gap.mean()),
        "rollout_log_ppl_abs_diff": float(ppl_gap.abs().mean()),
    }
