"""Retokenization's alignment (megatron_gspo/data/retokenization.py) on Qwen's real byte-level
BPE: token paths the engine could sample but the encoder would not write, found in the vocabulary
by the tests themselves; float64 log-probs, so the carried values are checked exactly."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from megatron_gspo.data.retokenization import (
    Segment,
    carry_log_probs,
    reencode,
    retokenize,
    token_byte_table,
)
from megatron_gspo.data.tokenizer import build_synthetic_tokenizer

TEXT = "Ana has 37 marbles and gets 5 more. How many marbles now?"


@pytest.fixture(scope="module")
def table(qwen_tokenizer) -> list[bytes]:
    return token_byte_table(qwen_tokenizer)


def _split_one_token(ids: list[int], table: list[bytes]) -> tuple[list[int], int]:
    """``ids`` with its first token of several bytes written as two tokens whose bytes join
    into it (a path the encoder never writes), and the position of that token."""
    index_of = {piece: token for token, piece in enumerate(table) if piece}
    for position, token in enumerate(ids):
        whole = table[token]
        for cut in range(1, len(whole)):
            left, right = index_of.get(whole[:cut]), index_of.get(whole[cut:])
            if left is not None and right is not None:
                return ids[:position] + [left, right] + ids[position + 1 :], position
    raise AssertionError("no token of the text splits into two tokens")


def test_byte_table_matches_the_tokenizer(qwen_tokenizer, table):
    ids = qwen_tokenizer.encode(TEXT + "<|im_end|>", add_special_tokens=False)
    assert b"".join(table[token] for token in ids) == (TEXT + "<|im_end|>").encode()
    assert table[151_645] == b"<|im_end|>"
    with pytest.raises(ValueError, match="not a byte-level BPE"):
        token_byte_table(build_synthetic_tokenizer())


def test_a_split_token_is_merged_and_its_log_probs_summed(qwen_tokenizer, table):
    canonical = qwen_tokenizer.encode(TEXT, add_special_tokens=False) + [151_645]
    path, position = _split_one_token(canonical, table)
    assert len(path) == len(canonical) + 1
    assert reencode(path, qwen_tokenizer) == canonical  # the harness writes the canonical path
    log_probs = list(np.random.default_rng(0).uniform(-6.0, -0.01, size=len(path)))
    result = retokenize(path, log_probs, qwen_tokenizer, table)
    assert result.ids == canonical and result.changed and result.changed_tokens == 1
    # Written out independently: tokens before the split keep their value, the merged token
    # gets the two halves' sum, the tokens after keep theirs one place earlier.
    expected = (
        log_probs[:position]
        + [log_probs[position] + log_probs[position + 1]]
        + log_probs[position + 2 :]
    )
    assert result.log_probs == pytest.approx(expected, rel=1e-15, abs=0)
    changed = [s for s in result.segments if s.changed]
    assert [(s.old_start, s.old_end, s.new_start, s.new_end) for s in changed] == [
        (position, position + 2, position, position + 1)
    ]


def test_a_merged_token_spreads_its_log_prob_and_sums_are_kept(qwen_tokenizer, table):
    # Tokens of the vocabulary that span a pre-tokenizer split (Qwen's ranks hold "<unk>",
    # "</s>"): the encoder never writes them, the engine can sample them.
    tags = (t for t, piece in enumerate(table) if re.fullmatch(rb"</?[a-z]+>?", piece))
    merged = next(t for t in tags if len(reencode([t], qwen_tokenizer)) > 1)
    split, _ = _split_one_token(qwen_tokenizer.encode(" apples", add_special_tokens=False), table)
    path = qwen_tokenizer.encode("Total", add_special_tokens=False) + [merged] + split + [151_645]
    log_probs = list(np.random.default_rng(1).uniform(-6.0, -0.01, size=len(path)))
    result = retokenize(path, log_probs, qwen_tokenizer, table, list(range(len(path))))
    assert result.ids == reencode(path, qwen_tokenizer)
    assert math.fsum(result.log_probs) == pytest.approx(math.fsum(log_probs), rel=1e-14)
    assert [s.old_end - s.old_start for s in result.segments if s.changed] == [1, 2]
    assert [s.new_end - s.new_start for s in result.segments if s.changed][1] == 1
    assert result.segments[-1] == Segment(
        len(path) - 1, len(path), len(result.ids) - 1, len(result.ids), changed=False
    )
    for segment in result.segments:
        old = math.fsum(log_probs[segment.old_start : segment.old_end])
        new = math.fsum(result.log_probs[segment.new_start : segment.new_end])
        assert new == pytest.approx(old, rel=1e-14)
        width = segment.new_end - segment.new_start
        if segment.changed:  # spread evenly; the oldest weight version of the segment
            values = result.log_probs[segment.new_start : segment.new_end]
            assert values == pytest.approx([old / width] * width, rel=1e-15)
            versions = result.weight_versions[segment.new_start : segment.new_end]
            assert versions == [segment.old_start] * width
        else:
            assert (
                result.log_probs[segment.new_start : segment.new_end]
                == (log_probs[segment.old_start : segment.old_end])
            )


def test_invalid_utf8_is_one_changed_segment_with_its_neighbours_kept(qwen_tokenizer, table):
    """Two lead bytes of a 3-byte character: decoded as U+FFFD, encoded as other bytes. The
    byte strings differ, and the pieces both sides share still align."""
    index_of = {piece: token for token, piece in enumerate(table) if piece}
    lead = index_of["好".encode()[:1]]
    head = qwen_tokenizer.encode("Hi ", add_special_tokens=False)
    tail = qwen_tokenizer.encode(" there", add_special_tokens=False) + [151_645]
    path = head + [lead, lead] + tail
    log_probs = [-0.5 * (index + 1) for index in range(len(path))]
    result = retokenize(path, log_probs, qwen_tokenizer, table)
    assert "\ufffd" in qwen_tokenizer.decode(result.ids)
    assert math.fsum(result.log_probs) == pytest.approx(math.fsum(log_probs), rel=1e-14)
    assert result.log_probs[-len(tail) :] == log_probs[-len(tail) :]
    assert result.ids[-len(tail) :] == tail


def test_identity_returns_the_input(qwen_tokenizer, table):
    ids = qwen_tokenizer.encode(TEXT, add_special_tokens=False) + [151_645]
    log_probs = [-0.1 - index / 7 for index in range(len(ids))]
    result = retokenize(ids, log_probs, qwen_tokenizer, table, [4] * len(ids))
    assert result.ids == ids and result.log_probs == log_probs and not result.changed
    assert result.weight_versions == [4] * len(ids) and result.changed_tokens == 0
    with pytest.raises(ValueError, match="log-probs for"):
        carry_log_probs(ids, log_probs[:-1], ids, table)


def test_an_id_past_the_tokenizer_is_dropped_and_its_log_prob_kept(qwen_tokenizer, table):
    """A padding row of the embedding (an untrained model samples them) has no text: the
    harness drops it, and its log-prob goes to the segment after it."""
    ids = qwen_tokenizer.encode(TEXT, add_special_tokens=False)
    path = ids[:3] + [151_900] + ids[3:]
    log_probs = [-1.0 - index for index in range(len(path))]
    result = retokenize(path, log_probs, qwen_tokenizer, table)
    assert result.ids == ids
    assert result.log_probs == log_probs[:3] + [log_probs[3] + log_probs[4]] + log_probs[5:]
