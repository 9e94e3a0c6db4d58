"""Rollout corrections (TIS, MIS / IcePop, geometric-mean sequence weights) against float64
references: weights, the loss they weight (value and gradient), metrics, denominators, masking and
micro-batch splits."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import (
    PolicyLossSettings,
    RolloutCorrection,
    correction_weights,
    finish_correction_metrics,
    log_prob_gap,
    policy_loss,
)

from .batches import WIDTH, loss_settings, make_batch
from .reference import AGG_MODES, reference_correction_weights, reference_policy_loss

TIGHT = {"rtol": 1e-10, "atol": 1e-12}
# (level, mode, low, high): the defaults of config/ (TIS C = 2, IcePop [0.5, 5]) and bounds that
# make the sequence level bind on the test batch (its geometric means spread by ~0.3).
CORRECTIONS = {
    "token_truncate": ("token", "truncate", None, 2.0),
    "token_mask": ("token", "mask", 0.5, 5.0),
    "sequence_truncate": ("sequence", "truncate", None, 1.1),
    "sequence_mask": ("sequence", "mask", 0.8, 1.25),
}
PREFIX = "rollout_correction/"


def behaviour_of(batch, seed: int = 0, spread: float = 0.6) -> torch.Tensor:
    """``log mu``: the old log-probs shifted per token by a heavy-tailed gap, so that token
    ratios fall below 0.5, between, and above 2 and 5."""
    generator = torch.Generator().manual_seed(seed)
    gaps = spread * torch.randn(batch.old_log_probs.shape, generator=generator, dtype=torch.float64)
    gaps = gaps + 0.3 * torch.randn(batch.mask.shape[0], 1, generator=generator).double()
    gaps[0, :3] = torch.tensor([2.0, -1.2, 0.9], dtype=torch.float64)  # ratios e^2, e^-1.2, ...
    return (batch.old_log_probs.double() - gaps).to(batch.old_log_probs.dtype)


def correction_of(name: str) -> RolloutCorrection:
    level, mode, low, high = CORRECTIONS[name]
    return RolloutCorrection(level=level, mode=mode, low=low, high=high)


@pytest.mark.parametrize("name", CORRECTIONS)
def test_weights_match_reference(name):
    batch = make_batch(seed=21, extra=4)
    behaviour = behaviour_of(batch)
    level, mode, low, high = CORRECTIONS[name]
    result = correction_weights(batch.old_log_probs, behaviour, batch.mask, correction_of(name))
    expected = reference_correction_weights(
        batch.old_log_probs, behaviour, batch.mask, level=level, mode=mode, low=low, high=high
    )
    torch.testing.assert_close(result.weights, expected, rtol=1e-12, atol=0)
    mask = batch.mask
    # The batch exercises the bound: some tokens truncated / dropped, others kept unchanged.
    affected = result.truncated if mode == "truncate" else result.masked
    assert 0 < int(affected.sum()) < int(mask.sum())
    assert bool((result.weights[~mask] == 0).all())
    if mode == "truncate":
        assert bool((result.weights[mask] <= high).all())
    else:
        assert bool((result.weights[result.masked] == 0).all())


def test_geometric_mean_not_product_on_4096_tokens():
    """``exp(mean)``, never ``exp(sum)``: 4,096-token sequences with a per-token gap of
    ``N(0.003, 0.05)`` have a sum of about 12 (``exp(sum)`` ~ 1.6e5, or its inverse) but a
    geometric-mean weight within 1% of 1."""
    generator = torch.Generator().manual_seed(5)
    length, rows = 4096, 3
    old = -2.0 * torch.rand(rows, length, generator=generator, dtype=torch.float64)
    gaps = 0.003 * torch.tensor([[1.0], [-1.0], [0.2]], dtype=torch.float64) + 0.05 * torch.randn(
        rows, length, generator=generator, dtype=torch.float64
    )
    behaviour = old - gaps
    mask = torch.ones(rows, length, dtype=torch.bool)
    mask[2, 3000:] = False  # a shorter one: the mean is over its own 3,000 tokens
    truncate = RolloutCorrection(level="sequence", mode="truncate", high=2.0)
    result = correction_weights(old, behaviour, mask, truncate)
    for i in range(rows):
        n = int(mask[i].sum())
        mean_gap = math.fsum(gaps[i, :n].tolist()) / n
        assert float(result.sequence_ratios[i]) == pytest.approx(math.exp(mean_gap), rel=1e-12)
        assert abs(float(result.sequence_ratios[i]) - 1.0) < 0.01
        assert abs(math.fsum(gaps[i, :n].tolist())) > 3  # exp(sum) would be far from 1
    torch.testing.assert_close(
        result.weights[mask],
        result.sequence_ratios.unsqueeze(-1).expand_as(old)[mask],
        rtol=0,
        atol=0,
    )
    # In float32 (the trainer's dtype) the mean over 4,096 tokens keeps the weight exact to 1e-6.
    result32 = correction_weights(old.float(), behaviour.float(), mask, truncate)
    torch.testing.assert_close(
        result32.sequence_ratios.double(), result.sequence_ratios, rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token", "token"])
@pytest.mark.parametrize("name", CORRECTIONS)
def test_policy_loss_with_correction_matches_reference(name, importance_sampling, agg):
    batch = make_batch(seed=22, extra=3, per_token_advantages=importance_sampling == "seq_token")
    behaviour = behaviour_of(batch, seed=1)
    level, mode, low, high = CORRECTIONS[name]
    settings = loss_settings(
        batch, importance_sampling, agg, rollout_correction=correction_of(name)
    )
    log_probs = batch.log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(
        log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings,
        ref_log_probs=batch.ref_log_probs, entropy=batch.entropy, behaviour_log_probs=behaviour,
    )  # fmt: skip
    loss.backward()

    weights = reference_correction_weights(
        batch.old_log_probs, behaviour, batch.mask, level=level, mode=mode, low=low, high=high
    )
    reference_lp = batch.log_probs.clone().requires_grad_()
    parts = reference_policy_loss(
        reference_lp, batch.old_log_probs, batch.advantages, batch.mask,
        importance_sampling=importance_sampling, clip_low=batch.clip_low,
        clip_high=batch.clip_high, loss_agg_mode=agg,
        dual_clip_constant=batch.dual_clip_constant, ref_log_probs=batch.ref_log_probs,
        kl_coef=0.3, entropy=batch.entropy, entropy_coef=0.05, pg_weights=weights,
    )  # fmt: skip
    parts["loss"].backward()
    torch.testing.assert_close(loss.detach(), parts["loss"], **TIGHT)
    torch.testing.assert_close(metrics["pg_loss"], parts["pg_loss"], **TIGHT)
    torch.testing.assert_close(log_probs.grad, reference_lp.grad, **TIGHT)

    # Metrics by hand: token- and sequence-weighted moments, fractions, extremes.
    mask = batch.mask
    lengths = mask.sum(-1).double()
    num_tokens, num_sequences = float(lengths.sum()), float((lengths > 0).sum())
    torch.testing.assert_close(
        metrics[PREFIX + "weight_mean"], weights[mask].sum() / num_tokens, **TIGHT
    )
    per_sequence = (weights.sum(-1) / lengths.clamp(min=1))[lengths > 0]
    torch.testing.assert_close(
        metrics[PREFIX + "weight_seq_mean"], per_sequence.sum() / num_sequences, **TIGHT
    )
    affected = weights == 0 if mode == "mask" else weights == high
    kind = "masked" if mode == "mask" else "truncated"
    assert float(metrics[f"{PREFIX}{kind}_frac_token"]) == pytest.approx(
        float(affected[mask].sum()) / num_tokens, rel=1e-12
    )
    assert float(metrics[f"{PREFIX}{kind}_frac_token"]) > 0
    finished = finish_correction_metrics({k: float(v) for k, v in metrics.items()})
    ess = float(weights[mask].mean()) ** 2 / float(weights[mask].square().mean())
    assert finished[PREFIX + "ess_token"] == pytest.approx(ess, rel=1e-10)
    assert 0 < finished[PREFIX + "ess_token"] < 1
    gaps = (batch.old_log_probs - behaviour).double()
    if level == "token":
        raw = torch.exp(gaps[mask])
    else:
        raw = torch.exp((torch.where(mask, gaps, 0.0).sum(-1) / lengths.clamp(min=1))[lengths > 0])
    assert finished[PREFIX + "ratio_max"] == pytest.approx(float(raw.max()), rel=1e-12)
    assert finished[PREFIX + "ratio_min"] == pytest.approx(float(raw.min()), rel=1e-12)


@pytest.mark.parametrize("name", ["token_mask", "sequence_mask"])
def test_a_mask_keeps_the_denominators(name):
    """Masking removes signal, it does not re-weight the rest: the loss equals the uncorrected
    loss with the dropped tokens' weights replaced by 0 (denominators unchanged), which differs
    from dropping them from the loss mask."""
    batch = make_batch(seed=23, extra=3)
    behaviour = behaviour_of(batch, seed=2)
    corrected = policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask,
        PolicyLossSettings(
            importance_sampling="token", clip_low=0.2, clip_high=0.28,
            loss_agg_mode="token-mean", rollout_correction=correction_of(name),
        ),
        behaviour_log_probs=behaviour,
    )[0]  # fmt: skip
    weights = correction_weights(
        batch.old_log_probs, behaviour, batch.mask, correction_of(name)
    ).weights
    dropped = batch.mask & (weights == 0)
    assert bool(dropped.any())
    common = dict(
        importance_sampling="token", clip_low=0.2, clip_high=0.28, loss_agg_mode="token-mean"
    )
    same_denominators = reference_policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, **common,
        pg_weights=weights,
    )["loss"]  # fmt: skip
    torch.testing.assert_close(corrected, same_denominators, **TIGHT)
    renormalised = reference_policy_loss(
        batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask & ~dropped, **common,
        pg_weights=weights,
    )["loss"]  # fmt: skip
    assert abs(float(renormalised - corrected)) > 1e-3


@pytest.mark.parametrize("name", CORRECTIONS)
def test_behaviour_log_probs_at_masked_positions_are_never_read(name):
    """Multi-turn observation tokens have no ``mu``: NaN or -inf there changes nothing."""
    batch = make_batch(seed=24, extra=2)
    clean = behaviour_of(batch, seed=3)
    settings = PolicyLossSettings(
        importance_sampling="seq", clip_low=batch.clip_low, clip_high=batch.clip_high,
        loss_agg_mode="seq-mean-token-mean", rollout_correction=correction_of(name),
    )  # fmt: skip
    results = []
    for fill in (None, math.nan, -math.inf):
        behaviour = clean if fill is None else torch.where(batch.mask, clean, fill)
        log_probs = batch.log_probs.clone().requires_grad_()
        loss, metrics = policy_loss(
            log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings,
            behaviour_log_probs=behaviour,
        )  # fmt: skip
        loss.backward()
        results.append((loss.detach(), log_probs.grad, metrics))
    for loss, grad, metrics in results[1:]:
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(loss, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)
        for key, value in results[0][2].items():
            torch.testing.assert_close(metrics[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("importance_sampling", ["seq", "token"])
def test_micro_batch_split_equals_whole(importance_sampling, name):
    batch = make_batch(seed=25, extra=4)
    behaviour = behaviour_of(batch, seed=4)
    settings = PolicyLossSettings(
        importance_sampling=importance_sampling, clip_low=batch.clip_low,
        clip_high=batch.clip_high, loss_agg_mode="seq-mean-token-mean",
        rollout_correction=correction_of(name), norm_length=WIDTH,
    )  # fmt: skip
    lengths = batch.mask.sum(-1).double()
    denominators = {
        "num_sequences": float((lengths > 0).sum()),
        "num_tokens": float(lengths.sum()),
    }

    def run(rows, log_probs):
        return policy_loss(
            log_probs[rows], batch.old_log_probs[rows], batch.advantages[rows], batch.mask[rows],
            settings, behaviour_log_probs=behaviour[rows], sequence_lengths=lengths[rows],
            **denominators,
        )  # fmt: skip

    whole_lp = batch.log_probs.clone().requires_grad_()
    whole_loss, whole_metrics = run(slice(None), whole_lp)
    whole_loss.backward()
    split_lp = batch.log_probs.clone().requires_grad_()
    summed: dict[str, torch.Tensor] = {}
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 5), slice(5, 6), slice(6, 12)):
        loss, metrics = run(rows, split_lp)
        loss.backward()
        total = total + loss.detach()
        for key, value in metrics.items():
            if key.endswith("_max"):
                summed[key] = torch.maximum(summed.get(key, value), value)
            elif key.endswith("_min"):
                summed[key] = torch.minimum(summed.get(key, value), value)
            else:
                summed[key] = summed.get(key, 0.0) + value
    torch.testing.assert_close(total, whole_loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_lp.grad, whole_lp.grad, rtol=1e-12, atol=1e-14)
    for key, value in whole_metrics.items():
        torch.testing.assert_close(summed[key], value, rtol=1e-12, atol=1e-14, msg=key)


def test_invalid_settings_raise():
    with pytest.raises(ValueError, match="from above"):
        RolloutCorrection(level="token", mode="truncate", high=2.0, low=0.5)
    with pytest.raises(ValueError, match="low < 1 < high"):
        RolloutCorrection(level="token", mode="mask", high=2.0)
    with pytest.raises(ValueError, match="level"):
        RolloutCorrection(level="geometric", mode="mask", low=0.5, high=2.0)
    batch = make_batch()
    settings = PolicyLossSettings(
        importance_sampling="token", clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean",
        rollout_correction=correction_of("token_truncate"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="behaviour_log_probs"):
        policy_loss(batch.log_probs, batch.old_log_probs, batch.advantages, batch.mask, settings)


def test_log_prob_gap_by_hand():
    trainer = [torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-0.5, -9.0])]
    rollout = [torch.tensor([-1.5, -2.0, -2.0]), torch.tensor([-0.25, 0.0])]
    masks = [torch.tensor([True, True, True]), torch.tensor([True, False])]
    gap = log_prob_gap(trainer, rollout, masks)
    assert gap["rollout_log_prob_abs_diff"] == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    k3 = [math.exp(x) - x - 1 for x in (-0.5, 0.0, 1.0, 0.25)]  # x = rollout - trainer
    assert gap["rollout_kl_k3"] == pytest.approx(sum(k3) / 4)
    per_sequence = [(-6.0 / 3) - (-5.5 / 3), -0.5 - (-0.25)]
    assert gap["rollout_log_ppl_diff"] == pytest.approx(sum(per_sequence) / 2)
    assert gap["rollout_log_ppl_abs_diff"] == pytest.approx(sum(map(abs, per_sequence)) / 2)
    assert log_prob_gap(trainer, rollout, [m & False for m in masks]) == {}


def test_log_prob_gap_matches_its_definition_sequence_by_sequence():
    """The batched computation against the definition written per sequence in float64, with
    sequences of other lengths, some without a loss token (left out of the per-sequence mean)."""
    generator = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 4, 7, 3]
    trainer = [-torch.rand(n, generator=generator) * 3 for n in lengths]
    rollout = [t + 0.1 * torch.randn(t.shape, generator=generator) for t in trainer]
    masks = [torch.rand(n, generator=generator) < 0.7 for n in lengths]
    masks[1][:] = False
    masks[4][:] = False
    own = [t.double()[m] for t, m in zip(trainer, masks) if m.any()]
    engine = [r.double()[m] for r, m in zip(rollout, masks) if m.any()]
    own_all, engine_all = torch.cat(own), torch.cat(engine)
    log_ratio = engine_all - own_all
    per_sequence = torch.stack([o.mean() - e.mean() for o, e in zip(own, engine)])
    gap = log_prob_gap(trainer, rollout, masks)
    assert gap["rollout_log_prob_abs_diff"] == pytest.approx(
        float((own_all - engine_all).abs().mean()), rel=1e-12
    )
    assert gap["rollout_kl_k3"] == pytest.approx(
        float((log_ratio.exp() - log_ratio - 1).mean()), rel=1e-12
    )
    assert gap["rollout_log_ppl_diff"] == pytest.approx(float(per_sequence.mean()), rel=1e-12)
    assert gap["rollout_log_ppl_abs_diff"] == pytest.approx(
        float(per_sequence.abs().mean()), rel=1e-12
    )
    assert log_prob_gap([], [], []) == {}
