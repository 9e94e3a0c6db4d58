"""One tp rank of the vocab-parallel log-prob test (launched twice by test_logprobs.py).

Every rank builds the same full inputs from one seed, keeps its rows of the output weight, and
saves to ``<out>/rank<r>.pt``, per case: the tp result (log-probs, entropy, the hidden gradient
through Megatron's ``copy_to_tensor_model_parallel_region``, the raw partial hidden gradient summed
over tp by hand, the weight-shard gradient) and the one-process result on the full weight.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

from megatron_gspo.engine.logprobs import vocab_parallel_log_probs

# (name, tokens, hidden, padded vocab, true vocab, temperature, chunk size)
CASES = [
    ("plain", 13, 8, 24, None, 0.8, 5),
    ("padded_vocab", 11, 8, 24, 20, 1.0, 4),
    # V_local = 12 and vocab 11: the second shard is all padding.
    ("empty_shard", 9, 8, 24, 11, 1.3, 16),
]


def make_inputs(
    tokens: int, hidden_size: int, padded_vocab: int, vocab_size: int | None, seed: int
):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    weight = torch.randn(padded_vocab, hidden_size, generator=generator) / hidden_size**0.5
    labels = torch.randint(0, vocab_size or padded_vocab, (tokens,), generator=generator)
    labels[1] = -100
    grad_log_probs = torch.randn(tokens, generator=generator)
    grad_entropy = torch.randn(tokens, generator=generator)
    return hidden, weight, labels, grad_log_probs, grad_entropy


def run_case(case, group, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    name, tokens, hidden_size, padded_vocab, vocab_size, temperature, chunk_size = case
    hidden_full, weight_full, labels, grad_lp, grad_ent = make_inputs(
        tokens, hidden_size, padded_vocab, vocab_size, seed=len(name)
    )
    local_vocab = padded_vocab // world_size
    options = dict(
        temperature=temperature, chunk_size=chunk_size, with_entropy=True, vocab_size=vocab_size
    )
    result = {}

    # One process, full weight.
    hidden = hidden_full.clone().requires_grad_()
    weight = weight_full.clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(hidden, weight, labels, tp_group=None, **options)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    result.update(
        tp1_log_probs=log_probs.detach(),
        tp1_entropy=entropy.detach(),
        tp1_grad_hidden=hidden.grad,
        tp1_grad_weight=weight.grad[rank * local_vocab : (rank + 1) * local_vocab],
    )

    shard = weight_full[rank * local_vocab : (rank + 1) * local_vocab]

    # tp, caller reduces hidden grads the Megatron way (no sequence parallel).
    hidden = hidden_full.clone().requires_grad_()
    weight = shard.clone().requires_grad_()
    region_hidden = copy_to_tensor_model_parallel_region(hidden, group=group)
    log_probs, entropy = vocab_parallel_log_probs(
        region_hidden, weight, labels, tp_group=group, **options
    )
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    result.update(
        tp_log_probs=log_probs.detach(),
        tp_entropy=entropy.detach(),
        tp_grad_hidden=hidden.grad,
        tp_grad_weight=weight.grad,
    )

    # tp, raw call: the hidden gradient is this shard's partial; its tp sum is the full gradient.
    hidden = hidden_full.clone().requires_grad_()
    log_probs, entropy = vocab_parallel_log_probs(hidden, shard, labels, tp_group=group, **options)
    ((log_probs * grad_lp).sum() + (entropy * grad_ent).sum()).backward()
    partial = hidden.grad.clone()
    summed = hidden.grad.clone()
    dist.all_reduce(summed, group=group)
    result.update(tp_partial_grad_hidden=partial, tp_summed_grad_hidden=summed)
    return {f"{name}/{key}": value for key, value in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        group = dist.new_group(list(range(world_size)))
        results = {}
        for case in CASES:
            results.update(run_case(case, group, rank, world_size))
        torch.save(results, args.out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
