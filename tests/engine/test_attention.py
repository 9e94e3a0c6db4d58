"""PackedCoreAttention (the CPU core attention for packed sequences) against a float64 reference.

The reference is written independently: per sequence, explicit causal softmax with grouped-query
heads expanded by indexing. Covers one padded length for the whole row (one batched SDPA call)
and mixed lengths (one call per length, rows gathered and scattered back), outputs and the
gradients of query, key and value. Context parallel is covered by the layout tests
(``test_layouts.py``: cp2 reproduces the one-process loss and gradients).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_gspo.engine.attention import PackedCoreAttention

HEADS, KV_HEADS, DIM = 4, 2, 16


@pytest.fixture(scope="module")
def single_process_group(tmp_path_factory):
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    store = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def reference_attention(query, key, value, lengths):
    """float64 causal attention per sequence; query head h reads kv head h // (HEADS/KV)."""
    outputs = []
    start = 0
    group = HEADS // KV_HEADS
    for length in lengths:
        q = query[start : start + length].double()  # [s, heads, d]
        k = key[start : start + length].double()[:, torch.arange(HEADS) // group]
        v = value[start : start + length].double()[:, torch.arange(HEADS) // group]
        scores = torch.einsum("shd,thd->hst", q, k) / math.sqrt(DIM)
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.einsum("hst,thd->shd", scores.softmax(-1), v)
        outputs.append(out.reshape(length, HEADS * DIM))
        start += length
    return torch.cat(outputs)


@pytest.mark.parametrize(
    "lengths", [[8, 8, 8], [8, 12, 8, 4, 12], [5]], ids=["one-length", "mixed", "single"]
)
def test_packed_attention_matches_float64_reference(single_process_group, lengths):
    config = TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=KV_HEADS,
        kv_channels=DIM,
        attention_dropout=0.0,
    )
    attention = PackedCoreAttention(
        config, 1, None, "self", pg_collection=ProcessGroupCollection(cp=single_process_group)
    )
    generator = torch.Generator().manual_seed(len(lengths))
    total = sum(lengths)
    query = torch.randn(total, HEADS, DIM, generator=generator, requires_grad=True)
    key = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    value = torch.randn(total, KV_HEADS, DIM, generator=generator, requires_grad=True)
    weights = torch.randn(total, HEADS * DIM, generator=generator, dtype=torch.float64)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(lengths),
        max_seqlen_kv=max(lengths),
    )

    output = attention(query, key, value, None, packed_seq_params=params)
    gradients = torch.autograd.grad((output.double() * weights).sum(), (query, key, value))
    expected = reference_attention(query, key, value, lengths)
    expected_gradients = torch.autograd.grad((expected * weights).sum(), (query, key, value))

    assert output.shape == (total, HEADS * DIM)
    torch.testing.assert_close(output.double(), expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(gradients, expected_gradients):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-5, atol=1e-5)
