"""Stop strings over token ids: where a response's text first contains a stop string.

The rollout protocol is token ids in, token ids out (``docs/sglang-protocol.md``); a stop string
is a property of the decoded text. SGLang with a tokenizer (started without
``--skip-tokenizer-init``) checks after each generated token whether the decoded output contains
a stop string and ends the response with that token (``finish_reason`` ``{"type": "stop",
"matched": "<the string>"}``); the token that completes the string is kept. :func:`cut_at_stop_string`
applies the same rule to a finished list of ids, so responses of an engine without stop strings
(the embedded one) can be cut as SGLang would cut them, and SGLang's answers can be checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def cut_at_stop_string(
    tokenizer: PreTrainedTokenizerBase,
    output_ids: Sequence[int],
    stop_strings: Sequence[str],
) -> Optional[tuple[int, str]]:
    """``(tokens kept, the matched string)`` for the shortest prefix of ``output_ids`` whose text
    contains one of ``stop_strings`` (the first of them, in the given order, when one prefix
    completes several), or None when no prefix does. Special tokens count as their text."""
    if not stop_strings or any(not stop for stop in stop_strings):
        raise ValueError(f"stop strings must be non-empty: {list(stop_strings)!r}")
    # Decoding each prefix is quadratic, but responses are checked once and a stop string cannot
    # be completed by a token before the first one whose prefix text contains it.
    for length in range(1, len(output_ids) + 1):
        text = tokenizer.decode(list(output_ids[:length]), skip_special_tokens=False)
        for stop in stop_strings:
            if stop in text:
                return length, stop
    return None
