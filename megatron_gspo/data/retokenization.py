"""Retokenization: a response's ids decoded to text and encoded again, and the engine's
log-probs carried to the new token boundaries.

Naive agent harnesses keep text, not ids: they decode what the engine generated and encode it
again before training. A byte-level BPE tokenizer has many token paths for one text, and the
engine samples one token at a time, so it often takes a path that is not the one the encoder
picks (``"hel" + "lo"`` where the encoder writes ``"hello"``); bytes that are not valid UTF-8 on
their own come back as U+FFFD. The trainer then trains on ids the engine never sampled, and the
engine's per-token log-probs no longer sit on the trained tokens.

:func:`carry_log_probs` aligns the two tokenizations on byte offsets. The response is split into
the smallest segments whose two ends are token boundaries of both tokenizations, at the same
place of the text; a segment whose tokens are the same keeps its log-probs, and a segment that
changed gets the total of its original tokens' log-probs (the log-probability the engine gave
that piece of text, on its own path) spread evenly over its new tokens. Why spread: the log-prob
the engine assigned to the whole sequence is kept exactly (every segment's sum is), which is what
a sequence-level ratio sees; per-token values inside a changed segment are not defined (the
engine never scored the new tokens), so no split of the total is more right than another.

When the decoded text does not encode back to the same bytes (invalid UTF-8 replaced by U+FFFD,
Unicode normalisation), the byte strings are matched first (:class:`difflib.SequenceMatcher`)
and boundaries are common only inside matching stretches, so a replaced piece becomes one
changed segment with its neighbours.

Byte-level tokenizers only (GPT-2, Qwen, Llama 3 style: :func:`token_byte_table` refuses
others): their tokens are byte strings, so byte offsets are exact. An id past the tokenizer (a
padding row of the embedding, which an untrained model can sample) has no text: decoding drops
it, and here it has no bytes, so it joins the segment after it (at the end: the last one), whose
total then holds its log-prob.
"""

from __future__ import annotations

import bisect
import difflib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EmptyRetokenization(ValueError):
    """The response's text is empty (every id past the tokenizer) or the response is: no token
    on one side to carry the log-probs to."""


@dataclass(frozen=True)
class Segment:
    """One aligned piece of a response: original tokens ``[old_start, old_end)``, new tokens
    ``[new_start, new_end)``, covering the same text."""

    old_start: int
    old_end: int
    new_start: int
    new_end: int
    changed: bool
    """The new tokens are not the original ones."""


@dataclass(frozen=True)
class Retokenized:
    """A response after decode-then-encode, with the engine's values carried to its tokens."""

    ids: list[int]
    log_probs: list[float]
    """One per new token (float64 arithmetic: a changed segment's values sum to its original
    total)."""
    weight_versions: Optional[list[int]]
    """One per new token: the original token's, or in a changed segment the oldest of its
    original tokens' (None when none were given)."""
    segments: list[Segment]

    @property
    def changed(self) -> bool:
        return any(segment.changed for segment in self.segments)

    @property
    def changed_tokens(self) -> int:
        """New tokens in changed segments."""
        return sum(s.new_end - s.new_start for s in self.segments if s.changed)


def token_byte_table(tokenizer: PreTrainedTokenizerBase) -> list[bytes]:
    """The bytes of every token id of a byte-level BPE tokenizer (added tokens: their text in
    UTF-8, as decoding writes them); ValueError for a tokenizer that is not byte-level, whose
    tokens have no byte string to align on."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    if not decoder or decoder.get("type") != "ByteLevel":
        raise ValueError(
            f"{type(tokenizer).__name__} is not a byte-level BPE tokenizer (decoder "
            f"{(decoder or {}).get('type')!r}): retokenization aligns tokens on their bytes"
        )
    character_to_byte = _byte_level_alphabet()
    table = [b""] * len(tokenizer)
    added = {index: token.content for index, token in tokenizer.added_tokens_decoder.items()}
    for token, index in tokenizer.get_vocab().items():
        if index in added:
            table[index] = added[index].encode("utf-8")
        else:
            table[index] = bytes(character_to_byte[character] for character in token)
    return table


def _byte_level_alphabet() -> dict[str, int]:
    # GPT-2's bytes_to_unicode, inverted: printable bytes are themselves, the other 68 bytes the
    # code points 256, 257, ... in byte order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if byte not in set(printable)]
    mapping.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return mapping


def reencode(ids: Sequence[int], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """What a naive harness trains on: ``ids`` decoded to text (special tokens kept as their
    text, so the end-of-turn token survives) and encoded again without added BOS/EOS."""
    text = tokenizer.decode(list(ids), skip_special_tokens=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _token_bytes(table: Sequence[bytes], token: int) -> bytes:
    return table[token] if 0 <= token < len(table) else b""  # past the tokenizer: no text


def _offsets(ids: Sequence[int], table: Sequence[bytes]) -> list[int]:
    offsets = [0]
    for token in ids:
        offsets.append(offsets[-1] + len(_token_bytes(table, token)))
    return offsets


def _common_boundaries(
    old_bytes: bytes, old_offsets: list[int], new_bytes: bytes, new_offsets: list[int]
) -> list[tuple[int, int]]:
    """``(old byte offset, new byte offset)`` pairs that are token boundaries of both at the same
    place of the text, strictly increasing in both, from ``(0, 0)`` to both ends."""
    new_set = set(new_offsets)
    if old_bytes == new_bytes:
        candidates = [(p, p) for p in old_offsets if p in new_set]
    else:
        # Lossy round trip: a boundary is common only inside (or at an end of) a stretch of
        # bytes both sides share, where offsets correspond one to one.
        candidates = []
        matcher = difflib.SequenceMatcher(None, old_bytes, new_bytes, autojunk=False)
        for old_start, new_start, size in matcher.get_matching_blocks():
            first = bisect.bisect_left(old_offsets, old_start)
            last = bisect.bisect_right(old_offsets, old_start + size)
            for p in old_offsets[first:last]:
                q = new_start + (p - old_start)
                if q in new_set:
                    candidates.append((p, q))
    ends = (len(old_bytes), len(new_bytes))
    pairs = [(0, 0)]
    for p, q in sorted(candidates):
        # Every segment needs tokens on both sides: a boundary that does not advance both is
        # dropped, and the segments around it merge.
        if pairs[-1][0] < p < ends[0] and pairs[-1][1] < q < ends[1]:
            pairs.append((p, q))
    pairs.append(ends)
    return pairs


def carry_log_probs(
    old_ids: Sequence[int],
    old_log_probs: Sequence[float],
    new_ids: Sequence[int],
    table: Sequence[bytes],
    old_weight_versions: Optional[Sequence[int]] = None,
) -> Retokenized:
    """``new_ids`` (a retokenization of ``old_ids``) with the engine's ``old_log_probs`` (and
    weight versions) carried to them segment by segment (module docstring); ``table`` is
    :func:`token_byte_table`'s. Identical ids come back unchanged."""
    if len(old_log_probs) != len(old_ids):
        raise ValueError(f"{len(old_log_probs)} log-probs for {len(old_ids)} tokens")
    if old_weight_versions is not None and len(old_weight_versions) != len(old_ids):
        raise ValueError(f"{len(old_weight_versions)} weight versions for {len(old_ids)} tokens")
    versions = None if old_weight_versions is None else [int(v) for v in old_weight_versions]
    if list(new_ids) == list(old_ids):
        whole = Segment(0, len(old_ids), 0, len(new_ids), changed=False)
        return Retokenized(list(new_ids), [float(v) for v in old_log_probs], versions, [whole])
    if not new_ids or not old_ids:
        raise EmptyRetokenization(f"{len(old_ids)} tokens re-encoded as {len(new_ids)}")
    old_offsets, new_offsets = _offsets(old_ids, table), _offsets(new_ids, table)
    old_bytes = b"".join(_token_bytes(table, token) for token in old_ids)
    new_bytes = b"".join(_token_bytes(table, token) for token in new_ids)
    # A boundary's token index is the first token that starts there: a token of no bytes
    # belongs to the segment after it.
    old_index: dict[int, int] = {}
    for index, offset in enumerate(old_offsets):
        old_index.setdefault(offset, index)
    new_index: dict[int, int] = {}
    for index, offset in enumerate(new_offsets):
        new_index.setdefault(offset, index)
    boundaries = _common_boundaries(old_bytes, old_offsets, new_bytes, new_offsets)
    segments: list[Segment] = []
    log_probs: list[float] = []
    new_versions: Optional[list[int]] = None if versions is None else []
    for (p0, q0), (p1, q1) in zip(boundaries, boundaries[1:]):
        # The first segment starts at 0 and the last ends at the end, tokens of no bytes there
        # included.
        i0 = 0 if p0 == 0 else old_index[p0]
        j0 = 0 if q0 == 0 else new_index[q0]
        i1 = len(old_ids) if p1 == len(old_bytes) else old_index[p1]
        j1 = len(new_ids) if q1 == len(new_bytes) else new_index[q1]
        changed = list(old_ids[i0:i1]) != list(new_ids[j0:j1])
        segments.append(Segment(i0, i1, j0, j1, changed))
        if not changed:
            log_probs.extend(float(v) for v in old_log_probs[i0:i1])
            if new_versions is not None:
                new_versions.extend(versions[i0:i1])
            continue
        total = math.fsum(float(v) for v in old_log_probs[i0:i1])
        log_probs.extend([total / (j1 - j0)] * (j1 - j0))
        if new_versions is not None:
            new_versions.extend([min(versions[i0:i1])] * (j1 - j0))
    return Retokenized(list(new_ids), log_probs, new_versions, segments)


def retokenize(
    ids: Sequence[int],
    log_probs: Sequence[float],
    tokenizer: PreTrainedTokenizerBase,
    table: Sequence[bytes],
    weight_versions: Optional[Sequence[int]] = None,
) -> Retokenized:
    """A response decoded and encoded again (:func:`reencode`) with its log-probs and weight
    versions carried over (:func:`carry_log_probs`)."""
    return carry_log_probs(ids, log_probs, reencode(ids, tokenizer), table, weight_versions)
