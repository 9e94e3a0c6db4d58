"""Context parallel: each of 2 gloo ranks holds some tokens of every sequence (pitfall 7).

Zig-zag over 4 column chunks ``[0,1] [2,3] [4,5] [6]``: rank 0 holds chunks 0 and 3, rank 1
chunks 1 and 2. Row 1's response lies entirely on rank 0, row 3's entirely on rank 1, row 7 has
none. The sum of the ranks' losses and their gradients, scattered back, must equal one process.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.algo import PolicyLossSettings, RolloutCorrection, policy_loss

from .batches import WIDTH, make_batch
from .reference import AGG_MODES
from .test_corrections import behaviour_of

RANK_COLUMNS = ([0, 1, 6], [2, 3, 4, 5])
POSITIONS = {1: [0, 6], 3: [4]}
# Extra settings: rollout corrections (the sequence level needs the all-reduced geometric mean)
# and the CISPO / GMPO surrogates (GMPO's sequence term is all-reduced like GSPO's).
VARIANTS = {
    None: {},
    "token_truncate": {
        "rollout_correction": RolloutCorrection(level="token", mode="truncate", high=2.0)
    },
    "token_mask": {
        "rollout_correction": RolloutCorrection(level="token", mode="mask", low=0.5, high=5.0)
    },
    "sequence_truncate": {
        "rollout_correction": RolloutCorrection(level="sequence", mode="truncate", high=1.1)
    },
    "sequence_mask": {
        "rollout_correction": RolloutCorrection(level="sequence", mode="mask", low=0.8, high=1.25)
    },
    "cispo": {"surrogate": "cispo", "cispo_weight_bounds": (0.7, 1.5), "dual_clip_constant": None},
    "gmpo": {
        "surrogate": "gmpo",
        "gmpo_log_clip": 0.3,
        "dual_clip_constant": None,
        "rollout_correction": RolloutCorrection(level="sequence", mode="mask", low=0.8, high=1.25),
    },
}
CASES = (
    [
        (importance_sampling, agg, per_token, None)
        for importance_sampling in ("seq", "seq_token", "token")
        for agg in AGG_MODES
        for per_token in (False, True)
    ]
    + [
        ("seq", "seq-mean-token-mean", False, variant)
        for variant in VARIANTS
        if variant is not None and variant not in ("cispo", "gmpo")
    ]
    + [
        ("token", "token-mean", True, "token_mask"),
        ("token", "token-mean", True, "cispo"),
        ("token", "seq-mean-token-mean", False, "gmpo"),
    ]
)


def run_loss(batch, columns, log_probs, importance_sampling, agg, variant=None, group=None):
    advantages = batch.advantages if batch.advantages.dim() == 1 else batch.advantages[:, columns]
    lengths = batch.mask.sum(-1).double()  # full lengths, whoever holds the tokens
    fields = {"dual_clip_constant": batch.dual_clip_constant, **VARIANTS[variant]}
    return policy_loss(
        log_probs,
        batch.old_log_probs[:, columns],
        advantages,
        batch.mask[:, columns],
        PolicyLossSettings(
            importance_sampling=importance_sampling,
            clip_low=batch.clip_low,
            clip_high=batch.clip_high,
            loss_agg_mode=agg,
            kl_coef=0.3,
            entropy_coef=0.05,
            norm_length=WIDTH,
            **fields,
        ),
        ref_log_probs=batch.ref_log_probs[:, columns],
        entropy=batch.entropy[:, columns],
        behaviour_log_probs=behaviour_of(batch)[:, columns],
        num_sequences=float((lengths > 0).sum()),
        num_tokens=float(lengths.sum()),
        sequence_lengths=lengths,
        sequence_group=group,
    )


def worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    columns = RANK_COLUMNS[rank]
    results = []
    for importance_sampling, agg, per_token, variant in CASES:
        batch = make_batch(seed=12, per_token_advantages=per_token, positions=POSITIONS)
        log_probs = batch.log_probs[:, columns].clone().requires_grad_()
        loss, metrics = run_loss(
            batch, columns, log_probs, importance_sampling, agg, variant, group
        )
        loss.backward()
        results.append((loss.detach(), log_probs.grad, metrics))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_context_parallel_equals_one_process():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(free_port(), out_dir), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]

    all_columns = list(range(WIDTH))
    for index, (importance_sampling, agg, per_token, variant) in enumerate(CASES):
        batch = make_batch(seed=12, per_token_advantages=per_token, positions=POSITIONS)
        assert batch.mask[1, RANK_COLUMNS[1]].sum() == 0 and batch.mask[1].sum() == 2
        assert batch.mask[3, RANK_COLUMNS[0]].sum() == 0 and batch.mask[3].sum() == 1
        log_probs = batch.log_probs.clone().requires_grad_()
        loss, metrics = run_loss(batch, all_columns, log_probs, importance_sampling, agg, variant)
        loss.backward()

        case = f"{importance_sampling}/{agg}/per_token={per_token}/{variant}"
        summed_loss = ranks[0][index][0] + ranks[1][index][0]
        torch.testing.assert_close(summed_loss, loss.detach(), rtol=1e-12, atol=1e-14, msg=case)
        grad = torch.zeros_like(batch.log_probs)
        for rank, columns in enumerate(RANK_COLUMNS):
            grad[:, columns] = ranks[rank][index][1]
        torch.testing.assert_close(grad, log_probs.grad, rtol=1e-12, atol=1e-14, msg=case)
        for name, value in metrics.items():
            pair = (ranks[0][index][2][name], ranks[1][index][2][name])
            if name.endswith("_max"):
                combined = torch.maximum(*pair)
            elif name.endswith("_min"):
                combined = torch.minimum(*pair)
            else:
                combined = pair[0] + pair[1]
            torch.testing.assert_close(
                combined, value, rtol=1e-12, atol=1e-14, msg=f"{case} {name}"
            )
