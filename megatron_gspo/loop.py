"""The RL loop. One step, top to bottom (docs/architecture.md):

    prompts -> rollout -> rewards -> old / reference log-probs -> advantages -> policy update
            -> weight sync -> log, checkpoint, evaluate

Every rank runs this file (SPMD under torchrun). The driver (global rank 0) owns the rollout engine,
the reward functions and the logs; it broadcasts the scored samples, and every rank takes part in
the engine's collective calls (log-probs, updates, weight gathering, checkpoints).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_gspo.algo import RunningMoments
from megatron_gspo.config import TrainConfig, to_dict
from megatron_gspo.metrics import MetricsLogger
from megatron_gspo.reward import RewardRunner
from megatron_gspo.samples import TrainSample
from megatron_gspo.stages import (
    assign_advantages,
    build_rollout,
    build_task,
    evaluate,
    generate,
    headline_metrics,
    initial_weights_loader,
    log_prob_gap_metrics,
    resolve_model,
    resume_checkpoint,
    rollout_metrics,
    save_checkpoint,
    score,
    set_old_log_probs,
    sft_warmup,
    sync_weights,
    update_policy,
)

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


def broadcast_samples(samples: list[TrainSample] | None) -> list[TrainSample]:
    """The driver's samples on every rank (pickled over the default group; small next to a step)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return samples
    payload = [samples]
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def run(cfg: TrainConfig) -> list[dict]:
    """Train ``cfg.steps`` RL steps; returns the driver's metric records (empty on other ranks)."""
    from megatron_gspo.engine import TrainEngine

    torch.manual_seed(cfg.seed)
    if not torch.cuda.is_available():
        # Subnormal floats (weights and Adam moments decaying towards 0, e.g. of rarely routed
        # experts) make x86 CPUs 10-100x slower (a GRPO demo step went from 0.4 s to 40 s);
        # flushing them to zero only changes values below 1.2e-38.
        torch.set_flush_denormal(True)
    cfg = resolve_model(cfg)
    engine = TrainEngine(cfg, load_weights=initial_weights_loader(cfg))
    driver = engine.parallel.rank == 0
    task = build_task(cfg) if driver else None
    rewards = RewardRunner(cfg.reward) if driver else None
    rollout = build_rollout(cfg) if driver else None

    advantage_settings = cfg.algo.advantage_settings()
    state = RunState()
    resumed = resume_checkpoint(engine, cfg) if cfg.resume else None
    if resumed is not None:
        state.load_state_dict(resumed)
        if driver:
            task.stream.load_state_dict(state.data)
    log = MetricsLogger(
        cfg.output_dir,
        cfg.logging,
        total_steps=cfg.steps,
        start_step=state.step,
        run_config=to_dict(cfg),
        enabled=driver,
    )
    if state.step == 0 and cfg.sft_warmup_steps:
        sft_warmup(engine, task, cfg, broadcast_samples)
    sync_weights(engine, rollout, version=state.step)
    records = []
    for step in range(state.step, cfg.steps):
        started = time.perf_counter()
        timings: dict[str, float] = {}

        with _timed(timings, "rollout"):
            prompts = task.stream.next_batch(cfg.algo.rollout_batch_size) if driver else None
            samples = generate(rollout, task, prompts, cfg, step) if driver else None
        with _timed(timings, "reward"):
            reward_stats = score(samples, prompts, rewards, task) if driver else {}
            samples = broadcast_samples(samples)
        with _timed(timings, "old_log_probs"):
            set_old_log_probs(engine, samples, cfg.algo)
        with _timed(timings, "advantages"):
            advantage_stats = assign_advantages(samples, advantage_settings, state.reward_moments)
        with _timed(timings, "update"):
            update_stats = update_policy(engine, samples, cfg.algo, seed=cfg.seed, step=step)
        with _timed(timings, "weight_sync"):
            sync_stats = sync_weights(engine, rollout, version=step + 1)

        state.step = step + 1
        state.data = task.stream.state_dict() if driver else {}
        metrics = {
            **rollout_metrics(samples),
            **reward_stats,
            **advantage_stats,
            **log_prob_gap_metrics(samples),
            **update_stats,
            **sync_stats,
            **(task.stream.stats() if driver else {}),
            **{f"time/{name}_s": seconds for name, seconds in timings.items()},
            "step_time_s": time.perf_counter() - started,
        }
        metrics.update(headline_metrics(metrics, cfg.algo))
        if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0 and driver:
            metrics.update(evaluate(rollout, task, rewards, cfg))
        if cfg.checkpoint.interval and (
            (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == cfg.steps
        ):
            save_checkpoint(engine, cfg, state.state_dict())
        log.log(step, metrics)
        if driver:
            records.append({"step": step, **metrics})
    log.close()
    for closable in (rollout, rewards):
        if closable is not None:
            closable.close()
    return records


class _timed:
    """Adds the wall time of a ``with`` block to ``timings[name]``."""

    def __init__(self, timings: dict[str, float], name: str):
        self.timings, self.name = timings, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.timings[self.name] = (
            self.timings.get(self.name, 0.0) + time.perf_counter() - self.start
        )
