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
- the rollout engine's own check (:data:`ENGINE_START_CHECKS`): for SGLang, the servers answer
  or what launching them needs is there (none for a replayed run, which starts no engine),
- a replayed run's recorded batches (``rollout.replay_dir``): one for every step,
- ``rollout.retokenize_responses``: the tokenizer is byte-level BPE (its tokens are byte
  strings to align the engine's log-probs on),
- the extra models (``models.<role>``: :func:`megatron_gspo.rollout.roles.role_start_problems`):
  their directories, and the policy's tokenizer where a role needs it (the teacher); the
  judge's own tokenizer (``reward.judge``: :func:`megatron_gspo.rollout.judge_backend.
  judge_start_problems`),

and raises one :class:`StartupErrors` listing each problem as what / why / how to fix.
:func:`prepare_output_dir` then clears the previous run's outputs when ``overwrite_output_dir``
allows it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megatron_gspo.config import ConfigError, TrainConfig
from megatron_gspo.config.schema import StartupErrors
from megatron_gspo.convert.hf_config import resolve_model_config
from megatron_gspo.convert.safetensors_io import damaged_safetensors
from megatron_gspo.data.prompts import check_prompt_file
from megatron_gspo.data.retokenization import token_byte_table
from megatron_gspo.data.synthetic import check_task
from megatron_gspo.data.tokenizer import load_tokenizer
from megatron_gspo.envs.base import EnvironmentSpec, load_environment
from megatron_gspo.reward.functions import check_reward_function, load_reward_function, reward_specs
from megatron_gspo.rollout.judge_backend import judge_start_problems
from megatron_gspo.rollout.roles import role_start_problems
from megatron_gspo.rollout.sglang_engine import sglang_start_problems
from megatron_gspo.runtime.checkpoint_files import checkpoint_root, latest_checkpoint
from megatron_gspo.samples.recorded_batch import (
    ROLLOUTS_DIR,
    check_recorded_batch,
    rollouts_directory,
)

logger = logging.getLogger(__name__)


def check_before_start(cfg: TrainConfig) -> None:
    """Raise :class:`StartupErrors` with every problem of the checks in the module docstring."""
    errors: list[ConfigError] = []
    for check in (
        _output_dir,
        _load_path,
        _data_and_tokenizer,
        _rewards,
        _environment,
        _rollout_engine,
        _replay,
        _retokenization,
        _extra_models,
        judge_start_problems,
    ):
        errors += check(cfg)
    if errors:
        raise StartupErrors(errors)


RUN_RECORDS = ("metrics.jsonl", "trained_prompts.jsonl", "tensorboard")
"""What a run writes at the top of its output folder besides checkpoints (the metric sinks and
the prompt ledger write them)."""


def prepare_output_dir(cfg: TrainConfig) -> None:
    """With ``overwrite_output_dir=true`` on a fresh run, delete the previous run's metrics,
    TensorBoard logs and checkpoints, so that the new run's outputs are not mixed with them.

    With ``resume=true`` nothing is deleted. A run that stopped before its first checkpoint
    (``_output_dir`` refuses to resume one that saves none) starts again from step 0, and its
    records are moved into ``before_resume_<k>/`` first, so that the restart, which rewrites
    them, destroys nothing."""
    if cfg.resume:
        _set_aside_unresumable_records(cfg.output_dir)
        return
    if not cfg.overwrite_output_dir:
        return
    for path in previous_run_outputs(cfg.output_dir):
        logger.warning("overwrite_output_dir=true: removing %s of a previous run", path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _set_aside_unresumable_records(output_dir: str) -> None:
    if latest_checkpoint(checkpoint_root(output_dir)) is not None:
        return
    root = Path(output_dir)
    records = [root / name for name in RUN_RECORDS if (root / name).exists()]
    if not records:
        return
    index = 0
    while (root / f"before_resume_{index}").exists():
        index += 1
    kept = root / f"before_resume_{index}"
    kept.mkdir()
    for path in records:
        path.rename(kept / path.name)
    logger.warning(
        "resume=true but %s holds no complete checkpoint: the run starts again from step 0; the "
        "records of the run that stopped before its first checkpoint are kept in %s",
        output_dir,
        kept,
    )


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
    rollouts = root / ROLLOUTS_DIR
    if rollouts.is_dir() and any(rollouts.glob("step_*.safetensors")):
        found.append(rollouts)
    return found


# --------------------------------------------------------------------------------------------
# The checks: each returns its problems, never raises
# --------------------------------------------------------------------------------------------


def _output_dir(cfg: TrainConfig) -> list[ConfigError]:
    """A fresh run never mixes with or truncates a previous run's outputs, and ``resume=true``
    never starts afresh over them: it needs a checkpoint to continue from. The fixes offered
    fit what the folder holds (resume only where a checkpoint exists)."""
    unwritable = _unwritable(cfg.output_dir)
    if unwritable is not None:
        return [
            ConfigError(
                "output_dir",
                f"cannot write to {cfg.output_dir}: {unwritable}",
                "the run writes its metrics, checkpoints and rollout files there",
                "choose a writable output_dir (a read-only mount or a folder of another user "
                "cannot hold a run)",
            )
        ]
    previous = previous_run_outputs(cfg.output_dir)
    if not previous or (cfg.overwrite_output_dir and not cfg.resume):
        return []
    checkpoint = latest_checkpoint(checkpoint_root(cfg.output_dir))
    held = ", ".join(_describe_output(path) for path in previous)
    if cfg.resume:
        # A run that saves checkpoints but stopped before its first one starts again (its
        # records are set aside: prepare_output_dir); one that saves none cannot be resumed.
        if checkpoint is not None or cfg.checkpoint.interval > 0:
            return []
        return [
            ConfigError(
                "resume",
                f"resume=true but {cfg.output_dir} holds no complete checkpoint to resume from "
                f"(it holds {held}), and checkpoint.interval=0 saves none",
                "without a checkpoint the run would start afresh over that run's records",
                "to keep that run's outputs, start in another output_dir; to replace them, set "
                "resume=false overwrite_output_dir=true. A run can be resumed only from the "
                "checkpoints it saves (set checkpoint.interval=N)",
            )
        ]
    if checkpoint is not None:
        fix = (
            f"continue that run from {os.path.basename(checkpoint)} with resume=true, choose "
            "another output_dir, or set overwrite_output_dir=true to delete its outputs first"
        )
    else:
        fix = (
            "choose another output_dir, or set overwrite_output_dir=true to delete its outputs "
            "first (it holds no complete checkpoint, so resume=true cannot continue it)"
        )
    return [
        ConfigError(
            "output_dir",
            f"{cfg.output_dir} already holds a run ({held})",
            "a fresh run would truncate its metrics.jsonl and overwrite or mix in its checkpoints",
            fix,
        )
    ]


def _unwritable(output_dir: str) -> Optional[str]:
    """Why ``output_dir`` (or, while it does not exist, the folder it would be created in)
    cannot take a file, or None. A probe file is created and removed: permission bits say
    nothing to root, and a read-only mount is found only by writing."""
    folder = Path(output_dir).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
    except OSError as error:
        return f"{folder}: {error.strerror}"
    os.close(descriptor)
    os.unlink(probe)
    return None


def _describe_output(path: Path) -> str:
    if path.name == "metrics.jsonl":
        with open(path, "rb") as handle:
            rows = sum(1 for _ in handle)
        return f"metrics.jsonl with {rows} row{'s' if rows != 1 else ''}"
    return path.name


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
    resolved = []
    errors = _collect(lambda: resolved.append(resolve_model_config(cfg.model)))
    errors += [
        ConfigError(
            "model.hf_path",
            problem,
            "the first weights are read from these files when the model is built",
            "copy or download the model again, or re-export it with tools/convert_checkpoint.py",
        )
        for problem in damaged_safetensors(cfg.model.hf_path)
    ]
    return (resolved[0] if resolved else None), errors


def _rewards(cfg: TrainConfig) -> list[ConfigError]:
    errors = []
    for spec in reward_specs(cfg.reward.functions, cfg.reward.weights, cfg.reward.options):
        errors += _collect(
            lambda spec=spec: check_reward_function(spec, load_reward_function(spec))
        )
    return errors


def _environment(cfg: TrainConfig) -> list[ConfigError]:
    if cfg.env.name is None:
        return []
    return _collect(lambda: load_environment(EnvironmentSpec(cfg.env.name, dict(cfg.env.options))))


ENGINE_START_CHECKS: dict[str, Callable[[TrainConfig], list[ConfigError]]] = {
    "sglang": sglang_start_problems,
}
"""``rollout.engine`` -> its start-up check (engines that need none are not listed): the servers
it uses answer, or what launching them needs is there."""


def _rollout_engine(cfg: TrainConfig) -> list[ConfigError]:
    if cfg.rollout.replay_dir is not None:
        return []  # a replayed run starts no engine
    check = ENGINE_START_CHECKS.get(cfg.rollout.engine)
    return [] if check is None else check(cfg)


def _extra_models(cfg: TrainConfig) -> list[ConfigError]:
    """Every extra model (``models.<role>``): its directory, and the policy's tokenizer where
    its role needs the same one (the policy's tokenizer problems are :func:`_data_and_tokenizer`'s)."""
    if not cfg.models:
        return []
    model, _ = _resolved_model(cfg)
    tokenizer = None
    if model is not None:
        # A tokenizer that cannot be loaded is reported by _data_and_tokenizer.
        with contextlib.suppress(ConfigError):
            tokenizer, _ = load_tokenizer(cfg.data, model)
    return role_start_problems(cfg, tokenizer)


def _retokenization(cfg: TrainConfig) -> list[ConfigError]:
    """``rollout.retokenize_responses`` needs a byte-level BPE tokenizer (the config refuses the
    synthetic task; a tokenizer that cannot be loaded is :func:`_data_and_tokenizer`'s)."""
    if not cfg.rollout.retokenize_responses or cfg.data.train_path is None:
        return []
    model, _ = _resolved_model(cfg)
    if model is None:
        return []
    try:
        tokenizer, source = load_tokenizer(cfg.data, model)
    except ConfigError:
        return []
    try:
        token_byte_table(tokenizer)
    except ValueError as error:
        return [
            ConfigError(
                "rollout.retokenize_responses",
                f"the tokenizer of {source}: {error}",
                "the engine's log-probs are carried to the re-encoded tokens on byte offsets, "
                "which a byte-level BPE tokenizer (GPT-2, Qwen, Llama 3) gives exactly",
                "use a byte-level BPE tokenizer, or set rollout.retokenize_responses=false",
            )
        ]
    return []


def _replay(cfg: TrainConfig) -> list[ConfigError]:
    """A replayed run finds a recorded batch for every step it trains, evaluates nothing (no
    engine generates) and does not write into the folder it reads."""
    if cfg.rollout.replay_dir is None:
        return []
    errors = []
    directory = rollouts_directory(cfg.rollout.replay_dir)
    problems = [
        problem
        for problem in (check_recorded_batch(directory, step) for step in range(cfg.steps))
        if problem is not None
    ]
    if problems:
        shown = "; ".join(problems[:3]) + (
            f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        )
        errors.append(
            ConfigError(
                "rollout.replay_dir",
                f"{len(problems)} of the {cfg.steps} steps have no usable recorded batch: {shown}",
                "each replayed step trains the batch the recording saved for it",
                "point replay_dir at the output_dir of a run recorded with "
                "rollout.save_rollouts=true, and set steps to at most the steps it recorded",
            )
        )
    if cfg.eval.interval:
        errors.append(
            ConfigError(
                "eval.interval",
                f"eval.interval={cfg.eval.interval} with rollout.replay_dir",
                "a replayed run starts no rollout engine, and evaluation generates",
                "set eval.interval=0 (evaluate the replayed run's checkpoints afterwards)",
            )
        )
    if directory.resolve() == (Path(cfg.output_dir) / ROLLOUTS_DIR).resolve():
        errors.append(
            ConfigError(
                "output_dir",
                f"output_dir {cfg.output_dir} holds the batches that rollout.replay_dir replays",
                "the replayed run would write over the recording's outputs",
                "give the replayed run an output_dir of its own",
            )
        )
    return errors


def _collect(check: Callable[[], object]) -> list[ConfigError]:
    try:
        check()
    except ConfigError as error:
        return [error]
    return []
