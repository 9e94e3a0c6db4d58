"""Text rewards: exact match against the answer, and a format check by regular expression."""

from __future__ import annotations

import functools
import re
from typing import Optional

from megatron_gspo.reward.functions import RewardInput

THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
"""The DeepSeek-R1 layout: reasoning in <think>, then the answer in <answer>."""


@functools.lru_cache(maxsize=64)
def _compile(pattern: str, flags: int) -> re.Pattern:
    return re.compile(pattern, flags)


def _strip_special_tokens(text: str, special_tokens: tuple[str, ...]) -> str:
    for token in special_tokens:
        text = text.replace(token, "")
    return text


def normalize_text(text: str, *, ignore_case: bool, normalize_whitespace: bool) -> str:
    """Strip, collapse runs of whitespace to one space (optional), lower-case (optional)."""
    text = text.strip()
    if normalize_whitespace:
        text = " ".join(text.split())
    return text.lower() if ignore_case else text


def exact_match_reward(
    sample: RewardInput,
    *,
    ignore_case: bool = False,
    normalize_whitespace: bool = True,
    extract_pattern: Optional[str] = None,
    special_tokens: tuple[str, ...] = (),
) -> float:
    """1.0 if the (extracted, normalised) response equals the normalised answer, else 0.0.

    ``extract_pattern``: a regular expression whose first group is the part of the response to
    compare (the last match counts, e.g. ``<answer>(.*?)</answer>``); no match scores 0.
    ``special_tokens``: strings removed from the response first (e.g. ``["<|im_end|>"]``).
    """
    if sample.answer is None:
        raise ValueError("exact_match needs an answer (sample.answer is None)")
    response = _strip_special_tokens(sample.response, tuple(special_tokens))
    if extract_pattern is not None:
        matches = list(_compile(extract_pattern, re.DOTALL).finditer(response))
        if not matches:
            return 0.0
        last = matches[-1]
        response = last.group(1) if last.groups() else last.group(0)
    options = {"ignore_case": ignore_case, "normalize_whitespace": normalize_whitespace}
    return float(normalize_text(response, **options) == normalize_text(sample.answer, **options))


def format_reward(
    sample: RewardInput,
    *,
    pattern: str = THINK_ANSWER_PATTERN,
    full_match: bool = True,
    special_tokens: tuple[str, ...] = (),
) -> float:
    """1.0 if the response matches ``pattern`` (``re.DOTALL``; the whole stripped response when
    ``full_match``, else anywhere in it), else 0.0. ``special_tokens`` are removed first."""
    response = _strip_special_tokens(sample.response, tuple(special_tokens)).strip()
    compiled = _compile(pattern, re.DOTALL)
    matched = compiled.fullmatch(response) if full_match else compiled.search(response)
    return float(matched is not None)
