"""Math answer checking with Hugging Face's ``math_verify`` (parse gold and prediction, then
``verify``: symbolic equivalence, so ``\\frac{1}{2}``, ``0.5`` and ``2/4`` all match)."""

from __future__ import annotations

import threading
from typing import Optional

from megatron_gspo.reward.functions import RewardInput

PARSE_TIMEOUT_S = 5


def _signal_timeout() -> Optional[int]:
    # math_verify bounds sympy with signal.alarm, which only works in the main thread; in a thread
    # worker the runner's own per-call timeout is the only bound.
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str) -> list:
    """The reference answer parsed by math_verify. A bare answer (``[0, 1)``, ``x^2+1``) is read
    as LaTeX math (wrapped in ``$...$``), as math data sets write answers; one with ``$`` or
    ``\\boxed`` is read as it is. ValueError if nothing parses: a reference that cannot be checked
    is a data error, not a wrong response."""
    from math_verify import parse

    timeout = _signal_timeout()
    text = answer.strip()
    candidates = [text] if ("$" in text or "\\boxed" in text) else [f"${text}$", text]
    for candidate in candidates:
        parsed = parse(candidate, parsing_timeout=timeout)
        # Where sympy fails, math_verify returns only the raw string: nothing to compare against.
        if any(not isinstance(item, str) for item in parsed):
            return parsed
    raise ValueError(f"math_verify cannot parse the reference answer {answer!r}")


def math_reward(sample: RewardInput, *, require_boxed: bool = False) -> float:
    """1.0 if the response's final answer equals the reference answer, else 0.0.

    The prediction is the response's ``\\boxed{...}`` answer if it has one, else (unless
    ``require_boxed``) its last LaTeX or plain-expression answer, as math_verify extracts them.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if sample.answer is None:
        raise ValueError("the math reward needs a reference answer (sample.answer is None)")
    gold = parse_gold(sample.answer)
    timeout = _signal_timeout()
    if require_boxed:
        if "\\boxed" not in sample.response and "\\fbox" not in sample.response:
            return 0.0
        extraction = [LatexExtractionConfig(boxed_match_priority=0)]
    else:
        extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    prediction = parse(sample.response, extraction_config=extraction, parsing_timeout=timeout)
    if not prediction:
        return 0.0
    return float(verify(gold, prediction, timeout_seconds=timeout))
