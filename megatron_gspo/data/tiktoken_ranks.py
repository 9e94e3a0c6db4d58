"""A Hugging Face tokenizer built from a tiktoken rank file (a byte-level BPE vocabulary).

A tiktoken rank file has one line per token, ``base64(token bytes) rank``; a token's rank is both
its id and its merge priority (tiktoken merges the adjacent pair whose concatenation has the lowest
rank). The same BPE runs in ``tokenizers`` with:

- the vocabulary: each token's bytes written in GPT-2's byte-to-character alphabet, id = rank;
- the merges: for each token, every split into two pieces that are themselves tokens, ordered by
  the merged token's rank (ties by the pieces' ranks), so a merge's priority is the rank of what
  it makes, as in tiktoken;
- ``ignore_merges``: a pre-token that is itself in the vocabulary is one token, as in tiktoken;
- the pre-tokenizer: tiktoken's split pattern, then the byte-to-character mapping.

Qwen's vocabulary (151,643 ranks, shared by Qwen2, Qwen2.5 and Qwen3) is the one the tests use
(``docs/sglang-protocol.md``, section 8); its split pattern and special tokens are
:data:`QWEN_SPLIT_PATTERN` and :data:`QWEN_SPECIAL_TOKENS`. Qwen's tiktoken encoder normalises
text to NFC first, so the built tokenizer does too.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from megatron_gspo.data.tokenizer import CHATML_TEMPLATE, IM_END, IM_START

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Qwen's pre-tokenizer: contractions, letter runs (with one leading non-letter), single digits
# (so every number is tokenized digit by digit), punctuation runs, newlines, other whitespace.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ENDOFTEXT = "<|endoftext|>"
QWEN_SPECIAL_TOKENS = (
    ENDOFTEXT,  # 151643: end of a document; Qwen's pad token
    IM_START,  # 151644: a ChatML turn starts
    IM_END,  # 151645: a ChatML turn ends (the chat models' EOS)
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",  # 151657
    "</tool_call>",  # 151658
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",  # 151664
)
"""Qwen2.5's and Qwen3's added tokens from id 151,643 on, in id order (the ids are the order)."""
QWEN_ADDED_TEXT_TOKENS = ("<tool_response>", "</tool_response>", "<think>", "</think>")
"""Qwen3's added tokens 151,665-151,668: single tokens that decoding keeps (not special)."""
QWEN_NUM_RANKS = 151_643


def read_tiktoken_ranks(path: Union[str, Path]) -> dict[bytes, int]:
    """``token bytes -> rank`` of a tiktoken rank file; ValueError for a malformed line or ranks
    that are not 0, 1, ..., n - 1 (ids must be dense to become a vocabulary)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as error:
                raise ValueError(f"{path}:{line_number}: not 'base64 rank' ({error})") from error
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: the ranks are not 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def _bpe_vocab_and_merges(
    ranks: dict[bytes, int],
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    from tokenizers.pre_tokenizers import ByteLevel

    # GPT-2's byte -> printable character table, the alphabet byte-level BPE files are written in.
    alphabet = ByteLevel.alphabet()
    printable = [b for b in range(256) if chr(b) in alphabet]
    byte_to_character = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in byte_to_character]
    byte_to_character.update({b: chr(256 + index) for index, b in enumerate(others)})

    def as_text(token: bytes) -> str:
        return "".join(byte_to_character[b] for b in token)

    vocab = {as_text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    return vocab, [(as_text(left), as_text(right)) for *_, left, right in merges]


def build_tiktoken_tokenizer(
    rank_file: Union[str, Path],
    *,
    split_pattern: str = QWEN_SPLIT_PATTERN,
    special_tokens: Sequence[str] = QWEN_SPECIAL_TOKENS,
    added_text_tokens: Sequence[str] = QWEN_ADDED_TEXT_TOKENS,
    eos_token: str = IM_END,
    pad_token: str = ENDOFTEXT,
    chat_template: Optional[str] = CHATML_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer of a tiktoken rank file (module docstring), with
    ``special_tokens`` then ``added_text_tokens`` at the ids after the last rank, in order, and a
    ChatML chat template. The defaults give Qwen3's tokenizer (151,669 tokens) for Qwen's rank
    file; ``save_pretrained`` writes a directory that ``AutoTokenizer`` and SGLang load."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from transformers import PreTrainedTokenizerFast

    ranks = read_tiktoken_ranks(rank_file)
    vocab, merges = _bpe_vocab_and_merges(ranks)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Added one by one: each call gives the next free id, so the order fixes the ids.
    for token in special_tokens:
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    for token in added_text_tokens:
        backend.add_tokens([AddedToken(token, special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=eos_token, pad_token=pad_token
    )
    tokenizer.chat_template = chat_template
    # Ids are the contract with the model's embedding: check them rather than trust the order.
    for offset, token in enumerate([*special_tokens, *added_text_tokens]):
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != len(ranks) + offset:
            raise RuntimeError(f"{token!r} got id {actual}, expected {len(ranks) + offset}")
    return tokenizer
