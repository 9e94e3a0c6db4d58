"""Algorithm core: advantages, policy losses, KL. Pure torch; never imports Megatron.

Public API::

    from megatron_gspo.algo import (
        AdvantageSettings, PolicyLossSettings, RolloutCorrection, compute_advantages, policy_loss,
    )

Both take tensors (and, where a reduction crosses ranks, process groups) and one frozen settings
object built once per run from the configuration (:func:`policy_loss_settings`,
:func:`advantage_settings`), never a config object. The names the settings accept and the rules
they obey are the configuration's (:mod:`megatron_gspo.config.loss_rules`, torch-free), so the
configuration checks at start exactly what the settings check when built.
"""

from megatron_gspo.algo.advantages import (
    AdvantageSettings,
    RunningMoments,
    add_token_level_kl,
    compute_advantages,
    estimate_advantages,
    finish_advantages,
    group_statistics,
    normalize_rewards,
    turn_advantages,
    whiten,
)
from megatron_gspo.algo.corrections import (
    CorrectionWeights,
    RolloutCorrection,
    correction_metrics,
    correction_weights,
    finish_correction_metrics,
    log_prob_gap,
)
from megatron_gspo.algo.distillation import (
    DistillationSettings,
    distillation_advantages,
    teacher_reverse_kl,
)
from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.algo.losses import (
    RATIO_FUNCTIONS,
    PolicyLossSettings,
    aggregate,
    policy_loss,
    sequence_log_ratio,
)
from megatron_gspo.algo.settings import (
    advantage_settings,
    distillation_settings,
    policy_loss_settings,
    rollout_correction,
)
from megatron_gspo.config.loss_rules import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    SURROGATES,
    SettingsError,
)

__all__ = [
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "RATIO_FUNCTIONS",
    "SURROGATES",
    "AdvantageSettings",
    "CorrectionWeights",
    "DistillationSettings",
    "PolicyLossSettings",
    "RolloutCorrection",
    "RunningMoments",
    "SettingsError",
    "add_token_level_kl",
    "advantage_settings",
    "aggregate",
    "compute_advantages",
    "correction_metrics",
    "correction_weights",
    "distillation_advantages",
    "distillation_settings",
    "estimate_advantages",
    "finish_advantages",
    "finish_correction_metrics",
    "group_statistics",
    "kl_estimate",
    "log_prob_gap",
    "normalize_rewards",
    "policy_loss",
    "policy_loss_settings",
    "rollout_correction",
    "sequence_log_ratio",
    "teacher_reverse_kl",
    "turn_advantages",
    "whiten",
]
