"""Masked positions never reach the loss, its gradient or its metrics (pitfall 4), whatever they hold."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, policy_loss

from .batches import loss_settings, make_batch
from .reference import AGG_MODES

GARBAGE = {"nan": math.nan, "+inf": math.inf, "-inf": -math.inf, "+1e30": 1e30, "-1e30": -1e30}
TENSORS = ("log_probs", "old_log_probs", "advantages", "ref_log_probs", "entropy")


def run(batch, values, importance_sampling, agg):
    log_probs = values["log_probs"].clone().requires_grad_()
    entropy = values["entropy"].clone().requires_grad_()
    loss, metrics = policy_loss(
        log_probs,
        values["old_log_probs"],
        values["advantages"],
        batch.mask,
        loss_settings(batch, importance_sampling, agg, kl_estimator="k3"),
        ref_log_probs=values["ref_log_probs"],
        entropy=entropy,
    )
    loss.backward()
    return loss.detach(), metrics, log_probs.grad, entropy.grad


def check_unchanged(batch, garbage_tensors, fill, importance_sampling, agg):
    clean = {name: getattr(batch, name) for name in TENSORS}
    dirty = dict(clean)
    for name in garbage_tensors:
        dirty[name] = torch.where(batch.mask, clean[name], torch.full_like(clean[name], fill))
    expected = run(batch, clean, importance_sampling, agg)
    actual = run(batch, dirty, importance_sampling, agg)
    masked = ~batch.mask
    for grad in (actual[2], actual[3]):
        assert torch.isfinite(grad).all(), "non-finite gradient"
        assert bool((grad[masked] == 0).all()), "gradient at a masked position"
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-14, atol=0)
    torch.testing.assert_close(actual[3], expected[3], rtol=1e-14, atol=0)
    assert actual[1].keys() == expected[1].keys()
    for name, value in expected[1].items():
        torch.testing.assert_close(actual[1][name], value, rtol=1e-14, atol=0, msg=name)


@pytest.mark.parametrize("fill", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.parametrize("tensor", TENSORS)
@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
def test_garbage_in_one_tensor(importance_sampling, tensor, fill):
    batch = make_batch(seed=8, per_token_advantages=True)
    check_unchanged(batch, (tensor,), fill, importance_sampling, "seq-mean-token-mean")


@pytest.mark.parametrize("fill", GARBAGE.values(), ids=GARBAGE.keys())
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
def test_garbage_everywhere(importance_sampling, agg, fill):
    batch = make_batch(seed=9, per_token_advantages=True)
    check_unchanged(batch, TENSORS, fill, importance_sampling, agg)


@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
def test_fully_masked_sequence_adds_nothing(importance_sampling):
    """Dropping an all-masked row changes nothing once the denominators are the same."""
    batch = make_batch(seed=10)
    assert not batch.mask[7].any()
    settings = PolicyLossSettings(
        importance_sampling=importance_sampling,
        clip_low=batch.clip_low,
        clip_high=batch.clip_high,
        loss_agg_mode="seq-mean-token-mean",
    )
    full, _ = policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings
    )
    kept = slice(0, 7)
    part, _ = policy_loss(
        batch.log_probs[kept], batch.old_log_probs[kept], batch.advantages[kept],
        batch.mask[kept], settings,
    )  # fmt: skip
    torch.testing.assert_close(full, part, rtol=1e-14, atol=0)


@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
def test_nan_advantage_of_a_sequence_without_response_tokens(importance_sampling):
    """A filtered-out sequence (no response token) may carry any ``[B]`` advantage, even NaN."""
    batch = make_batch(seed=10)
    assert not batch.mask[7].any()
    clean = {name: getattr(batch, name) for name in TENSORS}
    dirty = dict(clean, advantages=clean["advantages"].clone())
    dirty["advantages"][7] = math.nan
    expected = run(batch, clean, importance_sampling, "seq-mean-token-mean")
    actual = run(batch, dirty, importance_sampling, "seq-mean-token-mean")
    assert torch.isfinite(actual[2]).all() and bool((actual[2][7] == 0).all())
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(actual[2], expected[2], rtol=1e-14, atol=0)
