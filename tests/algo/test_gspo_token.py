"""GSPO-token against GSPO (paper eq. 13-17; design notes pitfall 1)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, policy_loss

from .batches import make_batch

EXACT = {"rtol": 1e-12, "atol": 1e-14}


def loss_and_grad(batch, advantages, importance_sampling, *, tensors=None, **settings):
    """The loss with ``settings`` (PolicyLossSettings fields) and ``tensors`` (ref, entropy)."""
    log_probs = batch.log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(
        log_probs,
        batch.old_log_probs,
        advantages,
        batch.mask,
        PolicyLossSettings(
            importance_sampling=importance_sampling,
            clip_low=batch.clip_low,
            clip_high=batch.clip_high,
            loss_agg_mode="seq-mean-token-mean",
            **settings,
        ),
        **(tensors or {}),
    )
    loss.backward()
    return loss.detach(), log_probs.grad, metrics


@pytest.mark.parametrize("scale", [1.0, 1e-3], ids=["grpo_clip", "gspo_clip"])
@pytest.mark.parametrize("dual", [False, True], ids=["no_dual", "dual"])
@pytest.mark.parametrize("extras", [False, True], ids=["pg_only", "kl_entropy"])
@pytest.mark.parametrize("advantage_shape", ["[B]", "[B,T] constant"])
def test_equal_with_one_advantage_per_sequence(advantage_shape, extras, dual, scale):
    batch = make_batch(seed=5, scale=scale)
    advantages = batch.advantages
    if advantage_shape == "[B,T] constant":
        advantages = advantages.unsqueeze(-1).expand_as(batch.log_probs).contiguous()
    kwargs = {"dual_clip_constant": batch.dual_clip_constant if dual else None}
    if extras:
        kwargs.update(
            kl_coef=0.2,
            entropy_coef=0.1,
            tensors={"ref_log_probs": batch.ref_log_probs, "entropy": batch.entropy},
        )
    seq = loss_and_grad(batch, advantages, "seq", **kwargs)
    seq_token = loss_and_grad(batch, advantages, "seq_token", **kwargs)
    torch.testing.assert_close(seq_token[0], seq[0], **EXACT)
    torch.testing.assert_close(seq_token[1], seq[1], **EXACT)
    for name in seq[2]:
        torch.testing.assert_close(seq_token[2][name], seq[2][name], **EXACT)


def test_per_token_advantages_documented_difference():
    """With ``A_it`` varying inside a sequence, seq-mean-token-mean, no dual clip:

    GSPO      ``dL/dlp_it = -(s_i / (n_i^2 N_seq)) * sum_u m_iu a_iu A_iu``  (uniform over t)
    GSPO-tok  ``dL/dlp_it = -(s_i / (n_i N_seq)) * a_it A_it``               (token's own A)

    where ``a_iu`` is 0 where the clip binds (A > 0 and s > 1 + eh, or A < 0 and s < 1 - el).
    Values agree (both ratios equal s_i); gradients differ.
    """
    batch = make_batch(seed=6, per_token_advantages=True)
    seq = loss_and_grad(batch, batch.advantages, "seq")
    seq_token = loss_and_grad(batch, batch.advantages, "seq_token")

    mask = batch.mask
    n = mask.sum(-1).double()
    num_sequences = float((n > 0).sum())
    log_s = torch.where(mask, batch.log_probs - batch.old_log_probs, 0.0).sum(-1) / n.clamp(min=1)
    s = log_s.exp().unsqueeze(-1)
    adv = batch.advantages
    binding = ((adv > 0) & (s > 1 + batch.clip_high)) | ((adv < 0) & (s < 1 - batch.clip_low))
    active_adv = torch.where(mask & ~binding, adv, 0.0)
    n_col = n.clamp(min=1).unsqueeze(-1)
    expected_seq = torch.where(
        mask, -s / (n_col**2 * num_sequences) * active_adv.sum(-1, keepdim=True), 0.0
    )
    expected_seq_token = -s / (n_col * num_sequences) * active_adv

    torch.testing.assert_close(seq_token[0], seq[0], **EXACT)
    torch.testing.assert_close(seq[1], expected_seq, **EXACT)
    torch.testing.assert_close(seq_token[1], expected_seq_token, **EXACT)
    # The batch has sequences with both binding and active tokens, and the gradients really differ.
    assert bool((binding & mask).any()) and bool((~binding & mask).any())
    assert (seq[1] - seq_token[1]).abs().max() > 1e-3


def test_equal_beyond_log_ratio_clamp():
    """DESIGN.md: with one advantage per sequence and seq-mean-token-mean, GSPO and GSPO-token
    give the same value AND gradient. That must hold also where ``|log s_i|`` exceeds
    ``log_ratio_clamp`` (a stale or mismatched old policy): GSPO's clamp stops the gradient there,
    so GSPO-token's must stop too (verl clamps the whole GSPO-token log ratio, gradient included).
    """
    batch = make_batch(seed=7)
    clamp = 10.0
    # Sequence 5 (A < 0, ratio above the clip: unclipped, gradient flows) pushed to log s = 12.
    old = batch.old_log_probs.clone()
    old[5] -= 12.0 - 0.3
    batch.old_log_probs = old
    seq = loss_and_grad(batch, batch.advantages, "seq", log_ratio_clamp=clamp)
    seq_token = loss_and_grad(batch, batch.advantages, "seq_token", log_ratio_clamp=clamp)
    assert float(seq[0]) == pytest.approx(float(seq_token[0]), rel=1e-12)
    assert torch.isfinite(seq_token[1]).all()
    assert math.isclose(float(seq[1][5].abs().sum()), 0.0)
    torch.testing.assert_close(seq_token[1], seq[1], **EXACT)
