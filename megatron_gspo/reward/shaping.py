"""Reward shaping by response length (no torch): DAPO's soft over-long punishment.

DAPO (Yu et al. 2025, arXiv 2503.14476, eq. 13) adds to the reward of a response of ``n``
tokens, with ``L_max`` the most tokens a response may have and ``L_cache`` the buffer::

    R_length(n) =  0                                  n <= L_max - L_cache
                   ((L_max - L_cache) - n) / L_cache  L_max - L_cache < n <= L_max
                   -1                                 L_max < n

scaled by a penalty factor (verl's ``overlong_buffer.penalty_factor``, TRL's
``get_soft_overlong_punishment``). Responses are generated with at most ``L_max`` tokens, so the
last case only happens to a response that a caller counts differently; a response cut at the
limit gets the full ``-factor``.
"""

from __future__ import annotations


def overlong_penalty(num_tokens: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """``factor * R_length(num_tokens)`` with ``L_max = max_tokens``, ``L_cache = buffer`` (module
    docstring); 0 when ``buffer`` is 0 (shaping off)."""
    if buffer <= 0:
        return 0.0
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"the over-long buffer {buffer} must be in (0, max_tokens={max_tokens}]")
    start = max_tokens - buffer
    if num_tokens <= start:
        return 0.0
    if num_tokens > max_tokens:
        return -factor
    return factor * (start - num_tokens) / buffer
