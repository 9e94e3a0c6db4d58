"""Float64 references for the algorithm core, written from the formulas, not from the implementation.

They loop over sequences (and groups) in plain Python so that their structure shares nothing with
the vectorised code under test. Notation: ``m_it`` response mask, ``n_i`` the response length of
sequence ``i``, ``N_seq`` the sequences with at least one response token, ``N_tok`` the response
tokens, ``C`` the log-ratio clamp.
"""

from __future__ import annotations

import math
import statistics
from typing import Optional

import torch

KL_CLAMP = 20.0


AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "dr-grpo",
)
"""The aggregation modes the references implement (the loss tests run each)."""


def _weight_of(agg: str, length: float, num_sequences: float, num_tokens: float, norm: float):
    """Weight of one token of a sequence of ``length`` tokens under ``agg``: ``1/N_tok``,
    ``1/N_seq``, ``1/(n_i N_seq)``, ``1/T_norm`` (ROLL's and verl's sum-norm) or
    ``1/(N_seq T_norm)`` (TRL's dr_grpo)."""
    return {
        "token-mean": 1.0 / num_tokens,
        "seq-mean-token-sum": 1.0 / num_sequences,
        "seq-mean-token-mean": 1.0 / (length * num_sequences),
        "seq-mean-token-sum-norm": 1.0 / norm,
        "dr-grpo": 1.0 / (num_sequences * norm),
    }[agg]


def kl_reference(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: str,
    k3_cap: Optional[float] = None,
) -> torch.Tensor:
    """Schulman's estimators with ``x = clamp(ref - lp, -20, 20)`` (clamped before ``exp``).

    k1 = ``-x`` (= lp - ref), k2 = ``x^2 / 2``, k3 = ``e^x - x - 1``, then with ``k3_cap`` c
    ``min(max(k3, -c), c)`` (verl's low_var_kl).
    """
    x = (ref_log_probs - log_probs).clamp(-KL_CLAMP, KL_CLAMP)
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return x * x / 2
    if estimator == "k3":
        k3 = torch.exp(x) - x - 1
        if k3_cap is None:
            return k3
        return torch.minimum(
            torch.maximum(k3, torch.full_like(k3, -k3_cap)), torch.full_like(k3, k3_cap)
        )
    raise ValueError(estimator)


def token_objective(ratio: torch.Tensor, advantage: torch.Tensor, clip_low, clip_high, dual):
    """Per-token clipped surrogate, written piecewise by the sign of ``A``.

    ``max(-A r, -A clip(r, 1-el, 1+eh))`` equals ``-A min(r, 1+eh)`` for ``A >= 0`` and
    ``|A| max(r, 1-el)`` for ``A < 0``; dual clip caps the latter at ``c |A|``.
    """
    positive = -advantage * torch.minimum(ratio, torch.full_like(ratio, 1 + clip_high))
    negative_inner = torch.maximum(ratio, torch.full_like(ratio, 1 - clip_low))
    if dual is not None:
        negative_inner = torch.minimum(negative_inner, torch.full_like(ratio, dual))
    negative = advantage.abs() * negative_inner
    return torch.where(advantage >= 0, positive, negative)


def reference_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling: str,
    clip_low: float,
    clip_high: float,
    loss_agg_mode: str,
    dual_clip_constant: Optional[float] = None,
    ref_log_probs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    kl_clamp: Optional[float] = None,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    num_sequences: Optional[float] = None,
    num_tokens: Optional[float] = None,
    sequence_lengths: Optional[list[float]] = None,
    norm_length: Optional[float] = None,
    log_ratio_clamp: float = 10.0,
    pg_weights: Optional[torch.Tensor] = None,
) -> dict[str, torch.Tensor]:
    """Loss and its parts, sequence by sequence, over the unmasked tokens only.

    Ratios: ``seq`` ``s_i = exp(clamp(sum_t m (lp - old) / n_i, +-C))`` shared by the sequence;
    ``seq_token`` the value of ``s_i`` with gradient ``s_i * grad lp_it`` (``s_i e^{lp - sg(lp)}``);
    ``token`` ``r_it = exp(clamp(lp_it - old_it, +-C))``.
    Token loss ``L = pg + kl_coef KL(lp, ref) - entropy_coef H`` and the weight of a token of
    sequence ``i`` is ``1/N_tok`` (token-mean), ``1/N_seq`` (seq-mean-token-sum),
    ``1/(n_i N_seq)`` (seq-mean-token-mean), ``1/T_norm`` (seq-mean-token-sum-norm, ROLL's and
    verl's meaning), ``1/(N_seq T_norm)`` (dr-grpo, TRL's).
    ``pg_weights`` ``[B, T]`` (a rollout correction) multiplies ``pg`` token by token.
    Returns ``loss``, ``pg_loss``, ``kl_loss`` and ``entropy_loss`` (each aggregated alike).
    """
    batch, width = log_probs.shape
    rows = [mask[i].nonzero().flatten() for i in range(batch)]
    lengths = [float(len(r)) for r in rows] if sequence_lengths is None else list(sequence_lengths)
    if num_sequences is None:
        num_sequences = float(sum(1 for n in lengths if n > 0))
    if num_tokens is None:
        num_tokens = float(sum(len(r) for r in rows))
    if norm_length is None:
        norm_length = float(width)
    parts = {"pg_loss": 0.0, "kl_loss": 0.0, "entropy_loss": 0.0}
    for i in range(batch):
        index = rows[i]
        if len(index) == 0:
            continue
        lp, old = log_probs[i, index], old_log_probs[i, index]
        adv = advantages[i].expand(len(index)) if advantages.dim() == 1 else advantages[i, index]
        if importance_sampling == "seq":
            log_s = (lp - old).sum() / lengths[i]
            ratio = torch.exp(log_s.clamp(-log_ratio_clamp, log_ratio_clamp)).expand(len(index))
        elif importance_sampling == "seq_token":
            log_s = (lp.detach() - old).sum() / lengths[i]
            ratio = torch.exp(log_s.clamp(-log_ratio_clamp, log_ratio_clamp)) * torch.exp(
                lp - lp.detach()
            )
        elif importance_sampling == "token":
            ratio = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp))
        else:
            raise ValueError(importance_sampling)
        weight = _weight_of(loss_agg_mode, lengths[i], num_sequences, num_tokens, norm_length)
        pg = token_objective(ratio, adv, clip_low, clip_high, dual_clip_constant)
        if pg_weights is not None:
            pg = pg * pg_weights[i, index]
        parts["pg_loss"] = parts["pg_loss"] + weight * pg.sum()
        if ref_log_probs is not None:
            kl = kl_reference(lp, ref_log_probs[i, index], kl_estimator, kl_clamp)
            parts["kl_loss"] = parts["kl_loss"] + weight * kl.sum()
        if entropy is not None:
            parts["entropy_loss"] = parts["entropy_loss"] + weight * entropy[i, index].sum()
    parts = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in parts.items()}
    parts["loss"] = (
        parts["pg_loss"] + kl_coef * parts["kl_loss"] - entropy_coef * parts["entropy_loss"]
    )
    return parts


# ------------------------------------------------------------------------------------------------
# Rollout corrections, CISPO, GMPO
# ------------------------------------------------------------------------------------------------

SAFETY = 20.0


def reference_correction_weights(
    old_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    mode: str,
    high: float,
    low: Optional[float] = None,
) -> torch.Tensor:
    """``[B, T]`` float64 weights, 0 outside the mask, one Python float at a time.

    token: ``x = exp(clamp(old - mu, +-20))`` per token; sequence: ``x = exp(clamp((1/n_i)
    sum_t (old - mu), +-20))`` (the geometric mean of the token ratios) shared by the sequence.
    truncate: ``min(x, high)``; mask: ``x`` if ``low <= x <= high`` else 0.
    """
    batch, width = mask.shape
    out = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        columns = [t for t in range(width) if mask[i, t]]
        if not columns:
            continue
        gaps = [float(old_log_probs[i, t]) - float(behaviour_log_probs[i, t]) for t in columns]
        if level == "token":
            ratios = [math.exp(min(max(g, -SAFETY), SAFETY)) for g in gaps]
        else:
            mean = math.fsum(gaps) / len(gaps)
            ratios = [math.exp(min(max(mean, -SAFETY), SAFETY))] * len(gaps)
        for t, x in zip(columns, ratios):
            if mode == "truncate":
                out[i, t] = min(x, high)
            else:
                out[i, t] = x if low <= x <= high else 0.0
    return out


def reference_cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    weight_low: float,
    weight_high: float,
    loss_agg_mode: str,
    pg_weights: Optional[torch.Tensor] = None,
    log_ratio_clamp: float = 10.0,
) -> torch.Tensor:
    """CISPO (MiniMax-M1 eq. 4): ``-sum sg(clip(r_it, w_low, w_high)) A_it log pi(y_it)``,
    ``r_it = exp(clamp(lp - old, +-C))``, aggregated like the other losses."""
    batch, width = log_probs.shape
    rows = [mask[i].nonzero().flatten() for i in range(batch)]
    num_sequences = float(sum(1 for r in rows if len(r)))
    num_tokens = float(sum(len(r) for r in rows))
    total = torch.zeros((), dtype=torch.float64)
    for i in range(batch):
        index = rows[i]
        if len(index) == 0:
            continue
        lp, old = log_probs[i, index], old_log_probs[i, index]
        adv = advantages[i].expand(len(index)) if advantages.dim() == 1 else advantages[i, index]
        ratio = torch.exp((lp - old).clamp(-log_ratio_clamp, log_ratio_clamp)).detach()
        weight = ratio.clamp(weight_low, weight_high)
        term = -weight * adv * lp
        if pg_weights is not None:
            term = term * pg_weights[i, index]
        scale = _weight_of(loss_agg_mode, float(len(index)), num_sequences, num_tokens, width)
        total = total + scale * term.sum()
    return total


def reference_gmpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon: float,
    pg_weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """GMPO (arXiv 2507.20673 eq. 4), as a loss:
    ``-(1/N_seq) sum_i sign(A_i) prod_t |min(r_it A_i, clip(r_it, e^-eps, e^eps) A_i)|^(1/n_i)``.

    Written literally: the product of the token terms' magnitudes in float64, then the n_i-th
    root, so it shares nothing with the log-space implementation.
    """
    batch, _ = log_probs.shape
    rows = [mask[i].nonzero().flatten() for i in range(batch)]
    num_sequences = float(sum(1 for r in rows if len(r)))
    low, high = math.exp(-epsilon), math.exp(epsilon)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(batch):
        index = rows[i]
        if len(index) == 0:
            continue
        advantage = advantages[i]
        ratio = torch.exp(log_probs[i, index] - old_log_probs[i, index])
        terms = torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage).abs()
        product = torch.prod(terms)
        term = torch.sign(advantage) * product ** (1.0 / len(index))
        if pg_weights is not None:
            term = term * pg_weights[i, index[0]]
        total = total - term / num_sequences
    return total


# ------------------------------------------------------------------------------------------------
# Advantages
# ------------------------------------------------------------------------------------------------


def groups_of(group_ids: list) -> dict:
    """``{group id: [sample indices]}`` in order of first appearance."""
    groups: dict = {}
    for index, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(index)
    return groups


def std_of(values: list[float], unbiased: bool) -> float:
    """Bessel-corrected (``statistics.stdev``) or population (``pstdev``) std; 0 for one value."""
    if len(values) < 2:
        return 0.0
    return statistics.stdev(values) if unbiased else statistics.pstdev(values)


def reference_advantages(
    rewards: list[float],
    group_ids: list,
    estimator: str,
    *,
    unbiased: bool = True,
    eps: float = 1e-6,
    baseline: str = "none",
) -> list[float]:
    """Per-sample advantages; a sample alone in its group gets 0 when a group baseline is used.

    grpo ``(r - mean_g) / (std_g + eps)``; dr_grpo ``r - mean_g``; reinforce ``r - b`` with
    ``b`` 0, ``mean_g`` or the batch mean; rloo ``r_i - (1/(n-1)) sum_{j != i} r_j``.
    """
    out = [0.0] * len(rewards)
    if estimator == "reinforce" and baseline in ("none", "batch"):
        b = statistics.fmean(rewards) if baseline == "batch" else 0.0
        return [r - b for r in rewards]
    for members in groups_of(group_ids).values():
        values = [rewards[i] for i in members]
        if len(values) == 1:
            continue
        mean = statistics.fmean(values)
        for i in members:
            if estimator == "grpo":
                out[i] = (rewards[i] - mean) / (std_of(values, unbiased) + eps)
            elif estimator in ("dr_grpo", "reinforce"):
                out[i] = rewards[i] - mean
            elif estimator == "rloo":
                others = [rewards[j] for j in members if j != i]
                out[i] = rewards[i] - sum(others) / len(others)
            else:
                raise ValueError(estimator)
    return out


def reference_whiten(values: list[float], weights: list[int]) -> list[float]:
    """Expand each value ``weights[i]`` times (its tokens), then ``(v - mean) / sqrt(var + 1e-8)``
    with the Bessel-corrected variance over those tokens."""
    tokens = [v for v, w in zip(values, weights) for _ in range(int(w))]
    mean = statistics.fmean(tokens)
    var = statistics.variance(tokens)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def reference_token_level_kl(
    advantages: list[float],
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str,
    k3_cap: Optional[float] = None,
) -> torch.Tensor:
    """``A_it = A_i - coef * sum_{t' >= t, m_it'} KL_it'`` at response tokens, 0 elsewhere
    (k3 capped to ``+-k3_cap`` when given)."""
    batch, width = mask.shape
    out = torch.zeros(batch, width, dtype=torch.float64)
    for i in range(batch):
        for t in range(width):
            if not mask[i, t]:
                continue
            future = 0.0
            for u in range(t, width):
                if mask[i, u]:
                    x = min(max(float(ref_log_probs[i, u] - old_log_probs[i, u]), -20.0), 20.0)
                    kl = {"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - x - 1}[estimator]
                    if estimator == "k3" and k3_cap is not None:
                        kl = min(max(kl, -k3_cap), k3_cap)
                    future += kl
            out[i, t] = advantages[i] - coef * future
    return out
