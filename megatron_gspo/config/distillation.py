"""On-policy distillation's section of the configuration (``algo.distillation.*``); part of the
one configuration tree, :mod:`megatron_gspo.config`, whose rules hold here: every default lives
here once, with its source.

The student (the policy) samples as in RL; the teacher (the extra model ``models.<teacher>``)
scores the student's tokens; the per-token reverse KL estimate ``log pi_student - log
pi_teacher`` enters the advantages (formulas: :mod:`megatron_gspo.algo.distillation`,
docs/distillation.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gspo.config.schema import ConfigError, check_choice, check_positive

DISTILLATION_MODES = ("off", "pure", "added")
"""What ``algo.distillation.mode`` may name."""


@dataclass
class DistillationConfig:
    """On-policy distillation from a teacher model (docs/distillation.md)."""

    mode: str = "off"
    """off; pure: the advantage of each token is -kl_coef x (log pi_student - log pi_teacher),
    rewards do not enter it (the student minimises the reverse KL: on-policy distillation,
    Agarwal et al. 2024 / GKD with lambda=1, Thinking Machines' on-policy distillation); added:
    the term is added to GSPO's/GRPO's advantage, A_it = A_i - kl_coef x (log pi_student - log
    pi_teacher)_t (slime's --opd-kl-coef). Per token with importance_sampling=seq_token or token;
    sequence GSPO (seq) gets each sequence's mean over its tokens (docs/distillation.md)."""
    kl_coef: float = 1.0
    """Coefficient of the reverse-KL term (slime's --opd-kl-coef, default 1)."""
    teacher: str = "teacher"
    """Role name of the teacher in ``models`` (its section: models.<teacher>)."""

    def __post_init__(self) -> None:
        check_choice(
            "algo.distillation.mode",
            self.mode,
            DISTILLATION_MODES,
            "distillation is off, the whole advantage, or a term added to the RL advantage",
        )
        check_positive("algo.distillation.kl_coef", self.kl_coef)
        if not self.teacher:
            raise ConfigError(
                "algo.distillation.teacher",
                "an empty role name",
                "it names the teacher's section in models",
                "set algo.distillation.teacher=teacher (and models.teacher.hf_path)",
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"
