"""The algorithm core's settings built from the configuration's ``algo`` section, once per run.

The configuration says which settings values its keys make (``AlgoConfig.policy_loss_fields``,
``advantage_fields``, ``RolloutCorrectionConfig.fields``) and checks them with the rules the
settings check when built (:mod:`megatron_gspo.config.loss_rules`); the objects are built here,
on the algorithm core's side, so that the configuration never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_gspo.algo.advantages import AdvantageSettings
from megatron_gspo.algo.corrections import RolloutCorrection
from megatron_gspo.algo.distillation import DistillationSettings
from megatron_gspo.algo.losses import PolicyLossSettings

if TYPE_CHECKING:
    from megatron_gspo.config import AlgoConfig, RolloutCorrectionConfig


def rollout_correction(config: RolloutCorrectionConfig) -> Optional[RolloutCorrection]:
    """The :class:`RolloutCorrection` of ``algo.rollout_correction``, or None (off)."""
    fields = config.fields()
    return None if fields is None else RolloutCorrection(**fields)


def policy_loss_settings(algo: AlgoConfig) -> PolicyLossSettings:
    """The settings of :func:`megatron_gspo.algo.policy_loss` for ``algo``."""
    return PolicyLossSettings(
        **algo.policy_loss_fields(), rollout_correction=rollout_correction(algo.rollout_correction)
    )


def advantage_settings(algo: AlgoConfig) -> AdvantageSettings:
    """The settings of :func:`megatron_gspo.algo.compute_advantages` for ``algo``."""
    return AdvantageSettings(**algo.advantage_fields())


def distillation_settings(algo: AlgoConfig) -> Optional[DistillationSettings]:
    """The :class:`DistillationSettings` of ``algo.distillation``, or None (off). GSPO's
    sequence ratio (``importance_sampling=seq``) gets the sequence mean of the teacher's term."""
    distillation = algo.distillation
    if not distillation.enabled:
        return None
    return DistillationSettings(
        mode=distillation.mode,
        kl_coef=distillation.kl_coef,
        sequence_mean=algo.importance_sampling == "seq",
    )
