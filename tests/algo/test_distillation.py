"""On-policy distillation's advantages against float64 references written from the formulas of
docs/distillation.md (one loop per sample and token, no tensor tricks)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import (
    DistillationSettings,
    distillation_advantages,
    distillation_settings,
    policy_loss,
    policy_loss_settings,
    teacher_reverse_kl,
)
from megatron_gspo.config import AlgoConfig, DistillationConfig


def _inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 3, 4, 0]  # the last sample is aborted: no token counts
    width = max(lengths)
    student = -torch.rand(len(lengths), width, generator=generator, dtype=torch.float64) * 3
    teacher = -torch.rand(len(lengths), width, generator=generator, dtype=torch.float64) * 3
    mask = torch.zeros(len(lengths), width, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    mask[0, 1] = False  # a masked position inside a response
    # Padding and masked positions may hold anything; they must not reach any output.
    student[~mask] = float("nan")
    teacher[~mask] = -float("inf")
    sequence_advantages = torch.tensor([0.5, -1.0, 1.5, 0.0], dtype=torch.float64)
    return student, teacher, mask, sequence_advantages


def _reference(student, teacher, mask, base, *, mode, coef, sequence_mean):
    """Float64 loops: per token A_t = [A] - coef * (s_t - t_t), or the sequence mean of it."""
    batch, width = mask.shape
    per_token = [[0.0] * width for _ in range(batch)]
    per_sequence = [0.0] * batch
    kl_sum, kl_tokens, sequence_sums = 0.0, 0, []
    for row in range(batch):
        values = [
            float(student[row, t]) - float(teacher[row, t]) for t in range(width) if mask[row, t]
        ]
        kl_sum += sum(values)
        kl_tokens += len(values)
        if values:
            sequence_sums.append(sum(values))
        rl = 0.0 if mode == "pure" else float(base[row])
        mean = sum(values) / len(values) if values else 0.0
        per_sequence[row] = rl - coef * mean
        for t in range(width):
            if mask[row, t]:
                kl = float(student[row, t]) - float(teacher[row, t])
                per_token[row][t] = rl - coef * kl
    metrics = {
        "teacher_kl_per_token": kl_sum / kl_tokens,
        "teacher_kl_per_sequence": sum(sequence_sums) / len(sequence_sums),
    }
    if sequence_mean:
        return torch.tensor(per_sequence, dtype=torch.float64), metrics
    return torch.tensor(per_token, dtype=torch.float64), metrics


@pytest.mark.parametrize("mode", ["pure", "added"])
@pytest.mark.parametrize("sequence_mean", [False, True])
def test_advantages_match_the_float64_formula(mode, sequence_mean):
    student, teacher, mask, base = _inputs()
    settings = DistillationSettings(mode=mode, kl_coef=0.7, sequence_mean=sequence_mean)
    advantages, metrics = distillation_advantages(base, student, teacher, mask, settings)
    expected, expected_metrics = _reference(
        student, teacher, mask, base, mode=mode, coef=0.7, sequence_mean=sequence_mean
    )
    assert advantages.dtype == torch.float32
    assert advantages.shape == expected.shape
    torch.testing.assert_close(advantages.double(), expected, rtol=1e-6, atol=1e-6)
    for name, value in expected_metrics.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-12), name
    assert torch.isfinite(advantages).all()
    if not sequence_mean:
        assert (advantages[~mask] == 0).all()  # masked positions carry no advantage


def test_added_to_per_token_advantages():
    """RL advantages already per token (KL-in-reward, per-turn): the term adds token by token,
    or as the sequence mean on every token of the sequence."""
    student, teacher, mask, _ = _inputs(seed=1)
    base = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    kl = torch.where(mask, student - teacher, torch.zeros((), dtype=torch.float64))
    per_token, _ = distillation_advantages(
        base, student, teacher, mask, DistillationSettings("added", kl_coef=2.0)
    )
    torch.testing.assert_close(per_token.double(), torch.where(mask, base - 2.0 * kl, 0.0))
    sequence, _ = distillation_advantages(
        base, student, teacher, mask, DistillationSettings("added", 2.0, sequence_mean=True)
    )
    mean = kl.sum(1) / mask.sum(1).clamp(min=1)
    expected = torch.where(mask, base - 2.0 * mean.unsqueeze(1), 0.0)
    torch.testing.assert_close(sequence.double(), expected, rtol=1e-6, atol=1e-6)


def test_reverse_kl_is_masked_and_signed():
    student = torch.tensor([[-1.0, -2.0, float("nan")]])
    teacher = torch.tensor([[-3.0, -0.5, 0.0]])
    mask = torch.tensor([[True, True, False]])
    kl = teacher_reverse_kl(student, teacher, mask)
    assert kl.dtype == torch.float64
    assert kl.tolist() == [[2.0, -1.5, 0.0]]


def test_pure_distillation_gradient_lowers_the_reverse_kl():
    """The surrogate's gradient with A_t = -(log pi_s - log pi_t) moves a softmax student
    towards the teacher: the exact reverse KL over a small vocabulary falls after a step."""
    torch.manual_seed(0)
    vocab, steps = 6, 25
    teacher_logits = torch.randn(vocab, dtype=torch.float64) * 2
    student_logits = torch.zeros(vocab, dtype=torch.float64, requires_grad=True)
    teacher_log_probs = torch.log_softmax(teacher_logits, -1)
    settings = policy_loss_settings(
        AlgoConfig(importance_sampling="token", clip_low=0.2, clip_high=0.2)
    )

    def reverse_kl() -> float:
        log_probs = torch.log_softmax(student_logits.detach(), -1)
        return float((log_probs.exp() * (log_probs - teacher_log_probs)).sum())

    start = reverse_kl()
    for _ in range(steps):
        log_probs = torch.log_softmax(student_logits, -1)
        tokens = torch.multinomial(log_probs.detach().exp(), 64, replacement=True)
        token_log_probs = log_probs[tokens].reshape(64, 1)
        advantages, _ = distillation_advantages(
            torch.zeros(64),
            token_log_probs.detach(),
            teacher_log_probs[tokens].reshape(64, 1),
            torch.ones(64, 1, dtype=torch.bool),
            DistillationSettings("pure"),
        )
        loss, _ = policy_loss(
            token_log_probs,
            token_log_probs.detach(),
            advantages.double(),
            torch.ones(64, 1, dtype=torch.bool),
            settings,
        )
        (gradient,) = torch.autograd.grad(loss, student_logits)
        with torch.no_grad():
            student_logits -= 0.5 * gradient  # plain SGD
    assert reverse_kl() < 0.2 * start, (start, reverse_kl())


def test_settings_from_the_configuration():
    assert distillation_settings(AlgoConfig()) is None
    sequence = distillation_settings(
        AlgoConfig(distillation=DistillationConfig(mode="added", kl_coef=0.5))
    )
    assert sequence == DistillationSettings("added", 0.5, sequence_mean=True)
    token = distillation_settings(
        AlgoConfig(importance_sampling="seq_token", distillation=DistillationConfig(mode="pure"))
    )
    assert token == DistillationSettings("pure", 1.0, sequence_mean=False)
    with pytest.raises(ValueError, match="mode"):
        DistillationSettings("reverse")
    with pytest.raises(ValueError, match="kl_coef"):
        DistillationSettings("pure", kl_coef=0.0)
    assert math.isclose(DistillationSettings("pure").kl_coef, 1.0)
