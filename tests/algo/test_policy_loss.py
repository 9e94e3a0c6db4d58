"""policy_loss against the float64 reference: every ratio x aggregation x dual clip x KL x entropy."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, aggregate, policy_loss

from .batches import make_batch
from .reference import AGG_MODES, kl_reference, reference_policy_loss

IMPORTANCE_SAMPLING = ("seq", "seq_token", "token")
KL_COEF, ENTROPY_COEF = 0.3, 0.05
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def loss_kwargs(batch, *, importance_sampling, agg, dual, kl, entropy_on):
    """Keyword arguments of the float64 reference; :func:`settings_of` takes the loss's from them."""
    return {
        "importance_sampling": importance_sampling,
        "clip_low": batch.clip_low,
        "clip_high": batch.clip_high,
        "loss_agg_mode": agg,
        "dual_clip_constant": batch.dual_clip_constant if dual else None,
        "ref_log_probs": batch.ref_log_probs if kl else None,
        "kl_coef": KL_COEF if kl else 0.0,
        "kl_estimator": kl or "k3",
        "entropy_coef": ENTROPY_COEF if entropy_on else 0.0,
    }


def settings_of(kwargs) -> tuple[PolicyLossSettings, dict]:
    """``kwargs`` of the reference split into the loss's settings and its tensor arguments."""
    tensors = {"ref_log_probs": kwargs["ref_log_probs"]}
    fields = {name: value for name, value in kwargs.items() if name != "ref_log_probs"}
    return PolicyLossSettings(**fields), tensors


def run_both(batch, kwargs, entropy_on):
    """(implementation loss, metrics, grads), (reference parts, grads) on fresh leaves."""
    log_probs = batch.log_probs.clone().requires_grad_()
    entropy = batch.entropy.clone().requires_grad_() if entropy_on else None
    settings, tensors = settings_of(kwargs)
    loss, metrics = policy_loss(
        log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings, entropy=entropy,
        **tensors,
    )  # fmt: skip
    loss.backward()
    grads = (log_probs.grad, entropy.grad if entropy_on else None)

    ref_log_probs = batch.log_probs.double().clone().requires_grad_()
    ref_entropy = batch.entropy.double().clone().requires_grad_() if entropy_on else None
    ref_kwargs = dict(kwargs)
    if ref_kwargs["ref_log_probs"] is not None:
        ref_kwargs["ref_log_probs"] = ref_kwargs["ref_log_probs"].double()
    parts = reference_policy_loss(
        ref_log_probs,
        batch.old_log_probs.double(),
        batch.advantages.double(),
        batch.mask,
        entropy=ref_entropy,
        **ref_kwargs,
    )
    parts["loss"].backward()
    ref_grads = (ref_log_probs.grad, ref_entropy.grad if entropy_on else None)
    return (loss, metrics, grads), (parts, ref_grads)


@pytest.mark.parametrize("per_token", [False, True], ids=["adv_seq", "adv_token"])
@pytest.mark.parametrize("entropy_on", [False, True], ids=["no_ent", "ent"])
@pytest.mark.parametrize("kl", [None, "k1", "k2", "k3"], ids=lambda k: f"kl_{k}")
@pytest.mark.parametrize("dual", [False, True], ids=["no_dual", "dual"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", IMPORTANCE_SAMPLING)
def test_matches_reference(importance_sampling, agg, dual, kl, entropy_on, per_token):
    batch = make_batch(seed=1, per_token_advantages=per_token)
    kwargs = loss_kwargs(
        batch, importance_sampling=importance_sampling, agg=agg, dual=dual, kl=kl,
        entropy_on=entropy_on,
    )  # fmt: skip
    (loss, metrics, grads), (parts, ref_grads) = run_both(batch, kwargs, entropy_on)

    torch.testing.assert_close(loss.detach(), parts["loss"], **TIGHT)
    torch.testing.assert_close(metrics["pg_loss"], parts["pg_loss"], **TIGHT)
    torch.testing.assert_close(grads[0], ref_grads[0], **TIGHT)
    mask = batch.mask
    if kl:
        torch.testing.assert_close(metrics["kl_loss"], parts["kl_loss"], **TIGHT)
        token_kl = kl_reference(batch.log_probs, batch.ref_log_probs, kl)[mask].mean()
        torch.testing.assert_close(metrics["kl"], token_kl, **TIGHT)
    else:
        assert "kl_loss" not in metrics
    if entropy_on:
        torch.testing.assert_close(metrics["entropy_loss"], parts["entropy_loss"], **TIGHT)
        torch.testing.assert_close(metrics["entropy"], batch.entropy[mask].mean(), **TIGHT)
        torch.testing.assert_close(grads[1], ref_grads[1], **TIGHT)
    if kl is None:
        # Some response tokens must sit behind a binding clip (zero gradient) and some not, or
        # the batch does not exercise the clip regimes this test claims to cover.
        assert grads[0][mask].abs().min() == 0 and grads[0][mask].abs().max() > 0


@pytest.mark.parametrize("dual", [False, True], ids=["no_dual", "dual"])
@pytest.mark.parametrize("per_token", [False, True], ids=["adv_seq", "adv_token"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", IMPORTANCE_SAMPLING)
def test_gspo_sized_clip_range(importance_sampling, agg, per_token, dual):
    """The paper's clip range (eps ~ 3e-4) with sequence ratios a few 1e-4 away from 1."""
    batch = make_batch(seed=2, scale=1e-3, per_token_advantages=per_token)
    kwargs = loss_kwargs(
        batch, importance_sampling=importance_sampling, agg=agg, dual=dual, kl="k3",
        entropy_on=True,
    )  # fmt: skip
    (loss, metrics, grads), (parts, ref_grads) = run_both(batch, kwargs, True)
    torch.testing.assert_close(loss.detach(), parts["loss"], **TIGHT)
    torch.testing.assert_close(grads[0], ref_grads[0], **TIGHT)
    if importance_sampling != "token":
        # Five of the seven non-empty sequences lie outside the range (batches.SEQUENCES).
        assert metrics["ratio_out_of_range_seq"] * 7 == pytest.approx(5.0)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", IMPORTANCE_SAMPLING)
def test_float32_matches_float64_reference(importance_sampling, agg):
    batch = make_batch(seed=3, dtype=torch.float32, per_token_advantages=True)
    kwargs = loss_kwargs(
        batch, importance_sampling=importance_sampling, agg=agg, dual=True, kl="k3",
        entropy_on=True,
    )  # fmt: skip
    (loss, _, grads), (parts, ref_grads) = run_both(batch, kwargs, True)
    assert loss.dtype == torch.float32 and grads[0].dtype == torch.float32
    torch.testing.assert_close(loss.detach().double(), parts["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0].double(), ref_grads[0], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("per_token", [False, True], ids=["adv_seq", "adv_token"])
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "token"])
def test_gradcheck(importance_sampling, agg, per_token):
    """Finite differences agree with autograd (ratios sit far from the clip kinks).

    Not seq_token: its value ``s_i e^{lp - sg(lp)}`` moves with the whole sequence under finite
    differences while its gradient, by design, is only ``s_i grad lp_it``.
    """
    batch = make_batch(seed=4, per_token_advantages=per_token, token_noise=0.05)
    kwargs = loss_kwargs(
        batch, importance_sampling=importance_sampling, agg=agg, dual=True, kl="k3",
        entropy_on=False,
    )  # fmt: skip

    settings, tensors = settings_of(kwargs)

    def loss_of(log_probs):
        loss, _ = policy_loss(
            log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings, **tensors
        )
        return loss

    log_probs = batch.log_probs.clone().requires_grad_()
    assert torch.autograd.gradcheck(loss_of, (log_probs,), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_aggregate_by_hand(agg):
    """Two sequences, lengths 3 and 1 in width 4, N_seq = 2, N_tok = 4, T_norm = 5."""
    values = torch.tensor([[1.0, 2.0, 99.0, 3.0], [99.0, 99.0, 4.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)
    expected = {
        "token-mean": (1 + 2 + 3 + 4) / 4,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,
        "seq-mean-token-sum-norm": (6 + 4) / 5,
        "dr-grpo": (6 + 4) / (2 * 5),
    }[agg]
    result = aggregate(
        values, mask, agg, lengths=torch.tensor([3.0, 1.0], dtype=torch.float64),
        num_sequences=2, num_tokens=4, norm_length=5,
    )  # fmt: skip
    assert float(result) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    "wrong,fragment",
    [
        ({"importance_sampling": "sequence"}, "importance_sampling"),
        ({"loss_agg_mode": "token_mean"}, "loss_agg_mode"),
        ({"kl_estimator": "k4"}, "KL estimator"),
    ],
)
def test_unknown_modes_raise(wrong, fragment):
    batch = make_batch()
    with pytest.raises(ValueError, match=fragment):
        settings = dict(
            importance_sampling="seq", clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean"
        )
        policy_loss(
            batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
            PolicyLossSettings(**{**settings, **wrong}),
        )  # fmt: skip
