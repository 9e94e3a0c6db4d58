"""Token sampling with SGLang's semantics, one independent random stream per request.

Shapes: ``B`` rows (requests) in a decode step, ``V`` vocabulary.

* Log-probs are ``log_softmax(logits / T)`` of the FULL distribution, before top-k/top-p
  truncation (SGLang's default; ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset). Greedy rows
  (``T == 0``) report ``log_softmax(logits)``: SGLang turns ``temperature=0`` into
  ``temperature=1, top_k=1``.
* Truncation follows SGLang's ``top_k_top_p_min_p_sampling_from_probs_torch``: sort the
  probabilities, drop ranks ``>= top_k``, then drop every token whose preceding (top-k-masked)
  mass already exceeds ``top_p``; the first token always survives.
* Each row draws its noise from its own ``torch.Generator`` (exponential race:
  ``argmax(p / E)``, ``E ~ Exp(1)``, which samples ``p`` exactly), so a row's samples depend on
  its seed and its logits only, never on which other rows share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def temperature_log_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` fp32 ``log_softmax(logits / T)`` with ``T = 1`` for greedy rows (``T == 0``).

    Args:
        logits: ``[B, V]`` raw logits (any float dtype; computed in fp32).
        temperatures: ``[B]`` sampling temperatures, ``>= 0``.
    """
    scale = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / scale.float().unsqueeze(-1), dim=-1)


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


def sample_tokens(
    log_probs: torch.Tensor,
    temperatures: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """``[B]`` int64 next tokens.

    Greedy rows (``T == 0``) take ``argmax(log_probs)`` and draw no noise; the others sample the
    truncated, renormalised distribution with their own generator.

    Args:
        log_probs: ``[B, V]`` from :func:`temperature_log_probs`.
        temperatures, top_p, top_k: ``[B]`` per-row sampling parameters.
        generators: ``B`` CPU generators; row ``b`` advances only ``generators[b]``.
    """
    tokens = log_probs.argmax(dim=-1)
    sampled_rows = (temperatures > 0).nonzero().flatten().tolist()
    if not sampled_rows:
        return tokens
    rows = torch.tensor(sampled_rows, device=log_probs.device)
    # At a 150k vocabulary every [B, V] copy is tens of MB: no row gather when all rows sample,
    # and the noise division below runs in place.
    probs = (log_probs if len(sampled_rows) == len(log_probs) else log_probs[rows]).exp()
    vocab = probs.shape[-1]
    row_top_p, row_top_k = top_p[rows], top_k[rows]
    if bool((row_top_p < 1).any()) or bool(((row_top_k > 0) & (row_top_k < vocab)).any()):
        # The mask keeps everything without truncation: skip its vocabulary sort.
        probs = probs * truncation_mask(probs, row_top_p, row_top_k)
    # Noise drawn on CPU from each row's own stream, one row at a time: identical for the same
    # seed whatever the batch, and independent of the device the logits live on.
    noise = torch.empty(len(sampled_rows), vocab, dtype=torch.float32)
    for position, row in enumerate(sampled_rows):
        noise[position].exponential_(generator=generators[row])
    tokens[rows] = probs.cpu().div_(noise).argmax(dim=-1).to(tokens.device)
    return tokens
