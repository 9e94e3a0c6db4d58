"""What a run sets up before its first step and saves between steps: the model description, the
initial weights, checkpoints and the run state they carry besides the model and optimizer."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.algo import RunningMoments
from megatron_gspo.checkpoint_files import checkpoint_root, step_directory
from megatron_gspo.config import TrainConfig
from megatron_gspo.health import interrupts_deferred

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


def step_seed(seed: int, step: int) -> int:
    """The seed of RL step ``step`` of a run seeded ``seed``: the rollout's sampling seeds and the
    mini-batch shuffle derive from it, so a resumed run repeats both exactly."""
    return seed * 1_000_003 + step


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """With ``model.hf_path``, complete the model section from its config.json (and check that
    what the user set agrees with it)."""
    if cfg.model.hf_path is None:
        return cfg
    from megatron_gspo.convert.hf_config import resolve_model_config

    return dataclasses.replace(cfg, model=resolve_model_config(cfg.model))


def initial_weights_loader(cfg: TrainConfig) -> Optional[Callable[[list[PolicyModel]], Any]]:
    """What sets the initial weights after seed initialisation: a Megatron checkpoint
    (``checkpoint.load_path``, any layout), the HF directory (``model.hf_path``, each rank reading
    its own shards), or nothing (the seed alone)."""
    if cfg.checkpoint.load_path is not None:
        from megatron_gspo.engine.checkpoint import load_weights_only

        return lambda chunks: load_weights_only(chunks, cfg.checkpoint.load_path)
    if cfg.model.hf_path is not None:
        from megatron_gspo.engine.hf_import_export import load_hf_weights

        return lambda chunks: load_hf_weights(chunks, cfg.model.hf_path, cfg)
    return None


def save_checkpoint(engine: TrainEngine, cfg: TrainConfig, run_state: dict) -> str:
    """Collective: a checkpoint of step ``run_state["step"]`` (see ``engine/checkpoint.py``)."""
    from megatron_gspo.engine.checkpoint import save_checkpoint as save

    with interrupts_deferred():  # a Ctrl-C meanwhile stops the run after the save, not inside it
        return save(
            engine,
            checkpoint_root(cfg.output_dir),
            run_state["step"],
            run_state,
            keep_last=cfg.checkpoint.keep_last,
        )


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
