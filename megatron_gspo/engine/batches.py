"""From a mini-batch of :class:`~megatron_gspo.samples.TrainSample` to this rank's micro-batches.

Every rank receives the same full mini-batch. :func:`plan_mini_batch` cuts it, identically on every
rank, into ``dp x k`` token-balanced micro-batches; :func:`build_micro_batches` packs this
data-parallel rank's ``k`` of them (split for its context-parallel rank) together with the
per-sample loss inputs as padded ``[B, R_max]`` tensors. :func:`global_denominators` computes
the loss normalisers from the FULL mini-batch, so they are exact and equal on every rank.

Shapes: ``B`` samples of the micro-batch, ``R_max`` their longest response, ``N`` response
positions held by this cp rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_gspo.engine.packing import (
    PackedSequences,
    full_row_positions,
    pack_sequences,
    plan_micro_batches,
)
from megatron_gspo.samples import TrainSample


@dataclass
class GlobalDenominators:
    """Loss normalisers of one optimizer step, from the whole mini-batch."""

    num_sequences: float
    """Sequences with at least one loss token (at least 1)."""
    num_tokens: float
    """Loss tokens (at least 1)."""
    lengths: torch.Tensor
    """``[num_samples]`` float32 loss tokens per sample (``n_i``)."""


def _loss_tokens(sample: TrainSample) -> float:
    if sample.loss_mask is None:  # every response token counts: no tensor to build and sum
        return float(sample.response_length)
    return float(sample.loss_mask.bool().sum())


def global_denominators(samples: Sequence[TrainSample]) -> GlobalDenominators:
    lengths = torch.tensor([_loss_tokens(s) for s in samples], dtype=torch.float32)
    return GlobalDenominators(
        num_sequences=max(1.0, float((lengths > 0).sum())),
        num_tokens=max(1.0, float(lengths.sum())),
        lengths=lengths,
    )


def validate_samples(
    samples: Sequence[TrainSample],
    *,
    need_old: bool,
    need_advantages: bool,
    need_ref: bool,
    need_behaviour: bool = False,
) -> None:
    """Fail with the sample index and the field when a sample cannot be trained on."""
    if not samples:
        raise ValueError("empty mini-batch: train_step needs at least one sample")
    for index, sample in enumerate(samples):
        where = f"sample {index} (group {sample.group_id})"
        tokens = sample.tokens
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(f"{where}: tokens must be a 1-D integer tensor, got {tokens!r:.80}")
        if sample.prompt_length < 1 or sample.response_length < 1:
            raise ValueError(
                f"{where}: prompt_length={sample.prompt_length}, response_length="
                f"{sample.response_length}; a trained sample needs >= 1 prompt and >= 1 response "
                "token"
            )
        response = sample.response_length
        per_token = {"loss_mask": sample.loss_mask}
        if need_behaviour:
            per_token["rollout_log_probs"] = sample.rollout_log_probs
        if need_old:
            per_token["old_log_probs"] = sample.old_log_probs
        if need_ref:
            per_token["ref_log_probs"] = sample.ref_log_probs
        for name, value in per_token.items():
            if value is None:
                if name == "loss_mask":
                    continue
                raise ValueError(f"{where}: {name} is missing (needed by the configured algorithm)")
            if tuple(value.shape) != (response,):
                raise ValueError(
                    f"{where}: {name} has shape {tuple(value.shape)}, expected ({response},) "
                    "(one entry per response token)"
                )
        if need_advantages:
            advantages = sample.advantages
            if advantages is None:
                raise ValueError(f"{where}: advantages are missing (compute_advantages first)")
            if advantages.dim() not in (0, 1) or (
                advantages.dim() == 1 and advantages.shape[0] != response
            ):
                raise ValueError(
                    f"{where}: advantages have shape {tuple(advantages.shape)}, expected () or "
                    f"({response},)"
                )


def plan_mini_batch(
    samples: Sequence[TrainSample],
    *,
    dp_size: int,
    micro_batch_tokens: int,
    multiple: int,
    micro_batches_multiple: int = 1,
) -> list[list[list[int]]]:
    """Per data-parallel rank, ``k`` micro-batches of sample indices (see
    :func:`~megatron_gspo.engine.packing.plan_micro_batches`); ``k`` is rounded up to a multiple
    of ``micro_batches_multiple`` (the interleaved pipeline schedule needs a multiple of pp)."""
    lengths = [int(s.tokens.numel()) - 1 for s in samples]
    return plan_micro_batches(
        lengths,
        dp_size,
        micro_batch_tokens,
        multiple=multiple,
        per_rank_multiple=micro_batches_multiple,
    )


@dataclass
class MicroBatch:
    """One packed micro-batch of this rank and the loss inputs of its samples."""

    packed: PackedSequences
    sample_indices: list[int]
    """Indices into the mini-batch (empty for a filler micro-batch)."""
    response_rows: torch.Tensor
    """``[N]`` local token positions whose label is a response token."""
    response_sample: torch.Tensor
    """``[N]`` row ``b`` (0..B-1) of each of those positions."""
    response_index: torch.Tensor
    """``[N]`` response-token index ``j`` of each of those positions."""
    labels: torch.Tensor
    """``[N]`` the predicted (response) token ids."""
    response_lengths: list[int]
    """``[B]`` response lengths ``R_b``."""
    local_mask: torch.Tensor
    """``[B, R_max]`` bool: loss tokens held by this cp rank."""
    lengths: torch.Tensor
    """``[B]`` global loss-token counts ``n_b``."""
    old_log_probs: Optional[torch.Tensor]
    """``[B, R_max]`` float32 (zeros at padding)."""
    advantages: Optional[torch.Tensor]
    """``[B]`` or ``[B, R_max]`` float32."""
    ref_log_probs: Optional[torch.Tensor]
    """``[B, R_max]`` float32."""
    behaviour_log_probs: Optional[torch.Tensor] = None
    """``[B, R_max]`` float32 rollout log-probs ``mu`` (zeros at padding), when a rollout
    correction needs them."""
    routes: Optional[Any] = None
    """This rank's routes of the micro-batch (a :class:`~megatron_gspo.engine.routing_replay.
    MicroBatchRoutes`, set by the routing pass of a MoE forward), else None."""

    @property
    def num_samples(self) -> int:
        return len(self.response_lengths)

    @property
    def max_response(self) -> int:
        return max(self.response_lengths)

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``[N]`` per-position values -> ``[B, R_max]`` (zeros where this rank holds none);
        differentiable."""
        out = values.new_zeros((self.num_samples, self.max_response))
        return out.index_put((self.response_sample, self.response_index), values)


def _padded_rows(values: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[B, width]`` float32: row ``b`` is ``values[b]`` (``[n_b]``, ``n_b <= width``) then
    zeros. One padding op for the batch, not one copy per row."""
    out = torch.nn.utils.rnn.pad_sequence([value.float() for value in values], batch_first=True)
    if out.shape[1] < width:
        out = torch.nn.functional.pad(out, (0, width - out.shape[1]))
    return out


def build_micro_batches(
    samples: Sequence[TrainSample],
    bins: Sequence[Sequence[int]],
    *,
    lengths: torch.Tensor,
    multiple: int,
    cp_size: int,
    cp_rank: int,
    with_loss_inputs: bool = True,
    with_ref: bool = False,
    with_behaviour: bool = False,
) -> list[MicroBatch]:
    """Pack this rank's bins. An empty bin becomes a filler micro-batch (one padding-only
    sequence, no loss token) so that every rank runs the same schedule."""
    micro_batches = []
    for indices in bins:
        filler = not indices
        if filler:
            chosen = [
                TrainSample(
                    tokens=torch.zeros(2, dtype=torch.long),
                    prompt_length=1,
                    advantages=torch.zeros(()),
                    loss_mask=torch.zeros(1, dtype=torch.bool),
                    old_log_probs=torch.zeros(1),
                    ref_log_probs=torch.zeros(1),
                    rollout_log_probs=torch.zeros(1),
                )
            ]
            chosen_lengths = torch.zeros(1)
        else:
            chosen = [samples[i] for i in indices]
            chosen_lengths = lengths[list(indices)]
        packed = pack_sequences(
            [s.tokens for s in chosen], multiple=multiple, cp_size=cp_size, cp_rank=cp_rank
        )
        response_lengths = [s.response_length for s in chosen]
        width = max(response_lengths)
        # Full-row maps: position P_b - 1 + j of sequence b predicts response token j, for
        # 0 <= j < R_b (the last of which is the sequence's last input position, L_b - 2).
        sequence, position = full_row_positions(packed.padded_lengths)
        first = torch.tensor([s.prompt_length - 1 for s in chosen], dtype=torch.long)[sequence]
        index_map = position - first
        responding = (index_map >= 0) & (position < torch.tensor(packed.lengths)[sequence])
        sample_map = torch.where(responding, sequence, -1)
        index_map = torch.where(responding, index_map, -1)
        local_sample = packed.split(sample_map)
        local_index = packed.split(index_map)
        rows = torch.nonzero(local_index >= 0).squeeze(1)
        response_sample = local_sample[rows]
        response_index = local_index[rows]
        held = torch.zeros((len(chosen), width), dtype=torch.bool)
        held[response_sample, response_index] = True
        if all(s.loss_mask is None for s in chosen):
            mask = held  # every response token counts, and held lies inside the responses
        else:
            mask = _padded_rows([s.response_mask() for s in chosen], width).bool() & held
        old = advantages = ref = behaviour = None
        if with_loss_inputs:
            old = _padded_rows(
                [
                    s.old_log_probs if s.old_log_probs is not None else torch.zeros(0)
                    for s in chosen
                ],
                width,
            )
            per_token = any(s.advantages.dim() == 1 for s in chosen)
            if per_token:
                advantages = _padded_rows(
                    [s.advantages.expand(s.response_length) for s in chosen], width
                )
            else:
                advantages = torch.stack([s.advantages.float() for s in chosen])
            if with_ref:
                ref = _padded_rows([s.ref_log_probs for s in chosen], width)
            if with_behaviour:
                behaviour = _padded_rows([s.rollout_log_probs for s in chosen], width)
        micro_batches.append(
            MicroBatch(
                packed=packed,
                sample_indices=[] if filler else list(indices),
                response_rows=rows,
                response_sample=response_sample,
                response_index=response_index,
                labels=packed.labels[rows],
                response_lengths=response_lengths,
                local_mask=mask,
                lengths=chosen_lengths.float(),
                old_log_probs=old,
                advantages=advantages,
                ref_log_probs=ref,
                behaviour_log_probs=behaviour,
            )
        )
    return micro_batches
