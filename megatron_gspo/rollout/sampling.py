"""Token sampling with SGLang's semantics, one independent random stream per request.

Shapes: ``B`` rows (requests) in a decode step, ``V`` vocabulary, ``N`` excluded (row, token)
pairs.

* Log-probs are ``log_softmax(logits / T)`` of the FULL distribution, before top-k/top-p
  truncation (SGLang's default; ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset). Greedy rows
  (``T == 0``) report ``log_softmax(logits)``: SGLang turns ``temperature=0`` into
  ``temperature=1, top_k=1``.
* Excluded tokens (the stop tokens of a row still short of ``min_new_tokens``) are removed
  before truncation, as SGLang's min-new-tokens penalizer sets their logits to ``-inf`` before
  its sampler; the reported log-probs stay those of the full distribution.
* Truncation follows SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``: sort the
  probabilities, drop ranks ``>= top_k``, then drop every token whose preceding (top-k-masked)
  mass already exceeds ``top_p``; the first token always survives.
* Each sampled row draws ONE float64 uniform ``u`` per token from its own ``torch.Generator``
  and takes the inverse CDF of its (truncated) weights at ``u`` (:func:`inverse_cdf_sample`),
  so a row's samples depend on its seed and its logits only, never on which other rows share
  the batch. One draw per row instead of one exponential per vocabulary entry (the exponential
  race, as ``torch.multinomial`` samples): at B = 64, V = 151,936 on one CPU thread the
  ``B x V`` exponentials take ~220 ms per decode step, the inverse-CDF search ~3 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

SAMPLING_BLOCK_SIZE = 1024
"""Vocabulary entries per block of :func:`inverse_cdf_sample`'s two-level search."""


def temperature_log_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` fp32 ``log_softmax(logits / T)`` with ``T = 1`` for greedy rows (``T == 0``).

    Args:
        logits: ``[B, V]`` raw logits (any float dtype; computed in fp32).
        temperatures: ``[B]`` sampling temperatures, ``>= 0``.
    """
    logits = logits.float()
    if bool(((temperatures == 1) | (temperatures == 0)).all()):
        # Every scale is 1: skip a [B, V] division whose result would equal its input bit for bit.
        return torch.log_softmax(logits, dim=-1)
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits / scale.float().to(logits.device).unsqueeze(-1), dim=-1)


def truncation_mask(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: the tokens top-k then top-p keep (SGLang's order and rule).

    Args:
        probs: ``[B, V]`` probabilities at the sampling temperature.
        top_p: ``[B]`` in ``(0, 1]``; 1 keeps everything.
        top_k: ``[B]`` int, ``<= 0`` (or ``>= V``) keeps everything.
    """
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(-1)
    sorted_probs = sorted_probs.masked_fill(ranks >= k, 0.0)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = (ranks < k) & (mass_before <= top_p.unsqueeze(-1).to(probs.dtype))
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _search_cdf(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """``[R]`` first index ``t`` with ``cdf[t] > u * cdf[-1]``; ``cdf`` ``[R, S]`` float64
    non-decreasing with a positive last column, ``uniforms`` ``[R]`` float64 in ``[0, 1)``.

    The target is held strictly below the total (``u * total`` can round up to it), so the
    index is always one whose own weight is positive: a zero-weight entry repeats its
    predecessor's cdf and is never the first to exceed anything.
    """
    total = cdf[:, -1]
    target = torch.minimum(uniforms * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)


def inverse_cdf_sample(
    weights: torch.Tensor, uniforms: torch.Tensor, block_size: int = SAMPLING_BLOCK_SIZE
) -> torch.Tensor:
    """``[R]`` int64: row ``r`` samples ``weights[r] / sum(weights[r])`` by inverse transform.

    The token is the ``t`` with ``C(t - 1) <= u_r * C(V) < C(t)``, ``C`` the cumulative sum of
    the row's weights: exact sampling when ``u_r ~ U[0, 1)``.

    Numerics and cost: the search runs on two levels, ``V / block_size`` block masses (float32
    sums over ``block_size`` entries, relative error ~1e-7: the rounding of the float32 weights
    themselves), then the float64 cumulative sum of the one chosen block per row with the
    remaining fraction of ``u``. At B = 64, V = 151,936 (one CPU thread) that is ~3 ms, against
    ~70 ms for a float64 cumulative sum of ``[R, V]`` (and its 78 MB copy) and ~22 ms for a
    float32 one, whose running-sum error (~5e-8) is already ~1% of one token's probability
    there. Vocabularies of at most ``block_size`` take one float64 cumulative sum.

    Args:
        weights: ``[R, V]`` non-negative floats, each row with a positive (normal) sum.
        uniforms: ``[R]`` float64 in ``[0, 1)``.
        block_size: entries per block of the two-level search.
    """
    rows, vocab = weights.shape
    uniforms = uniforms.to(device=weights.device, dtype=torch.float64)
    if vocab <= block_size:
        return _search_cdf(weights.to(torch.float64).cumsum(dim=-1), uniforms)
    num_full = vocab // block_size
    block_mass = weights[:, : num_full * block_size].view(rows, num_full, block_size).sum(-1)
    if vocab % block_size:
        tail = weights[:, num_full * block_size :].sum(-1, keepdim=True)
        block_mass = torch.cat([block_mass, tail], dim=-1)
    block_cdf = block_mass.to(torch.float64).cumsum(dim=-1)
    block = _search_cdf(block_cdf, uniforms)
    # The fraction of u left inside the chosen block: (u * total - mass before) / block mass.
    target = uniforms * block_cdf[:, -1]
    before = torch.where(
        block > 0,
        block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1),
        torch.zeros_like(target),
    )
    mass = block_mass.gather(1, block.unsqueeze(1)).squeeze(1).to(torch.float64)
    inside = ((target - before) / mass).clamp(0.0, 1.0)
    index = block.unsqueeze(1) * block_size + torch.arange(block_size, device=weights.device)
    in_vocab = index < vocab
    chosen = weights.gather(1, index.clamp(max=vocab - 1)).masked_fill(~in_vocab, 0.0)
    return block * block_size + _search_cdf(chosen.to(torch.float64).cumsum(dim=-1), inside)


def _without_excluded(
    log_probs: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """``probs`` (modified in place) with the ``(rows, tokens)`` entries removed.

    A row whose excluded tokens held most of the mass is recomputed as
    ``softmax(log_probs)`` over its allowed tokens: the float32 probabilities of what remains
    could otherwise underflow (a stop token at probability ~1 leaves the rest at ~0).
    """
    excluded_mass = torch.zeros(len(probs), dtype=probs.dtype, device=probs.device)
    excluded_mass.index_add_(0, rows, probs[rows, tokens])
    probs[rows, tokens] = 0.0
    for row in (excluded_mass > 0.5).nonzero().flatten().tolist():
        allowed = log_probs[row].clone()
        allowed[tokens[rows == row]] = float("-inf")
        if not bool(torch.isfinite(allowed).any()):
            raise ValueError(
                f"sampling row {row}: every token with a probability is excluded (the stop "
                "tokens of a request short of min_new_tokens); allow at least one other token"
            )
        probs[row] = torch.softmax(allowed, dim=-1)
    return probs


class UniformStreams:
    """One stream of float64 uniforms in ``[0, 1)`` per row, from the row's own generator.

    Row ``b``'s ``t``-th draw is the ``t``-th double of ``torch.Generator().manual_seed(seed_b)``
    whatever the batch: draws come in chunks of ``chunk`` per row (one generator call per row
    per ``chunk`` tokens instead of one per token, a Python call each), and a chunk's size never
    depends on the batch. Rows without a stream (greedy) draw nothing and read 0.

    Args:
        seeds: one seed per row, or None for a row that samples nothing.
        chunk: draws per row per refill.
    """

    def __init__(self, seeds: Sequence[Optional[int]], chunk: int = 64):
        if chunk < 1:
            raise ValueError(f"chunk={chunk} must be >= 1")
        self.chunk = chunk
        self._generators = [
            None if seed is None else torch.Generator().manual_seed(seed) for seed in seeds
        ]
        self._table = torch.zeros(0, chunk, dtype=torch.float64)
        self._column = chunk

    def __len__(self) -> int:
        return len(self._generators)

    def next(self) -> torch.Tensor:
        """``[B]`` float64: every row's next uniform (0 for rows without a stream)."""
        if self._column == self.chunk:
            # A fresh table: the columns handed out before stay valid.
            self._table = torch.zeros(len(self._generators), self.chunk, dtype=torch.float64)
            for row, generator in enumerate(self._generators):
                if generator is not None:
                    self._table[row].uniform_(generator=generator)
            self._column = 0
        self._column += 1
        return self._table[:, self._column - 1]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order), e.g. when finished rows leave a batch."""
        self._generators = [self._generators[row] for row in rows]
        self._table = self._table[list(rows)]


def _rows_within(
    pairs: tuple[torch.Tensor, torch.Tensor], subset: list[int], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(row, token)`` pairs whose row is in ``subset``, rows renumbered to positions in
    ``subset``."""
    rows, tokens = pairs
    position = torch.full((batch_size,), -1, dtype=torch.long, device=rows.device)
    position[subset] = torch.arange(len(subset), device=rows.device)
    hit = position[rows] >= 0
    return position[rows][hit], tokens[hit]


def sample_tokens(
    log_probs: torch.Tensor,
    temperatures: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
    excluded: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """``[B]`` int64 next tokens.

    Greedy rows (``T == 0``) take the argmax of their non-excluded log-probs and ignore their
    uniform; the others sample the truncated distribution without the excluded tokens by
    inverse transform at their uniform (:func:`inverse_cdf_sample`), so a row's token depends
    on its own logits and uniform only.

    Args:
        log_probs: ``[B, V]`` from :func:`temperature_log_probs` (not modified).
        temperatures, top_p, top_k: ``[B]`` per-row sampling parameters (CPU).
        uniforms: ``[B]`` float64 in ``[0, 1)``, one per row (:class:`UniformStreams`).
        excluded: ``([N] rows, [N] token ids)`` that may not be sampled (distinct pairs), or
            None.
    """
    batch_size = len(log_probs)
    device = log_probs.device
    greedy = (temperatures == 0).tolist()
    sampled_rows = [row for row, is_greedy in enumerate(greedy) if not is_greedy]
    greedy_rows = [row for row, is_greedy in enumerate(greedy) if is_greedy]
    if excluded is not None:
        excluded = (excluded[0].to(device), excluded[1].to(device)) if len(excluded[0]) else None
    tokens = torch.empty(batch_size, dtype=torch.long, device=device)
    if greedy_rows:
        chosen = log_probs[greedy_rows]
        if excluded is not None:
            rows, token_ids = _rows_within(excluded, greedy_rows, batch_size)
            chosen[rows, token_ids] = float("-inf")
            if not bool(torch.isfinite(chosen.max(dim=-1).values).all()):
                raise ValueError(
                    "greedy sampling: every token of a row is excluded (the stop tokens of a "
                    "request short of min_new_tokens); allow at least one other token"
                )
        tokens[greedy_rows] = chosen.argmax(dim=-1)
    if not sampled_rows:
        return tokens
    everything = len(sampled_rows) == batch_size
    # At a 150k vocabulary every [B, V] copy is tens of MB: no row gather when all rows sample.
    row_log_probs = log_probs if everything else log_probs[sampled_rows]
    probs = row_log_probs.exp()
    row_top_p, row_top_k, row_uniforms = (
        (top_p, top_k, uniforms)
        if everything
        else (top_p[sampled_rows], top_k[sampled_rows], uniforms[sampled_rows])
    )
    vocab = probs.shape[-1]
    truncate = bool((row_top_p < 1).any()) or bool(((row_top_k > 0) & (row_top_k < vocab)).any())
    if excluded is not None:
        rows, token_ids = (
            excluded if everything else _rows_within(excluded, sampled_rows, batch_size)
        )
        if len(rows):
            probs = _without_excluded(row_log_probs, probs, rows, token_ids)
            if truncate:
                # Top-p ranks a normalised distribution (SGLang truncates after the penalty);
                # the inverse CDF itself needs no normalisation.
                probs = probs / probs.sum(dim=-1, keepdim=True)
    if truncate:
        # The mask keeps everything without truncation: skip its vocabulary sort.
        probs = probs * truncation_mask(probs, row_top_p.to(device), row_top_k.to(device))
    sampled = inverse_cdf_sample(probs, row_uniforms)
    if everything:
        return sampled
    tokens[sampled_rows] = sampled
    return tokens
