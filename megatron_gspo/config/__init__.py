"""The one typed configuration tree of megatron_gspo, its sections and their loader.

:mod:`~megatron_gspo.config.tree` holds :class:`TrainConfig` and the small sections; the model and
parallel sections live in :mod:`~megatron_gspo.config.model`, the algorithm's in
:mod:`~megatron_gspo.config.algo` (the name lists and rules it shares with the algorithm core's
settings in :mod:`~megatron_gspo.config.loss_rules`), the rollout's in
:mod:`~megatron_gspo.config.rollout` (the SGLang engine's own section in
:mod:`~megatron_gspo.config.sglang`), what they share (the error type, checks, dict conversion,
renamed keys) in :mod:`~megatron_gspo.config.schema`, Hydra composition in
:mod:`~megatron_gspo.config.loader` and user code named in a config in
:mod:`~megatron_gspo.config.import_paths`. Everything a user or another package imports is here.
"""

from megatron_gspo.config.agent import TOOL_CALL_FORMATS, AgentConfig
from megatron_gspo.config.algo import (
    CORRECTION_BOUNDS,
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    OLD_LOG_PROB_SOURCES,
    ROUTING_REPLAY_MODES,
    AlgoConfig,
    CispoConfig,
    GmpoConfig,
    RolloutCorrectionConfig,
)
from megatron_gspo.config.distillation import DISTILLATION_MODES, DistillationConfig
from megatron_gspo.config.judge import JUDGE_FORMATS, JUDGE_TEMPLATE_FIELDS, JudgeConfig
from megatron_gspo.config.loss_rules import (
    ADV_ESTIMATORS,
    IMPORTANCE_SAMPLING,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    SURROGATES,
)
from megatron_gspo.config.model import ARCHITECTURES, ModelConfig, ParallelConfig
from megatron_gspo.config.models import (
    MODEL_ENGINES,
    SAME_TOKENIZER_ROLES,
    ExtraModelConfig,
)
from megatron_gspo.config.rollout import (
    EMBEDDED_MAX_BATCH_SIZE,
    EMBEDDED_ROUTE_SOURCES,
    ROLLOUT_DTYPES,
    ROLLOUT_ENGINES,
    RolloutConfig,
)
from megatron_gspo.config.schema import (
    ConfigError,
    ConfigWarning,
    StartupErrors,
    from_dict,
    to_dict,
)
from megatron_gspo.config.sglang import SGLangConfig
from megatron_gspo.config.tree import (
    CheckpointConfig,
    DataConfig,
    EnvConfig,
    EvalConfig,
    LoggingConfig,
    OptimConfig,
    RewardConfig,
    TrainConfig,
)

__all__ = [
    "ADV_ESTIMATORS",
    "ARCHITECTURES",
    "AlgoConfig",
    "CORRECTION_BOUNDS",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "DISTILLATION_MODES",
    "DistillationConfig",
    "ExtraModelConfig",
    "MODEL_ENGINES",
    "SAME_TOKENIZER_ROLES",
    "CheckpointConfig",
    "CispoConfig",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "EMBEDDED_MAX_BATCH_SIZE",
    "EMBEDDED_ROUTE_SOURCES",
    "EnvConfig",
    "AgentConfig",
    "TOOL_CALL_FORMATS",
    "EvalConfig",
    "GmpoConfig",
    "IMPORTANCE_SAMPLING",
    "JUDGE_FORMATS",
    "JUDGE_TEMPLATE_FIELDS",
    "JudgeConfig",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LoggingConfig",
    "ModelConfig",
    "OLD_LOG_PROB_SOURCES",
    "OptimConfig",
    "ParallelConfig",
    "ROLLOUT_DTYPES",
    "ROLLOUT_ENGINES",
    "ROUTING_REPLAY_MODES",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SGLangConfig",
    "SURROGATES",
    "StartupErrors",
    "TrainConfig",
    "from_dict",
    "to_dict",
]
