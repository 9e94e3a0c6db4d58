"""KL estimators (Schulman 2020) and the input clamp that keeps their gradients finite (pitfall 16)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, add_token_level_kl, kl_estimate, policy_loss

from .batches import make_batch
from .reference import kl_reference, reference_policy_loss, reference_token_level_kl

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


# ------------------------------------------------------------------------------------------------
# The k3 cap (verl/slime low_var_kl, ROLL k3: clamp(k3, -10, 10))
# ------------------------------------------------------------------------------------------------

CAP = 10.0


def _k3_root(low: float, high: float) -> float:
    """``x`` with ``e^x - x - 1 = CAP`` in ``[low, high]`` (bisection; k3 is monotone there)."""
    f_low = math.exp(low) - low - 1 - CAP
    for _ in range(200):
        middle = (low + high) / 2
        f_middle = math.exp(middle) - middle - 1 - CAP
        if (f_middle > 0) == (f_low > 0):
            low, f_low = middle, f_middle
        else:
            high = middle
    return (low + high) / 2


@pytest.mark.parametrize("side", ["ref_above", "ref_below"])
@pytest.mark.parametrize("where", ["inside", "outside"])
def test_k3_cap_at_the_boundary(where, side):
    """Just inside the cap k3 and its gradient are the formula's; just outside, k3 is the cap
    and its gradient 0. ``x = ref - lp`` reaches the cap at about 2.61 (reference above the
    policy) and -11 (below)."""
    root = _k3_root(0.0, 5.0) if side == "ref_above" else _k3_root(-15.0, -5.0)
    outward = 1.0 if side == "ref_above" else -1.0
    x = root + outward * (1e-3 if where == "outside" else -1e-3)
    log_probs = torch.tensor([-2.0], dtype=torch.float64, requires_grad=True)
    ref = log_probs.detach() + x
    capped = kl_estimate(log_probs, ref, "k3", k3_clamp=CAP)
    capped.sum().backward()
    capped = capped.detach()
    if where == "inside":
        assert float(capped) == pytest.approx(FORMULAS["k3"](-2.0, -2.0 + x), rel=1e-12)
        assert float(capped) < CAP
        assert float(log_probs.grad) == pytest.approx(DERIVATIVES["k3"](-2.0, -2.0 + x), rel=1e-9)
        assert float(log_probs.grad) != 0.0
    else:
        assert float(capped) == CAP
        assert float(log_probs.grad) == 0.0
    uncapped = kl_estimate(log_probs.detach(), ref, "k3")
    assert float(uncapped) == pytest.approx(FORMULAS["k3"](-2.0, -2.0 + x), rel=1e-12)


@pytest.mark.parametrize("estimator", ["k1", "k2"])
def test_cap_leaves_k1_and_k2(estimator):
    log_probs = torch.tensor([-2.0, -1.0], dtype=torch.float64)
    ref = log_probs + torch.tensor([15.0, -15.0], dtype=torch.float64)
    assert torch.equal(
        kl_estimate(log_probs, ref, estimator, k3_clamp=CAP), kl_estimate(log_probs, ref, estimator)
    )


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_capped_kl_loss_matches_the_float64_reference(agg):
    """policy_loss with ``kl_clamp``: value and gradient of the reference written from the
    formula, on a batch where some tokens lie beyond the cap (their KL gradient is 0)."""
    batch = make_batch(seed=21)
    generator = torch.Generator().manual_seed(22)
    ref = batch.log_probs + 4.0 * torch.randn(batch.log_probs.shape, generator=generator).double()
    beyond = (kl_reference(batch.log_probs, ref, "k3") > CAP) & batch.mask
    assert 0 < int(beyond.sum()) < int(batch.mask.sum())
    settings = {
        "importance_sampling": "seq", "clip_low": batch.clip_low, "clip_high": batch.clip_high,
        "loss_agg_mode": agg, "kl_coef": 0.3, "kl_estimator": "k3", "kl_clamp": CAP,
    }  # fmt: skip
    log_probs = batch.log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(
        log_probs, batch.old_log_probs, batch.advantages, batch.mask,
        PolicyLossSettings(**settings), ref_log_probs=ref,
    )  # fmt: skip
    loss.backward()
    reference_log_probs = batch.log_probs.clone().requires_grad_()
    parts = reference_policy_loss(
        reference_log_probs, batch.old_log_probs, batch.advantages, batch.mask,
        ref_log_probs=ref, norm_length=None, **settings,
    )  # fmt: skip
    parts["loss"].backward()
    torch.testing.assert_close(loss.detach(), parts["loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(metrics["kl_loss"], parts["kl_loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(log_probs.grad, reference_log_probs.grad, rtol=1e-10, atol=1e-12)
    uncapped, _ = policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
        PolicyLossSettings(**dict(settings, kl_clamp=None)), ref_log_probs=ref,
    )  # fmt: skip
    assert float(uncapped.detach()) > float(loss.detach()) + 1e-3  # the cap binds here


def test_cap_removes_the_huge_gap_gradient():
    """A reference log-prob 19.9 nats above the policy's (just inside the input clamp, 20):
    uncapped, the token's KL gradient is ``coef (1 - e^19.9) / n``, about -1.4e7 coef; capped, it
    is 0 and only the policy-gradient term remains."""
    log_probs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[18.9, -2.1, -0.7]], dtype=torch.float64)

    def gradient(kl_clamp, kl_coef):
        leaf = log_probs.clone().requires_grad_()
        loss, _ = policy_loss(
            leaf, log_probs, torch.tensor([1.0], dtype=torch.float64),
            torch.ones(1, 3, dtype=torch.bool),
            PolicyLossSettings(
                importance_sampling="seq", clip_low=0.2, clip_high=0.2,
                loss_agg_mode="seq-mean-token-mean", kl_coef=kl_coef, kl_clamp=kl_clamp,
            ),
            ref_log_probs=ref,
        )  # fmt: skip
        loss.backward()
        return leaf.grad[0]

    policy_only = gradient(CAP, 0.0)
    capped = gradient(CAP, 0.1)
    uncapped = gradient(None, 0.1)
    assert float(capped[0]) == pytest.approx(float(policy_only[0]), rel=1e-12)
    assert float(uncapped[0] - policy_only[0]) == pytest.approx(
        0.1 * (1 - math.exp(19.9)) / 3, rel=1e-9
    )
    # Tokens inside the cap keep their KL gradient.
    assert float(capped[1] - policy_only[1]) == pytest.approx(
        0.1 * (1 - math.exp(-0.1)) / 3, rel=1e-9
    )


def test_capped_kl_in_reward_matches_the_reference():
    generator = torch.Generator().manual_seed(23)
    mask = torch.tensor([[1, 1, 1, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)
    old = -3 * torch.rand(2, 5, generator=generator, dtype=torch.float64)
    ref = old + 4.0 * torch.randn(2, 5, generator=generator, dtype=torch.float64)
    assert bool(((kl_reference(old, ref, "k3") > CAP) & mask).any())
    advantages = torch.tensor([1.0, -0.5], dtype=torch.float64)
    result, kl = add_token_level_kl(
        advantages, old, ref, mask, coef=0.2, estimator="k3", k3_clamp=CAP
    )
    expected = reference_token_level_kl(advantages.tolist(), old, ref, mask, 0.2, "k3", CAP)
    torch.testing.assert_close(result, expected, rtol=1e-12, atol=1e-14)
    assert float(kl.max()) == CAP
