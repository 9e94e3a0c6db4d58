"""Core attention for CPU runs: packed (THD) sequences and context parallel.

Megatron's local ``DotProductAttention`` rejects packed sequences and context parallel (both are
left to Transformer Engine, which is GPU-only). :class:`PackedCoreAttention` takes its place in the
local layer spec (``self_attention.submodules.core_attention``) and computes, per packed sequence,

    out_t = sum_{s <= t, same sequence} softmax_s(q_t . k_s * scale) v_s

(block-diagonal causal attention; grouped-query heads share key/value heads). Padding tokens sit at
the end of their sequence, so causality alone keeps them out of every real token's context.

Context parallel: each cp rank holds two zig-zag chunks of every sequence
(:mod:`megatron_gspo.engine.packing`). Keys and values are all-gathered over the cp group
(differentiable: the backward sums every rank's key/value gradients and keeps this rank's part),
reordered into full sequences, and the local queries attend with the causal mask taken on global
positions. Memory is ``O(p_i^2 / cp)`` per sequence; this is the CPU/test path, GPU runs use
Transformer Engine's attention.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule

from megatron_gspo.engine.packing import context_parallel_indices


class _AllGatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: all-reduce SUM, keep this rank's rows."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.rows = tensor.shape[0]
        world = dist.get_world_size(group)
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[rank * ctx.rows : (rank + 1) * ctx.rows], None


def gather_context_parallel_tokens(
    local: torch.Tensor, padded_lengths: list[int], cp_group: dist.ProcessGroup
) -> torch.Tensor:
    """Full packed row ``[T, ...]`` from every cp rank's zig-zag part ``[T / cp, ...]``."""
    cp_size = dist.get_world_size(cp_group)
    gathered = _AllGatherTokens.apply(local, cp_group)
    order = torch.cat(
        [context_parallel_indices(padded_lengths, cp_size, rank) for rank in range(cp_size)]
    ).to(local.device)
    # gathered[k] is the token at full-row position order[k]; invert the permutation.
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return gathered.index_select(0, inverse)


class PackedCoreAttention(MegatronModule):
    """Drop-in ``core_attention`` for the local spec: THD packing and context parallel on CPU.

    Same constructor and forward signature as Megatron's ``DotProductAttention``. Inputs are
    ``[t, heads, dim]`` (THD, from ``SelfAttention`` with ``qkv_format='thd'``) or
    ``[s, b, heads, dim]`` (one causal sequence per batch column, cp = 1 only); output is
    ``[t, heads * dim]`` or ``[s, b, heads * dim]``. No dropout (``attention_dropout`` must be 0).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"PackedCoreAttention has no dropout, got attention_dropout={dropout}; set "
                "attention_dropout=0 (RL fine-tuning runs without it)"
            )
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("PackedCoreAttention supports vanilla softmax without sliding window")
        # MLA passes its query/key and value widths (k_channels, v_channels) and its softmax
        # scale (with YaRN's mscale); the widths are read from the tensors in forward.
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling is not supported (fp32/bf16 only)")
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is None:
            from megatron.core import parallel_state

            self.cp_group = parallel_state.get_context_parallel_group()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("PackedCoreAttention does not support attention_bias")
        cp_size = dist.get_world_size(self.cp_group)
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            if cp_size > 1:
                raise ValueError(
                    "context parallel on CPU needs packed (THD) sequences: pass PackedSeqParams"
                )
            # [s, b, h, d] -> [b, h, s, d]; one causal sequence per batch column.
            out = _attention(
                query.permute(1, 2, 0, 3),
                key.permute(1, 2, 0, 3),
                value.permute(1, 2, 0, 3),
                None,
                self.softmax_scale,
            )
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

        cu_padded = packed_seq_params.cu_seqlens_q_padded
        if cu_padded is None:
            cu_padded = packed_seq_params.cu_seqlens_q
        padded_lengths = (cu_padded[1:] - cu_padded[:-1]).tolist()
        if cp_size > 1:
            key = gather_context_parallel_tokens(key, padded_lengths, self.cp_group)
            value = gather_context_parallel_tokens(value, padded_lengths, self.cp_group)
        cp_rank = dist.get_rank(self.cp_group) if cp_size > 1 else 0
        # One SDPA call per distinct padded length (RL batches are mostly one length): the
        # sequences of a length are stacked as the batch dimension, whose mask is shared.
        by_length: dict[int, list[int]] = {}
        for index, length in enumerate(padded_lengths):
            by_length.setdefault(length, []).append(index)
        heads, dim = query.shape[1], query.shape[2]
        # MLA: values are narrower than queries and keys (v_head_dim).
        value_dim = value.shape[-1]
        local_starts = [0]
        full_starts = [0]
        for length in padded_lengths:
            local_starts.append(local_starts[-1] + length // cp_size)
            full_starts.append(full_starts[-1] + length)
        output = None
        for length, indices in by_length.items():
            local_length = length // cp_size
            if len(by_length) == 1:
                q, k, v = (
                    query.reshape(len(indices), local_length, heads, dim),
                    key.reshape(len(indices), length, *key.shape[1:]),
                    value.reshape(len(indices), length, *value.shape[1:]),
                )
            else:
                local_rows = _rows(local_starts, indices, local_length, query.device)
                full_rows = _rows(full_starts, indices, length, query.device)
                q = query[local_rows]
                k = key[full_rows]
                v = value[full_rows]
            if cp_size == 1:
                mask = None
            else:
                # Global positions of this rank's two chunks inside the sequence.
                positions = context_parallel_indices([length], cp_size, cp_rank).to(q.device)
                keys = torch.arange(length, device=q.device)
                mask = keys.unsqueeze(0) <= positions.unsqueeze(1)
            # [n, s, heads, d] -> [n, heads, s, d] and back.
            out = _attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.softmax_scale
            ).transpose(1, 2)
            if len(by_length) == 1:
                return out.reshape(query.shape[0], heads * value_dim)
            if output is None:
                output = query.new_zeros(query.shape[0], heads * value_dim)
            output = output.index_copy(0, local_rows.flatten(), out.reshape(-1, heads * value_dim))
        return output


def _rows(starts: list[int], indices: list[int], length: int, device: torch.device) -> torch.Tensor:
    """``[n, length]`` row indices of sequences ``indices`` whose first rows are ``starts``."""
    first = torch.tensor([starts[i] for i in indices], device=device)
    return first.unsqueeze(1) + torch.arange(length, device=device)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Causal (or ``mask``ed, True = attend) attention on ``[b, heads, s, d]``; grouped-query
    heads share key/value heads (``enable_gqa``)."""
    gqa = key.shape[1] != query.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=gqa
        )
    return F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa
    )
