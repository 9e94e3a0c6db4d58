"""The engines of a run's extra models (``models.<role>``: a teacher, a judge, ...), one per role.

The policy's engine is :mod:`megatron_gspo.rollout.factory`'s; an extra model is served by its
own engine, built from its own section (:class:`~megatron_gspo.config.ExtraModelConfig`): its
weights come from its Hugging Face directory once, at start, and no weight sync ever reaches it.

=============  ==================================================================================
``embedded``   an :class:`EmbeddedEngine` in this process, in the section's dtype, its weights
               read from ``hf_path``.
``sglang``     an :class:`SGLangEngine` on the servers the section's ``sglang`` keys list or
               launch (launched from ``hf_path``, with ``--dtype`` from the section).
=============  ==================================================================================

Every engine is registered in the run's exit stack as soon as it exists, so it is released on
any exit, also when a later one fails to start. The start-up check of the section
(:func:`role_start_problems`) reads every model's directory and tokenizer before anything is
built, all problems at once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import ExitStack
from typing import Any, Optional

import torch

from megatron_gspo.config import (
    SAME_TOKENIZER_ROLES,
    ConfigError,
    ExtraModelConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
)
from megatron_gspo.convert.hf_config import read_hf_config, resolve_model_config
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang_engine import build_sglang_engine, sglang_unavailable
from megatron_gspo.rollout.types import EngineOptions, RolloutEngine

logger = logging.getLogger(__name__)


def role_model_config(model: ExtraModelConfig) -> ModelConfig:
    """The architecture and sizes of an extra model, read from its ``config.json``."""
    return resolve_model_config(ModelConfig(hf_path=model.hf_path))


def build_role_engine(
    role: str, model: ExtraModelConfig, *, work_dir: Optional[str] = None
) -> RolloutEngine:
    """The engine of one extra model (the module docstring's table)."""
    model_config = role_model_config(model)
    if model.engine == "embedded":
        engine = EmbeddedEngine(
            model_config,
            dtype=getattr(torch, model.dtype),
            max_batch_size=model.embedded_max_batch_size,
        )
        try:
            engine.load_weights_from_directory(model.hf_path, version=0)
        except BaseException:
            engine.close()
            raise
        return engine
    sglang = model.sglang
    if sglang.launch and not sglang.urls and "--dtype" not in sglang.extra_args:
        sglang = dataclasses.replace(
            sglang, extra_args=[*sglang.extra_args, "--dtype", model.dtype]
        )
    # The policy's SGLang builder on a rollout section of this model's keys; the disk transport
    # is never used (no sync reaches an extra model) and needs no server-side setup.
    rollout = RolloutConfig(
        engine="sglang",
        sglang=sglang,
        weight_transport="disk",
        request_timeout_s=model.request_timeout_s,
        max_retries=model.max_retries,
        max_concurrency=model.max_concurrency,
    )
    return build_sglang_engine(rollout, model_config, EngineOptions(work_dir=work_dir or None))


def build_role_engines(cfg: TrainConfig, stack: ExitStack) -> dict[str, RolloutEngine]:
    """One engine per extra model of ``cfg.models``, by role name, each registered in ``stack``
    (released on any exit) as soon as it exists. Empty when the run has no extra model."""
    engines: dict[str, RolloutEngine] = {}
    for role, model in cfg.models.items():
        work_dir = os.path.join(cfg.output_dir, "models", role)
        engine = stack.enter_context(build_role_engine(role, model, work_dir=work_dir))
        logger.info("model %r: %s engine from %s", role, model.engine, model.hf_path)
        engines[role] = engine
    return engines


# ------------------------------------------------------------------------------------------------
# Start-up checks
# ------------------------------------------------------------------------------------------------


def role_start_problems(cfg: TrainConfig, policy_tokenizer: Any = None) -> list[ConfigError]:
    """Every problem of ``cfg.models`` found before anything is built: each directory exists
    and holds a readable config.json and safetensors; the roles that need the policy's
    tokenizer (:data:`SAME_TOKENIZER_ROLES`, and the distillation teacher) have one equal to
    ``policy_tokenizer`` (skipped when it is None: the policy's tokenizer could not be built,
    which its own check reports); launched SGLang servers have an interpreter with sglang."""
    errors: list[ConfigError] = []
    teacher = cfg.algo.distillation.teacher if cfg.algo.distillation.enabled else None
    for role, model in cfg.models.items():
        key = f"models.{role}"
        directory_errors = _directory_problems(key, model.hf_path)
        errors += directory_errors
        same_tokenizer = role in SAME_TOKENIZER_ROLES or role == teacher
        if same_tokenizer and not directory_errors and policy_tokenizer is not None:
            problem = tokenizer_difference(model.hf_path, policy_tokenizer)
            if problem is not None:
                errors.append(
                    ConfigError(
                        f"{key}.hf_path",
                        f"the {role}'s tokenizer differs from the policy's: {problem}",
                        f"the {role} scores the policy's token ids, which must mean the same "
                        "text to both; cross-tokenizer distillation is not supported "
                        "(docs/distillation.md)",
                        f"use a {role} that shares the policy's tokenizer (save the policy's "
                        f"tokenizer into {model.hf_path} if it is the same one)",
                    )
                )
        if model.engine == "sglang" and model.sglang.launch and model.sglang.python:
            problem = sglang_unavailable(model.sglang.python)
            if problem:
                errors.append(
                    ConfigError(
                        f"{key}.sglang.python",
                        f"{model.sglang.python!r} cannot start SGLang: {problem}",
                        f"launched servers run `<{key}.sglang.python> -m sglang.launch_server`",
                        "give the bin/python of a virtual environment with sglang installed",
                    )
                )
    return errors


def _directory_problems(key: str, hf_path: Optional[str]) -> list[ConfigError]:
    if not hf_path:
        return []  # the configuration's own check reports it
    if not os.path.isdir(hf_path) or not os.access(hf_path, os.R_OK | os.X_OK):
        return [
            ConfigError(
                f"{key}.hf_path",
                f"{hf_path!r} is not a readable directory",
                "the model's weights, config.json and tokenizer are read from it at start",
                f"point {key}.hf_path at a directory written by save_pretrained or "
                "tools/convert_checkpoint.py",
            )
        ]
    errors = []
    try:
        config = read_hf_config(hf_path)
        resolve_model_config(ModelConfig(hf_path=hf_path))
    except ConfigError as error:
        # The reader names the policy's key (model.hf_path); the problem is this model's.
        errors.append(_rekeyed(error, f"{key}.hf_path"))
        config = None
    if config is not None and not any(
        name.endswith(".safetensors") for name in os.listdir(hf_path)
    ):
        errors.append(
            ConfigError(
                f"{key}.hf_path",
                f"{hf_path!r} holds no *.safetensors file",
                "the model's weights are read from its safetensors files",
                "export the weights into it (tools/convert_checkpoint.py, save_pretrained)",
            )
        )
    return errors


def _rekeyed(error: ConfigError, key: str) -> ConfigError:
    """``error`` (what / why / fix) reported at ``key``."""
    first, *rest = str(error).split("\n")
    what = first.split("': ", 1)[-1]
    why = next((line.split("why: ", 1)[1] for line in rest if "why: " in line), "")
    fix = next((line.split("fix: ", 1)[1] for line in rest if "fix: " in line), "")
    return ConfigError(key, what, why, fix.replace("model.hf_path", key))


def tokenizer_difference(hf_path: str, policy_tokenizer: Any) -> Optional[str]:
    """How the tokenizer in ``hf_path`` differs from ``policy_tokenizer`` (None: they are
    equal): its vocabulary (every token string and id, added tokens included) and its special
    tokens."""
    from transformers import AutoTokenizer

    try:
        other = AutoTokenizer.from_pretrained(hf_path)
    except (OSError, ValueError) as error:
        return f"no tokenizer can be loaded from {hf_path!r} ({type(error).__name__}: {error})"
    ours, theirs = policy_tokenizer.get_vocab(), other.get_vocab()
    if ours != theirs:
        only_ours = sorted(set(ours.items()) - set(theirs.items()))[:3]
        only_theirs = sorted(set(theirs.items()) - set(ours.items()))[:3]
        return (
            f"vocabularies differ ({len(ours)} vs {len(theirs)} tokens; only the policy's: "
            f"{only_ours}, only the model's: {only_theirs})"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(policy_tokenizer, name, None) != getattr(other, name, None):
            return f"{name} {getattr(policy_tokenizer, name, None)} vs {getattr(other, name, None)}"
    return None
