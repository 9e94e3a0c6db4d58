"""On-policy distillation: the teacher's per-token signal in the advantages (pure torch).

Shapes: ``B`` samples, ``T`` response tokens (padded). The student (the policy) sampled the
response tokens ``y_t``; the teacher scored the same tokens (teacher-forced). Per token, the
reverse-KL estimate is

    kl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)

(the single-sample k1 estimate of KL(pi_student || pi_teacher) at step t, whose expectation
under the student's samples is the reverse KL). It enters the advantages in one of two forms
(docs/distillation.md):

- ``pure``: ``A_t = -kl_coef * kl_t``; rewards do not enter (the student minimises the reverse
  KL to the teacher on its own samples: on-policy distillation, GKD with lambda = 1, Thinking
  Machines' on-policy distillation, per-token discount 0);
- ``added``: ``A_t = A + -kl_coef * kl_t`` with ``A`` the RL advantage of the sequence (or of the
  token, when the RL advantages are already per token): slime's ``--opd-kl-coef``.

With GSPO's sequence ratio (``sequence_mean``) every token of a sequence is weighted by one
ratio, so a per-token signal would only count through its mean: the sequence gets
``-kl_coef * mean_t kl_t`` (its tokens' masked mean), one advantage per sequence. GSPO-token and
GRPO keep the per-token term.

The term is computed from detached log-probs (the student's old log-probs, before the update):
it is an advantage, not a loss, so its gradient flows through the policy ratio only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DISTILLATION_FORMS = ("pure", "added")


@dataclass(frozen=True)
class DistillationSettings:
    """How the teacher's reverse KL enters the advantages (module docstring), fixed for a run
    (built by :func:`megatron_gspo.algo.settings.distillation_settings`)."""

    mode: str
    """``pure`` (the advantage is the KL term alone) or ``added`` (added to the RL advantage)."""
    kl_coef: float = 1.0
    """Coefficient of the reverse-KL term (slime's ``--opd-kl-coef``)."""
    sequence_mean: bool = False
    """One term per sequence, the masked mean of its tokens' KL (GSPO's sequence ratio)."""

    def __post_init__(self) -> None:
        if self.mode not in DISTILLATION_FORMS:
            raise ValueError(f"distillation mode {self.mode!r} is not one of {DISTILLATION_FORMS}")
        if not self.kl_coef > 0:
            raise ValueError(f"distillation kl_coef={self.kl_coef} must be > 0")


def teacher_reverse_kl(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` float64 ``log pi_student - log pi_teacher`` per token, 0 at masked positions
    (padding may hold anything, non-finite values included)."""
    kl = student_log_probs.double() - teacher_log_probs.double()
    return torch.where(response_mask.bool(), kl, torch.zeros((), dtype=torch.float64))


def distillation_advantages(
    advantages: torch.Tensor,
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    settings: DistillationSettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The advantages with the teacher's term (module docstring).

    Args:
        advantages: the RL advantages, ``[B]`` or ``[B, T]`` (ignored by ``pure``).
        student_log_probs, teacher_log_probs, response_mask: ``[B, T]`` padded.
        settings: the form and coefficient.

    Returns:
        ``(advantages, metrics)``: ``[B]`` float32 with ``sequence_mean`` and sequence RL
        advantages, else ``[B, T]`` float32, 0 at masked positions; float64 0-d metrics
        ``teacher_kl_per_token`` (mean over the unmasked tokens of the batch) and
        ``teacher_kl_per_sequence`` (mean over the sequences with a token of their summed KL,
        the estimate of the sequence-level KL(pi_student || pi_teacher)).
    """
    mask = response_mask.bool()
    kl = teacher_reverse_kl(student_log_probs, teacher_log_probs, mask)
    tokens = mask.sum(dim=1)
    sequence_kl = kl.sum(dim=1)
    live = tokens > 0
    metrics = {
        "teacher_kl_per_token": kl.sum() / tokens.sum().clamp(min=1),
        "teacher_kl_per_sequence": sequence_kl[live].sum() / live.sum().clamp(min=1),
    }
    base = (
        torch.zeros(len(mask), dtype=torch.float64)
        if settings.mode == "pure"
        else advantages.double()
    )
    if settings.sequence_mean:
        term = -settings.kl_coef * sequence_kl / tokens.clamp(min=1)
        if base.dim() == 1:
            return (base + term).float(), metrics
        total = base + term.unsqueeze(1)
    else:
        expanded = base.unsqueeze(1).expand_as(kl) if base.dim() == 1 else base
        total = expanded - settings.kl_coef * kl
    return torch.where(mask, total, torch.zeros((), dtype=torch.float64)).float(), metrics
