"""Start-up checks: everything that can be checked without building the model, checked before it,
and every problem reported at once.

Building the model, the optimizer and the rollout engine takes seconds to minutes; a typo in a
data path found afterwards costs that much per attempt, and one problem at a time. So before
:func:`megatron_gspo.loop.run`, the driver (global rank 0, which owns data, rewards, rollout and
logs) calls :func:`check_before_start`, which checks

- the output folder (a fresh run must not overwrite another run's metrics or checkpoints),
- the model directory (``model.hf_path``) and ``checkpoint.load_path``,
- the prompt files (every malformed row with its file and line), the tokenizer and that its ids
  fit ``model.vocab_size``,
- the reward functions (names, imports, options, their start-up checks: the code reward's
  sandbox) and the environment (``env.name``: name, import, options, its start-up check: the
  tool sandbox),
- the SGLang servers (reachable) or what launching them needs,

and raises one :class:`StartupErrors` listing each problem as what / why / how to fix.
:func:`prepare_output_dir` then clears the previous run's outputs when ``overwrite_output_dir``
allows it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megatron_gspo.checkpoint_files import checkpoint_root
from megatron_gspo.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)

SERVER_CHECK_TIMEOUT_S = 5.0
"""How long a configured SGLang server may take to answer ``/health`` at start-up."""


class StartupErrors(ConfigError):
    """Every problem found before start, each a :class:`ConfigError`."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        self.key = self.errors[0].key
        count = f"{len(errors)} problem{'s' if len(errors) > 1 else ''}"
        body = "\n\n".join(str(error) for error in self.errors)
        ValueError.__init__(self, f"{count} found before start:\n\n{body}")


def check_before_start(cfg: TrainConfig) -> None:
    """Raise :class:`StartupErrors` with every problem of the checks in the module docstring."""
    errors: list[ConfigError] = []
    for check in (
        _output_dir,
        _load_path,
        _data_and_tokenizer,
        _rewards,
        _environment,
        _rollout_servers,
    ):
        errors += check(cfg)
    if errors:
        raise StartupErrors(errors)


def prepare_output_dir(cfg: TrainConfig) -> None:
    """With ``overwrite_output_dir=true`` on a fresh run, delete the previous run's metrics,
    TensorBoard logs and checkpoints, so that the new run's outputs are not mixed with them."""
    if cfg.resume or not cfg.overwrite_output_dir:
        return
    for path in previous_run_outputs(cfg.output_dir):
        logger.warning("overwrite_output_dir=true: removing %s of a previous run", path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def previous_run_outputs(output_dir: str) -> list[Path]:
    """What a run leaves in ``output_dir`` and a fresh run would overwrite or mix with its own:
    a non-empty ``metrics.jsonl``, a ``checkpoints/`` folder with ``step_*`` folders in it, a
    ``tensorboard/`` folder."""
    root = Path(output_dir)
    found = []
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    checkpoints = Path(checkpoint_root(output_dir))
    if checkpoints.is_dir() and any(checkpoints.glob("step_*")):
        found.append(checkpoints)
    if found and (root / "tensorboard").is_dir():
        found.append(root / "tensorboard")
    return found


# --------------------------------------------------------------------------------------------
# The checks: each returns its problems, never raises
# --------------------------------------------------------------------------------------------


def _output_dir(cfg: TrainConfig) -> list[ConfigError]:
    if cfg.resume or cfg.overwrite_output_dir:
        return []
    previous = previous_run_outputs(cfg.output_dir)
    if not previous:
        return []
    return [
        ConfigError(
            "output_dir",
            f"{cfg.output_dir} already holds a run ({', '.join(p.name for p in previous)})",
            "a fresh run would truncate its metrics.jsonl and overwrite or mix in its checkpoints",
            "continue that run with resume=true, choose another output_dir, or set "
            "overwrite_output_dir=true to delete its outputs first",
        )
    ]


def _load_path(cfg: TrainConfig) -> list[ConfigError]:
    path = cfg.checkpoint.load_path
    if path is None or os.path.isdir(path):
        return []
    return [
        ConfigError(
            "checkpoint.load_path",
            f"{path} is not a directory",
            "the initial weights are read from a Megatron checkpoint directory",
            "point checkpoint.load_path at a checkpoint (or its root), or set it to null",
        )
    ]


def _data_and_tokenizer(cfg: TrainConfig) -> list[ConfigError]:
    from megatron_gspo.data.prompts import check_prompt_file
    from megatron_gspo.data.synthetic import check_task
    from megatron_gspo.data.tokenizer import load_tokenizer

    errors = []
    data = cfg.data
    if data.train_path is None:
        errors += _collect(lambda: check_task(data.task))
    for key in ("train_path", "eval_path"):
        path = getattr(data, key)
        if path is None:
            continue
        problems = check_prompt_file(path, prompt_key=data.prompt_key, answer_key=data.answer_key)
        if problems:
            errors.append(
                ConfigError(
                    f"data.{key}",
                    "\n    ".join(["the prompt file has problems:", *problems]),
                    "each line (row) must be an object with a prompt (a string or chat messages) "
                    f"under {data.prompt_key!r} and an optional answer under {data.answer_key!r}",
                    f"repair the rows listed, or point data.{key} at another file",
                )
            )
    model, model_errors = _resolved_model(cfg)
    errors += model_errors
    tokenizer_dir = data.tokenizer_path or cfg.model.hf_path
    if data.train_path is not None and tokenizer_dir and not os.path.isdir(tokenizer_dir):
        errors.append(
            ConfigError(
                "data.tokenizer_path",
                f"{tokenizer_dir} is not a directory",
                "the prompts are tokenized with the Hugging Face tokenizer of that directory",
                "point data.tokenizer_path (or model.hf_path) at a model directory",
            )
        )
    elif model is not None:
        errors += _collect(lambda: load_tokenizer(data, model))
    return errors


def _resolved_model(cfg: TrainConfig):
    """The model section completed from ``model.hf_path`` (None, errors when it cannot be)."""
    if cfg.model.hf_path is None:
        return cfg.model, []
    if not os.path.isdir(cfg.model.hf_path):
        return None, [
            ConfigError(
                "model.hf_path",
                f"{cfg.model.hf_path} is not a directory",
                "the model's architecture and first weights are read from it",
                "point model.hf_path at a Hugging Face model directory (config.json + "
                "safetensors), or set it to null for a model from the config",
            )
        ]
    from megatron_gspo.convert.hf_config import resolve_model_config

    resolved = []
    errors = _collect(lambda: resolved.append(resolve_model_config(cfg.model)))
    return (resolved[0] if resolved else None), errors


def _rewards(cfg: TrainConfig) -> list[ConfigError]:
    from megatron_gspo.reward.functions import (
        check_reward_function,
        load_reward_function,
        reward_specs,
    )

    errors = []
    for spec in reward_specs(cfg.reward.functions, cfg.reward.weights, cfg.reward.options):
        errors += _collect(
            lambda spec=spec: check_reward_function(spec, load_reward_function(spec))
        )
    return errors


def _environment(cfg: TrainConfig) -> list[ConfigError]:
    if cfg.env.name is None:
        return []
    from megatron_gspo.envs.base import EnvironmentSpec, load_environment

    return _collect(lambda: load_environment(EnvironmentSpec(cfg.env.name, dict(cfg.env.options))))


def _rollout_servers(cfg: TrainConfig) -> list[ConfigError]:
    rollout = cfg.rollout
    if rollout.engine != "sglang":
        return []
    if rollout.sglang_urls:
        return [error for url in rollout.sglang_urls if (error := _unreachable(url)) is not None]
    if not rollout.sglang_launch:
        return [
            ConfigError(
                "rollout.sglang_urls",
                "no SGLang server to use",
                "rollout.engine=sglang needs running servers or permission to launch them",
                "set rollout.sglang_urls=[http://host:port, ...] or rollout.sglang_launch=true",
            )
        ]
    errors = []
    if cfg.model.hf_path is None:
        errors.append(
            ConfigError(
                "model.hf_path",
                "SGLang needs a Hugging Face model directory to start from",
                "launched servers load their first weights from disk",
                "set model.hf_path (export one with tools/convert_checkpoint.py)",
            )
        )
    if rollout.sglang_python:
        problem = sglang_unavailable(rollout.sglang_python)
        if problem:
            errors.append(
                ConfigError(
                    "rollout.sglang_python",
                    f"{rollout.sglang_python!r} cannot start SGLang: {problem}",
                    "launched servers run `<sglang_python> -m sglang.launch_server`",
                    "give the bin/python of a virtual environment with sglang installed, or leave "
                    "rollout.sglang_python empty to use this interpreter",
                )
            )
    elif importlib.util.find_spec("sglang") is None:
        errors.append(
            ConfigError(
                "rollout.sglang_launch",
                "sglang is not installed in this Python environment",
                "launched servers run `python -m sglang.launch_server` with this interpreter",
                "install sglang (the GPU image has it), set rollout.sglang_python to the "
                "interpreter of SGLang's own environment, or start servers elsewhere and list "
                "them in rollout.sglang_urls",
            )
        )
    return errors


def sglang_unavailable(python: str) -> Optional[str]:
    """Why ``python`` cannot run ``-m sglang.launch_server`` (None when it can): not an
    executable, or sglang not importable there (found without importing it: seconds, not the
    half minute an import of sglang takes)."""
    import subprocess

    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return "no executable file there"
    try:
        found = subprocess.run(
            [
                python,
                "-c",
                "import importlib.util, sys; sys.exit(not importlib.util.find_spec('sglang'))",
            ],
            capture_output=True,
            timeout=SERVER_CHECK_TIMEOUT_S * 6,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"running it failed ({type(error).__name__})"
    return None if found.returncode == 0 else "sglang is not installed in its environment"


def _unreachable(url: str):
    """A :class:`ConfigError` when nothing answers at ``url`` (any HTTP answer counts)."""
    import requests

    try:
        requests.get(url.rstrip("/") + "/health", timeout=SERVER_CHECK_TIMEOUT_S)
    except requests.RequestException as error:
        return ConfigError(
            "rollout.sglang_urls",
            f"{url} does not answer ({type(error).__name__}: {_first_line(error)})",
            "every listed SGLang server serves rollouts from the first step on",
            "start the server (examples/moe/sglang_server.sh), fix the address, or leave "
            "rollout.sglang_urls empty with rollout.sglang_launch=true",
        )
    return None


def _collect(check: Callable[[], object]) -> list[ConfigError]:
    try:
        check()
    except ConfigError as error:
        return [error]
    return []


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""
