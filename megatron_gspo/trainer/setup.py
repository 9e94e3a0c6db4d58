"""What a run sets up before its first step and saves between steps: the model description, the
initial weights, checkpoints and the run state they carry besides the model and optimizer."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.algo import RunningMoments
from megatron_gspo.config import TrainConfig
from megatron_gspo.convert.hf_config import resolve_model_config
from megatron_gspo.runtime.checkpoint_files import (
    CheckpointError,
    checkpoint_root,
    latest_checkpoint,
    step_directory,
)
from megatron_gspo.runtime.health import interrupts_deferred

if TYPE_CHECKING:
    from megatron_gspo.engine.model import PolicyModel
    from megatron_gspo.engine.train_step import TrainEngine

logger = logging.getLogger(__name__)


@dataclass
class RunState:
    """What a checkpoint must restore besides the model and optimizer for an exact resume."""

    step: int = 0
    data: dict = field(default_factory=dict)
    reward_moments: RunningMoments = field(default_factory=RunningMoments)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "data": self.data,
            "reward_moments": self.reward_moments.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.data = state["step"], state["data"]
        self.reward_moments.load_state_dict(state["reward_moments"])


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """With ``model.hf_path``, complete the model section from its config.json (and check that
    what the user set agrees with it)."""
    if cfg.model.hf_path is None:
        return cfg
    return dataclasses.replace(cfg, model=resolve_model_config(cfg.model))


def initial_weights_loader(cfg: TrainConfig) -> Optional[Callable[[list[PolicyModel]], Any]]:
    """What sets the initial weights after seed initialisation: a Megatron checkpoint
    (``checkpoint.load_path``, any layout), the HF directory (``model.hf_path``, each rank reading
    its own shards), or nothing (the seed alone)."""
    if cfg.checkpoint.load_path is not None:
        # engine/ imports Megatron; imported where it is used, so that the trainer's modules
        # load without it (tests/config/test_light_imports.py). The same holds below.
        from megatron_gspo.engine.checkpoint import load_weights_only

        return lambda chunks: load_weights_only(chunks, cfg.checkpoint.load_path)
    if cfg.model.hf_path is not None:
        from megatron_gspo.engine.hf_import_export import load_hf_weights

        return lambda chunks: load_hf_weights(chunks, cfg.model.hf_path, cfg)
    return None


def save_checkpoint(engine: TrainEngine, cfg: TrainConfig, run_state: dict) -> str:
    """Collective: a checkpoint of step ``run_state["step"]`` (see ``engine/checkpoint.py``)."""
    from megatron_gspo.engine.checkpoint import save_checkpoint as save

    root = checkpoint_root(cfg.output_dir)
    try:
        with interrupts_deferred():  # a Ctrl-C meanwhile stops the run after the save, not in it
            return save(
                engine, root, run_state["step"], run_state, keep_last=cfg.checkpoint.keep_last
            )
    # PyTorch's CheckpointException, which carries the writers' failures, is a BaseException.
    except BaseException as error:
        interrupted = isinstance(error, (KeyboardInterrupt, SystemExit))
        full = None if interrupted else disk_full_reason(error) or _no_space_left(root)
        if full is None:
            raise
        latest = latest_checkpoint(root)
        raise CheckpointError(
            f"the checkpoint of step {run_state['step']} could not be written to {root}: {full}",
            "the disk (or quota) that holds the output folder is full; the unfinished save is "
            "never taken as a checkpoint, and metrics.jsonl and earlier checkpoints are kept",
            "free space there (or lower checkpoint.keep_last), then rerun with resume=true: it "
            + (f"continues from {latest}" if latest else "starts afresh (no checkpoint yet)"),
        ) from None


def disk_full_reason(error: BaseException) -> Optional[str]:
    """``"No space left on device"`` (or the quota's message) when ``error`` or one it was raised
    from is a full disk, else None. Megatron's checkpoint writers re-raise a worker's failure as
    another exception, sometimes only with its text, so the chain and the messages are read."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(error.errno)
        for code in (errno.ENOSPC, errno.EDQUOT):
            if os.strerror(code) in str(error):
                return os.strerror(code)
        error = error.__cause__ or error.__context__
    return None


FULL_DISK_BYTES = 4 * 2**20
"""Free space below which a failed save is taken for a full disk: a full disk also fails inside
PyTorch's zip writer (``unexpected pos``) or a writer process, with no errno to read."""


def _no_space_left(root: str) -> Optional[str]:
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if free >= FULL_DISK_BYTES:
        return None
    return f"{os.strerror(errno.ENOSPC)} ({free // 1024} KiB free)"


def save_checkpoint_unless_saved(engine: TrainEngine, cfg: TrainConfig, run_state: dict) -> None:
    """Collective: a checkpoint of step ``run_state["step"]`` for a run that stops early, unless
    that step's checkpoint exists (the same state) or nothing was trained yet (a fresh start
    does the same)."""
    step = run_state["step"]
    if step == 0 or os.path.isdir(step_directory(checkpoint_root(cfg.output_dir), step)):
        return
    path = save_checkpoint(engine, cfg, run_state)
    logger.warning("saved %s before stopping: resume=true continues from it", path)


def resume_checkpoint(engine: TrainEngine, cfg: TrainConfig) -> Optional[dict]:
    """The run state of the latest whole checkpoint in ``output_dir`` (None: start fresh)."""
    from megatron_gspo.engine.checkpoint import load_checkpoint, resumable_checkpoint

    root = checkpoint_root(cfg.output_dir)
    path = resumable_checkpoint(root)  # a damaged newest one: the one before
    if path is None:
        logger.warning("resume=true but %s holds no checkpoint: starting fresh", root)
        return None
    logger.info("resuming from %s", path)
    # A longer run (more steps) changes the decay horizon of a decaying schedule, which would
    # change the trajectory; a constant schedule does not depend on it, so extending is allowed.
    return load_checkpoint(
        engine, path, allow_schedule_change=cfg.optim.lr_decay_style == "constant"
    )
