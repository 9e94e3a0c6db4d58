"""The extra models of a run (``models.<role>.*``): a teacher, a judge, ... each behind its own
rollout engine; part of the one configuration tree, :mod:`megatron_gspo.config`, whose rules hold
here: every default lives here once, with its source.

The policy is the run's own model (``model.*``, served by ``rollout.*``). Every other model a run
uses has a role name (the key under ``models``) and a section of this type: its weights come
from its own Hugging Face directory and are never synced from the trainer; it runs embedded (a
transformers model in the trainer's process, in its own dtype) or on SGLang servers (launched
from ``hf_path`` or listed by URL, the ``rollout.sglang`` section's keys). The engines are built
by :func:`megatron_gspo.rollout.roles.build_role_engines`, registered in the run's exit stack,
and checked before start by :mod:`megatron_gspo.startup.preflight` (docs/distillation.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.schema import ConfigError, check_choice, check_positive
from megatron_gspo.config.sglang import SGLangConfig

MODEL_ENGINES = ("embedded", "sglang")
"""What ``models.<role>.engine`` may name."""
MODEL_DTYPES = ("float32", "bfloat16", "float16")
"""What ``models.<role>.dtype`` may name."""
SAME_TOKENIZER_ROLES = ("teacher",)
"""Roles whose model must use the policy's tokenizer: a teacher scores the student's token ids
(its log-probs of the same ids), so a different vocabulary makes the comparison meaningless.
Cross-tokenizer distillation is out of scope (docs/distillation.md)."""


@dataclass
class ExtraModelConfig:
    """One extra model of the run (``models.<role>``): its weights, its engine, its precision and
    its time limits. Never synced from the trainer."""

    hf_path: Optional[str] = None
    """Hugging Face model directory (config.json, safetensors and the tokenizer files): the
    model's weights, read once when its engine starts. Required."""
    engine: str = "embedded"
    """embedded: a transformers model in the trainer's process (the CPU path); sglang: SGLang
    servers, listed in ``sglang.urls`` or launched from hf_path with ``sglang.launch``."""
    dtype: str = "float32"
    """Parameter and compute dtype: of the embedded engine (as rollout.dtype), or the ``--dtype``
    of launched SGLang servers (listed servers run the dtype they were started with)."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """engine=sglang: the servers to use, or how to launch them (the keys of rollout.sglang;
    give each model its own sglang.port when several are launched)."""
    request_timeout_s: float = 600.0
    """Time limit of one call to the model's engine (an SGLang server's /generate)."""
    max_retries: int = 3
    """Retries of a request that failed in transport, with doubling backoff (engine=sglang)."""
    max_concurrency: int = 64
    """Most calls in flight to the model's servers (engine=sglang)."""
    embedded_max_batch_size: int = 64
    """Most sequences the embedded engine runs in one forward (engine=embedded)."""

    def __post_init__(self) -> None:
        check_choice("models.<role>.engine", self.engine, MODEL_ENGINES, "the model engines")
        check_choice("models.<role>.dtype", self.dtype, MODEL_DTYPES, "the supported dtypes")
        check_positive("models.<role>.request_timeout_s", self.request_timeout_s)
        check_positive("models.<role>.max_retries", self.max_retries, allow_zero=True)
        check_positive("models.<role>.max_concurrency", self.max_concurrency)
        check_positive("models.<role>.embedded_max_batch_size", self.embedded_max_batch_size)
        if self.sglang.release_memory:
            raise ConfigError(
                "models.<role>.sglang.release_memory",
                "release_memory=true for an extra model",
                "an extra model's servers get no weight syncs, after which released memory "
                "would come back",
                "set models.<role>.sglang.release_memory=false",
            )


def check_models(models: dict[str, ExtraModelConfig]) -> list[ConfigError]:
    """The problems of the ``models`` section that need no file or server (the role names,
    hf_path given; the start-up check reads the directories and asks the servers)."""
    errors = []
    for role, model in models.items():
        key = f"models.{role}"
        if role == "policy":
            errors.append(
                ConfigError(
                    key,
                    "an extra model named 'policy'",
                    "the policy is the run's own model (model.*, served by rollout.*)",
                    "give the extra model another role name, e.g. models.teacher",
                )
            )
        if not role.isidentifier():
            errors.append(
                ConfigError(
                    key,
                    f"role name {role!r} is not an identifier",
                    "role names are keys of the config and of the metrics",
                    "use letters, digits and underscores, e.g. models.teacher",
                )
            )
        if not model.hf_path:
            errors.append(
                ConfigError(
                    f"{key}.hf_path",
                    "no Hugging Face directory for the model",
                    "an extra model's weights come from its own directory, never from the trainer",
                    f"set {key}.hf_path=/path/to/hf_dir (export one with "
                    "tools/convert_checkpoint.py)",
                )
            )
        if model.engine == "sglang" and not model.sglang.urls and not model.sglang.launch:
            errors.append(
                ConfigError(
                    f"{key}.sglang.urls",
                    "engine=sglang with no server to use",
                    "the model's engine needs running servers or permission to launch them",
                    f"set {key}.sglang.urls=[http://host:port] or {key}.sglang.launch=true",
                )
            )
    return errors
