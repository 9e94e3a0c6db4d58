"""KL estimators (Schulman 2020) and the input clamp that keeps their gradients finite (pitfall 16)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, kl_estimate, policy_loss

FORMULAS = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: (lp - ref) ** 2 / 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1,
}
# d/d lp of each estimator, inside the clamp.
DERIVATIVES = {
    "k1": lambda lp, ref: 1.0,
    "k2": lambda lp, ref: lp - ref,
    "k3": lambda lp, ref: 1 - math.exp(ref - lp),
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_values_and_gradients_match_formulas(estimator):
    generator = torch.Generator().manual_seed(13)
    log_probs = (-4 * torch.rand(5, 6, generator=generator, dtype=torch.float64)).requires_grad_()
    ref = log_probs.detach() + 3 * torch.randn(5, 6, generator=generator, dtype=torch.float64)
    kl = kl_estimate(log_probs, ref, estimator)
    kl.sum().backward()
    for index in range(log_probs.numel()):
        lp, rf = float(log_probs.detach().view(-1)[index]), float(ref.view(-1)[index])
        assert float(kl.detach().view(-1)[index]) == pytest.approx(
            FORMULAS[estimator](lp, rf), rel=1e-12
        )
        assert float(log_probs.grad.view(-1)[index]) == pytest.approx(
            DERIVATIVES[estimator](lp, rf), rel=1e-12, abs=1e-15
        )
    if estimator != "k1":
        assert bool((kl >= 0).all())


@pytest.mark.parametrize("gap", [1000.0, -1000.0, 25.0, -25.0])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_clamp_keeps_gradients_finite(estimator, gap):
    """``ref - lp`` far outside +-20: value as at the clamp, finite value and gradient."""
    log_probs = torch.full((3,), -2.0, dtype=torch.float64, requires_grad=True)
    ref = log_probs.detach() + gap
    kl = kl_estimate(log_probs, ref, estimator)
    kl.sum().backward()
    clamped = math.copysign(20.0, gap)
    expected = FORMULAS[estimator](0.0, clamped)
    assert torch.isfinite(kl).all() and torch.isfinite(log_probs.grad).all()
    torch.testing.assert_close(kl, torch.full_like(kl, expected), rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_huge_reference_gap_through_policy_loss(estimator, dtype):
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=dtype, requires_grad=True)
    ref = torch.tensor([[999.0, -1002.0, -0.7]], dtype=dtype)
    loss, metrics = policy_loss(
        log_probs, log_probs.detach(), torch.tensor([1.0], dtype=dtype),
        torch.ones(1, 3, dtype=torch.bool),
        PolicyLossSettings(
            importance_sampling="seq", clip_low=3e-4, clip_high=4e-4,
            loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, kl_estimator=estimator,
        ),
        ref_log_probs=ref,
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all()
    assert torch.isfinite(metrics["kl"])


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
