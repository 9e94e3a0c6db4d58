"""Packing samples into THD micro-batches, the data-parallel split, and the context-parallel split.

No padding to the longest sample: the sequences of a micro-batch are concatenated into one row
(``[1, T]``, Megatron's ``qkv_format='thd'`` with ``cu_seqlens``). Each sequence is padded only to
the multiple that parallelism needs:

* context parallel ``cp > 1``: ``2 * cp`` (every sequence is cut into ``2 cp`` equal chunks, the
  zig-zag below), times ``tp`` under sequence parallel;
* sequence parallel alone: ``tp`` (the packed row is scattered over tp ranks in equal parts).

Padding tokens sit at the end of their sequence (causal attention never lets a real token see
them), carry label ``-1`` (ignored by the log-prob kernel) and are excluded from MoE load-balancing
statistics through ``padding_mask``. Their number is reported (``padding_tokens``).

Sequence ``i`` of ``L_i`` tokens runs ``L_i - 1`` positions: position ``t`` predicts token
``t + 1``, so response token ``j`` (token ``P + j``, ``P`` = prompt length) is predicted at
position ``P + j - 1``. The last token is never an input (R3 routes have ``L - 1`` rows).

Context-parallel layout (the one Transformer Engine's ``thd_get_partitioned_indices`` and
Megatron's ``_apply_rotary_pos_emb_thd`` use): a sequence of padded length ``p`` is cut into
``2 cp`` chunks of ``p / (2 cp)`` tokens; cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``,
in that order, sequence after sequence. :func:`split_for_context_parallel` applies it to ANY
per-token tensor (ids, labels, masks, log-probs, advantages, routes).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_LABEL = -1
"""Label of positions that predict nothing (padding, prompt positions are kept as real ids)."""


def padding_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """The multiple every packed sequence is padded to: ``2 cp`` (cp > 1) times ``tp`` (sp)."""
    multiple = 2 * cp if cp > 1 else 1
    return multiple * tp if sequence_parallel else multiple


def padded_length(length: int, multiple: int) -> int:
    return max(multiple, math.ceil(length / multiple) * multiple)


def context_parallel_indices(
    padded_lengths: Sequence[int], cp_size: int, cp_rank: int
) -> torch.Tensor:
    """``[sum(p_i) / cp]`` int64 positions of the packed row that cp rank ``cp_rank`` holds.

    For each sequence (offset ``o``, padded length ``p``, chunk ``c = p / (2 cp)``):
    ``o + [r c, (r + 1) c)`` then ``o + [(2 cp - 1 - r) c, (2 cp - r) c)``.
    """
    if cp_size == 1:
        return torch.arange(int(sum(padded_lengths)), dtype=torch.long)
    parts = []
    offset = 0
    for length in padded_lengths:
        if length % (2 * cp_size):
            raise ValueError(
                f"packed sequence length {length} is not a multiple of 2*cp={2 * cp_size}; pack "
                "with padding_multiple(tp, cp, sequence_parallel)"
            )
        chunk = length // (2 * cp_size)
        first = offset + cp_rank * chunk
        second = offset + (2 * cp_size - 1 - cp_rank) * chunk
        parts.append(torch.arange(first, first + chunk, dtype=torch.long))
        parts.append(torch.arange(second, second + chunk, dtype=torch.long))
        offset += length
    return torch.cat(parts)


def split_for_context_parallel(
    tensor: torch.Tensor,
    padded_lengths: Sequence[int],
    cp_size: int,
    cp_rank: int,
    dim: int = 0,
) -> torch.Tensor:
    """This cp rank's tokens of a packed per-token tensor (token axis ``dim``, length
    ``sum(p_i)``), in the zig-zag order of the module docstring."""
    if cp_size == 1:
        return tensor
    if tensor.shape[dim] != sum(padded_lengths):
        raise ValueError(
            f"tensor has {tensor.shape[dim]} tokens on dim {dim}, the packed row has "
            f"{sum(padded_lengths)}"
        )
    index = context_parallel_indices(padded_lengths, cp_size, cp_rank).to(tensor.device)
    return tensor.index_select(dim, index)


# ---------------------------------------------------------------------------------------------
# Data-parallel split and micro-batches
# ---------------------------------------------------------------------------------------------


def _balanced_bins(costs: Sequence[int], num_bins: int) -> list[list[int]]:
    """Longest-processing-time assignment of items to ``num_bins`` bins (deterministic)."""
    loads = [0] * num_bins
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for item in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(item)
        loads[target] += costs[item]
    return [sorted(items) for items in bins]


def plan_micro_batches(
    lengths: Sequence[int],
    dp_size: int,
    micro_batch_tokens: int,
    *,
    multiple: int = 1,
    per_rank_multiple: int = 1,
) -> list[list[list[int]]]:
    """Cut a mini-batch into ``dp_size x k`` token-balanced micro-batches.

    ``lengths[i]`` is sample ``i``'s number of input positions. Returns, per data-parallel rank,
    ``k`` micro-batches (lists of sample indices). ``k`` is the same on every rank (expert-parallel
    all-to-alls and the pipeline schedule need every rank to run the same number), a multiple of
    ``per_rank_multiple`` (the interleaved pipeline schedule needs a multiple of pp), and the
    smallest for which no micro-batch of two or more samples holds more than
    ``micro_batch_tokens`` packed tokens (lengths padded to ``multiple``); a longer sample gets a
    micro-batch of its own. A micro-batch may be empty when there are fewer samples than
    micro-batches.

    Samples are assigned by their unpadded lengths, so the grouping does not depend on the
    padding that tp/cp need; rank ``d`` takes micro-batches ``d, d + dp, ...`` of one global
    assignment, so ``dp=2, k=1`` and ``dp=1, k=2`` form the same micro-batches.
    """
    if dp_size < 1 or micro_batch_tokens < 1 or per_rank_multiple < 1:
        raise ValueError("dp_size, micro_batch_tokens and per_rank_multiple must be >= 1")
    packed = [padded_length(length, multiple) for length in lengths]
    per_rank = max(1, math.ceil(sum(packed) / (dp_size * micro_batch_tokens)))
    per_rank = math.ceil(per_rank / per_rank_multiple) * per_rank_multiple
    while True:
        bins = _balanced_bins(lengths, dp_size * per_rank)
        if all(
            len(items) <= 1 or sum(packed[i] for i in items) <= micro_batch_tokens for items in bins
        ):
            break
        per_rank += per_rank_multiple
    return [bins[rank::dp_size] for rank in range(dp_size)]


# ---------------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------------


@dataclass
class PackedSequences:
    """One packed micro-batch, already split for this context-parallel rank.

    ``T`` = sum of padded lengths (the full packed row), ``T_local = T / cp``.
    """

    input_ids: torch.Tensor
    """``[1, T_local]`` int64 input token ids (padding: 0)."""
    position_ids: torch.Tensor
    """``[1, T_local]`` int64 position of each token inside its sequence."""
    labels: torch.Tensor
    """``[T_local]`` int64 next-token ids; ``PAD_LABEL`` at padding and last positions."""
    padding_mask: torch.Tensor
    """``[1, T_local]`` bool, True at padding (Megatron's MoE ``padding_mask`` convention)."""
    cu_seqlens: torch.Tensor
    """``[S + 1]`` int32 cumulative real lengths (positions) of the S sequences, full row."""
    cu_seqlens_padded: torch.Tensor
    """``[S + 1]`` int32 cumulative padded lengths, full row."""
    lengths: list[int]
    padded_lengths: list[int]
    token_index: torch.Tensor
    """``[T_local]`` int64 position of each local token in the full packed row."""
    sequence_index: torch.Tensor
    """``[T_local]`` int64 sequence (0..S-1) of each local token; -1 at padding."""
    cp_size: int
    cp_rank: int

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        """Tokens of the full packed row (all cp ranks), padding included."""
        return int(sum(self.padded_lengths))

    @property
    def padding_tokens(self) -> int:
        return int(sum(self.padded_lengths) - sum(self.lengths))

    @property
    def max_length(self) -> int:
        return int(max(self.padded_lengths))

    def split(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This cp rank's part of a full-row per-token tensor (see module docstring)."""
        return split_for_context_parallel(
            tensor, self.padded_lengths, self.cp_size, self.cp_rank, dim
        )

    def full_row(self, per_sequence: Sequence[torch.Tensor], fill: float | int = 0) -> torch.Tensor:
        """Concatenate per-sequence position tensors (``[n_i, ...]`` with ``n_i <=`` the padded
        length) into the full packed row, filling the rest with ``fill``."""
        first = per_sequence[0]
        out = torch.full(
            (self.num_tokens, *first.shape[1:]), fill, dtype=first.dtype, device=first.device
        )
        offset = 0
        for values, length in zip(per_sequence, self.padded_lengths):
            out[offset : offset + values.shape[0]] = values
            offset += length
        return out


def full_row_positions(padded_lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``([T], [T])`` int64: the sequence of each position of the full packed row and its
    position inside that (padded) sequence, ``T = sum(padded_lengths)``."""
    padded = torch.tensor(padded_lengths, dtype=torch.long)
    sequence = torch.repeat_interleave(torch.arange(len(padded_lengths)), padded)
    starts = torch.tensor([0, *itertools.accumulate(padded_lengths)][:-1], dtype=torch.long)
    position = torch.arange(int(padded.sum())) - starts[sequence]
    return sequence, position


def pack_sequences(
    token_sequences: Sequence[torch.Tensor],
    *,
    multiple: int,
    cp_size: int = 1,
    cp_rank: int = 0,
) -> PackedSequences:
    """Pack token sequences (each ``[L_i]``, ``L_i >= 2``) into one THD row for this cp rank.

    Sequence ``i`` contributes ``L_i - 1`` input positions padded to a multiple of ``multiple``.
    """
    if not token_sequences:
        raise ValueError("cannot pack an empty list of sequences")
    lengths, padded = [], []
    for number, tokens in enumerate(token_sequences):
        if tokens.dim() != 1 or tokens.numel() < 2:
            raise ValueError(
                f"sequence {number} has shape {tuple(tokens.shape)}: a packed sample needs at "
                "least 2 tokens (a prompt token and a response token)"
            )
        lengths.append(int(tokens.numel()) - 1)
        padded.append(padded_length(lengths[-1], multiple))
    # Whole-row index arithmetic instead of a loop over sequences (a few ops, not ~12 per
    # sequence: per-op dispatch dominated packing at RL sizes).
    sequence, position = full_row_positions(padded)
    length_of = torch.tensor(lengths, dtype=torch.long)[sequence]
    real = position < length_of
    flat = torch.cat([tokens.long().cpu() for tokens in token_sequences])
    token_starts = torch.tensor([0, *itertools.accumulate(n + 1 for n in lengths)][:-1])
    source = torch.where(real, token_starts[sequence] + position, 0)
    input_ids = torch.where(real, flat[source], 0)
    labels = torch.where(real, flat[source + real.long()], PAD_LABEL)
    position_ids = position
    sequence_index = torch.where(real, sequence, -1)
    padding = sequence_index < 0
    token_index = context_parallel_indices(padded, cp_size, cp_rank)

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if cp_size == 1 else tensor.index_select(0, token_index)

    cumulative = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    cumulative_padded = torch.tensor([0, *itertools.accumulate(padded)], dtype=torch.int32)
    return PackedSequences(
        input_ids=local(input_ids).unsqueeze(0),
        position_ids=local(position_ids).unsqueeze(0),
        labels=local(labels),
        padding_mask=local(padding).unsqueeze(0),
        cu_seqlens=cumulative,
        cu_seqlens_padded=cumulative_padded,
        lengths=lengths,
        padded_lengths=padded,
        token_index=token_index,
        sequence_index=local(sequence_index),
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
