"""THD packing, the context-parallel zig-zag split and the data-parallel micro-batch plan."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.engine.batches import build_micro_batches, global_denominators
from megatron_gspo.engine.packing import (
    PAD_LABEL,
    context_parallel_indices,
    pack_sequences,
    padding_multiple,
    plan_micro_batches,
    split_for_context_parallel,
)
from megatron_gspo.samples import TrainSample


def test_padding_multiple():
    assert padding_multiple(tp=1, cp=1, sequence_parallel=False) == 1
    assert padding_multiple(tp=2, cp=1, sequence_parallel=True) == 2
    assert padding_multiple(tp=1, cp=2, sequence_parallel=False) == 4
    assert padding_multiple(tp=2, cp=2, sequence_parallel=True) == 8


def _naive_zigzag(lengths, cp, rank):
    """Chunks r and 2cp-1-r of every sequence, as TE's thd_get_partitioned_indices."""
    out, offset = [], 0
    for length in lengths:
        chunks = torch.arange(offset, offset + length).chunk(2 * cp)
        out += [chunks[rank], chunks[2 * cp - 1 - rank]]
        offset += length
    return torch.cat(out)


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_context_parallel_indices_are_the_zigzag_and_partition_the_row(cp):
    lengths = [2 * cp * k for k in (1, 3, 2)]
    seen = []
    for rank in range(cp):
        index = context_parallel_indices(lengths, cp, rank)
        assert torch.equal(index, _naive_zigzag(lengths, cp, rank))
        seen.append(index)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(sum(lengths)))


def test_split_applies_to_any_per_token_tensor():
    lengths = [8, 4]
    routes = torch.arange(12 * 3 * 2).reshape(12, 3, 2)  # [tokens, layers, k]
    local = split_for_context_parallel(routes, lengths, cp_size=2, cp_rank=1)
    assert torch.equal(local, routes[_naive_zigzag(lengths, 2, 1)])
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        context_parallel_indices([6], 2, 0)


def test_pack_sequences_next_token_labels_and_padding():
    a, b = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10])
    packed = pack_sequences([a, b], multiple=4)
    assert packed.lengths == [3, 1] and packed.padded_lengths == [4, 4]
    assert packed.padding_tokens == 4
    assert packed.input_ids.tolist() == [[5, 6, 7, 0, 9, 0, 0, 0]]
    assert packed.labels.tolist() == [6, 7, 8, PAD_LABEL, 10, PAD_LABEL, PAD_LABEL, PAD_LABEL]
    assert packed.padding_mask.tolist() == [[False, False, False, True, False, True, True, True]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4]
    assert packed.cu_seqlens_padded.tolist() == [0, 4, 8]
    with pytest.raises(ValueError, match="at least 2 tokens"):
        pack_sequences([torch.tensor([1])], multiple=1)


def test_pack_sequences_context_parallel_split_matches_full_row():
    sequences = [torch.arange(10, 19), torch.arange(30, 35)]
    full = pack_sequences(sequences, multiple=4)
    for rank in range(2):
        local = pack_sequences(sequences, multiple=4, cp_size=2, cp_rank=rank)
        index = context_parallel_indices(full.padded_lengths, 2, rank)
        assert torch.equal(local.input_ids[0], full.input_ids[0][index])
        assert torch.equal(local.labels, full.labels[index])
        assert torch.equal(local.token_index, index)


def test_plan_is_balanced_equal_per_rank_and_layout_independent():
    lengths = [30, 5, 12, 12, 7, 25, 3, 9]
    plan = plan_micro_batches(lengths, dp_size=2, micro_batch_tokens=40)
    assert len({len(rank) for rank in plan}) == 1
    assigned = sorted(i for rank in plan for mb in rank for i in mb)
    assert assigned == list(range(len(lengths)))
    for rank in plan:
        for micro_batch in rank:
            assert len(micro_batch) <= 1 or sum(lengths[i] for i in micro_batch) <= 40
    loads = [sum(lengths[i] for mb in rank for i in mb) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)
    # dp=2 with one micro-batch each forms the same groups as dp=1 with two.
    two_ranks = plan_micro_batches(lengths, dp_size=2, micro_batch_tokens=60)
    one_rank = plan_micro_batches(lengths, dp_size=1, micro_batch_tokens=60)
    assert sorted(two_ranks[0] + two_ranks[1]) == sorted(one_rank[0])
    # Padding for tp/cp does not change the grouping while the budget allows it.
    assert plan_micro_batches(lengths, 1, 60, multiple=4) == one_rank


def test_plan_gives_an_over_long_sample_its_own_micro_batch_and_rounds_k():
    plan = plan_micro_batches([100, 3, 4], dp_size=1, micro_batch_tokens=10)
    assert [0] in plan[0]
    plan = plan_micro_batches([3, 4, 5], dp_size=1, micro_batch_tokens=100, per_rank_multiple=2)
    assert len(plan[0]) == 2


def _sample(tokens, prompt, mask=None):
    response = len(tokens) - prompt
    return TrainSample(
        tokens=torch.tensor(tokens),
        prompt_length=prompt,
        advantages=torch.tensor(1.0),
        loss_mask=mask,
        old_log_probs=torch.arange(response, dtype=torch.float32),
    )


@pytest.mark.parametrize("cp", [1, 2])
def test_micro_batch_maps_response_positions_to_their_labels(cp):
    samples = [
        _sample([1, 2, 3, 4, 5, 6], 2, torch.tensor([True, False, True, True])),
        _sample([7, 8, 9], 1),
    ]
    denominators = global_denominators(samples)
    assert denominators.num_tokens == 5 and denominators.num_sequences == 2
    held = torch.zeros(2, 4, dtype=torch.bool)
    for rank in range(cp):
        (micro_batch,) = build_micro_batches(
            samples,
            [[0, 1]],
            lengths=denominators.lengths,
            multiple=2 * cp,
            cp_size=cp,
            cp_rank=rank,
        )
        for row, index, label in zip(
            micro_batch.response_sample, micro_batch.response_index, micro_batch.labels
        ):
            sample = samples[row]
            assert label == sample.tokens[sample.prompt_length + index]
        unpacked = micro_batch.unpack(micro_batch.labels.float())
        assert unpacked.shape == (2, 4)
        held |= micro_batch.local_mask
        assert micro_batch.old_log_probs[0].tolist() == [0, 1, 2, 3]
    # Every loss token is held by exactly one cp rank; masked tokens by none.
    assert held.tolist() == [[True, False, True, True], [True, True, False, False]]


def test_empty_bin_becomes_a_filler_micro_batch_without_loss_tokens():
    samples = [_sample([1, 2, 3], 1)]
    denominators = global_denominators(samples)
    filler, real = build_micro_batches(
        samples, [[], [0]], lengths=denominators.lengths, multiple=1, cp_size=1, cp_rank=0
    )
    assert filler.sample_indices == [] and not filler.local_mask.any()
    assert real.sample_indices == [0] and real.local_mask.all()
