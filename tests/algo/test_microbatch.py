"""Micro-batch invariance with global denominators (pitfall 5): loss, gradient and metrics."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.algo import policy_loss

from .batches import WIDTH, loss_settings, make_batch
from .reference import AGG_MODES

# Row counts of the micro-batches of a 12-row batch, uneven on purpose; row 7 has no response token.
SPLITS = ([12], [5, 7], [3, 1, 4, 4], [1] * 12)


def compute(batch, rows, columns, log_probs, *, importance_sampling, agg, globals_=None):
    entropy = batch.entropy[rows, :columns]
    return policy_loss(
        log_probs[rows, :columns],
        batch.old_log_probs[rows, :columns],
        batch.advantages[rows] if batch.advantages.dim() == 1 else batch.advantages[rows, :columns],
        batch.mask[rows, :columns],
        loss_settings(batch, importance_sampling, agg, kl_estimator="k2", norm_length=WIDTH),
        ref_log_probs=batch.ref_log_probs[rows, :columns],
        entropy=entropy,
        **(globals_ or {}),
    )


@pytest.mark.parametrize("splits", SPLITS, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("per_token", [False, True], ids=["adv_seq", "adv_token"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
def test_split_equals_whole(importance_sampling, agg, per_token, splits):
    batch = make_batch(seed=11, extra=4, per_token_advantages=per_token)
    size = batch.mask.shape[0]
    assert sum(splits) == size

    whole_lp = batch.log_probs.clone().requires_grad_()
    whole_loss, whole_metrics = compute(
        batch, slice(0, size), WIDTH, whole_lp, importance_sampling=importance_sampling, agg=agg
    )
    whole_loss.backward()

    lengths = batch.mask.sum(-1).double()
    globals_all = {
        "num_sequences": float((lengths > 0).sum()),
        "num_tokens": float(lengths.sum()),
    }
    split_lp = batch.log_probs.clone().requires_grad_()
    total_loss = torch.zeros((), dtype=torch.float64)
    summed: dict[str, torch.Tensor] = {}
    start = 0
    for count in splits:
        rows = slice(start, start + count)
        start += count
        # Each micro-batch is padded only to its own longest response (as packing would).
        used = batch.mask[rows].any(0).nonzero()
        columns = int(used.max()) + 1 if used.numel() else 1
        loss, metrics = compute(
            batch, rows, columns, split_lp, importance_sampling=importance_sampling, agg=agg,
            globals_={**globals_all, "sequence_lengths": lengths[rows]},
        )  # fmt: skip
        loss.backward()
        total_loss = total_loss + loss.detach()
        for name, value in metrics.items():
            if name.endswith("_max"):
                summed[name] = torch.maximum(summed.get(name, value), value)
            else:
                summed[name] = summed.get(name, 0.0) + value

    torch.testing.assert_close(total_loss, whole_loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-12, atol=1e-14)
    assert summed.keys() == whole_metrics.keys()
    for name, value in whole_metrics.items():
        torch.testing.assert_close(summed[name], value, rtol=1e-12, atol=1e-14, msg=name)
