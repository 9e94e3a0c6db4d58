"""Global rank 0's driver: the task, the rollout engine, the reward functions and the logs.

How samples are made is the driver's :class:`~megatron_gspo.production.producer.SampleProducer`
(prompts in, scored samples out): one completion per prompt or an environment's turns, behind
the same batch-level call. When they are made is its batch source's
(:mod:`~megatron_gspo.driver.source`): at the step that trains them (synchronous), or ahead of
training within the staleness bound (a background producer).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

from megatron_gspo.config import TrainConfig, to_dict
from megatron_gspo.driver.evaluation import evaluate
from megatron_gspo.driver.interface import Driver, RolloutBatch, broadcast_samples
from megatron_gspo.driver.ledger import PromptLedger
from megatron_gspo.driver.source import BatchSource, BatchSourceFactory
from megatron_gspo.envs import EnvironmentSpec, load_environment
from megatron_gspo.metrics.sinks import MetricsLogger
from megatron_gspo.metrics.step import rollout_metrics
from megatron_gspo.production.episodes import (
    EpisodeSettings,
    demonstration_samples,
)
from megatron_gspo.production.producer import SampleProducer, warn_aborted
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.selection import agent_endpoint, select_producer
from megatron_gspo.production.supervised import reference_sample
from megatron_gspo.production.task import build_task
from megatron_gspo.production.teacher import TeacherScoredProducer
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout import RolloutEngine
from megatron_gspo.rollout.chat_endpoint import ChatEndpoint
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.judge_backend import build_judge_backend
from megatron_gspo.rollout.roles import build_role_engines
from megatron_gspo.samples import TrainSample
from megatron_gspo.samples.recorded_batch import (
    ROLLOUTS_DIR,
    RecordedBatch,
    write_recorded_batch,
)
from megatron_gspo.weight_sync import SyncStats

logger = logging.getLogger(__name__)


def build_rollout(cfg: TrainConfig) -> RolloutEngine:
    return build_rollout_engine(
        cfg.rollout,
        cfg.model,
        seed=cfg.seed,
        enable_routed_experts=cfg.requests_rollout_routes,
        work_dir=os.path.join(cfg.output_dir, "rollout"),
    )


def sync_metrics(stats: Optional[SyncStats], seconds: float) -> dict[str, float]:
    """The ``weight_sync_*`` metrics of one weight sync: what ``stats`` moved, or only the
    ``seconds`` the sync took when no sync reached the engine (``stats`` None: it failed and
    comes back without them)."""
    if stats is None:
        return {"weight_sync_s": seconds}
    return {
        "weight_sync_s": stats.seconds,
        "weight_sync_bytes": float(stats.num_bytes),
        "weight_sync_tensors": float(stats.num_tensors),
        "weight_sync_buckets": float(stats.num_buckets),
    }


class RolloutDriver(Driver):
    """Global rank 0: the task, the rollout engine, the reward functions and the logs; each
    step's batch comes from the batch source that ``make_source`` builds from the driver's
    producer, prompt ledger and rollout engine (a factory: the driver builds those, the engine
    registered in ``resources`` first). The source is stopped before the engine and the reward
    workers (the exit stack is LIFO)."""

    def __init__(self, cfg: TrainConfig, resources: ExitStack, make_source: BatchSourceFactory):
        self.cfg = cfg
        self.resources = resources
        self.task = build_task(cfg)
        # A replayed run (rollout.replay_dir) generates and scores nothing: it starts no rollout
        # engine and no reward workers, and its source needs no producer.
        replaying = cfg.rollout.replay_dir is not None
        # The extra models' engines (models.<role>: teacher, judge, ...), by role, each in the
        # exit stack; built before the reward functions, which may call them. A replayed run
        # scores nothing and starts none.
        self.model_engines: dict[str, RolloutEngine] = (
            {} if replaying else build_role_engines(cfg, resources)
        )
        # With an environment or an agent the reward functions are optional (they score by
        # themselves; the functions' score is added to theirs).
        self.rewards: Optional[RewardRunner] = (
            resources.enter_context(
                RewardRunner(cfg.reward, build_judge_backend(cfg, self.model_engines))
            )
            if (cfg.reward.functions or cfg.reward.judge.enabled) and not replaying
            else None
        )
        self.episode_settings = EpisodeSettings.from_config(cfg)
        self.environment_factory = None
        if cfg.env.name is not None:
            self.environment_factory = load_environment(
                EnvironmentSpec(cfg.env.name, dict(cfg.env.options))
            )
        self.rollout_engine: Optional[RolloutEngine] = None
        self.chat_endpoint: Optional[ChatEndpoint] = None
        self.producer: Optional[SampleProducer] = None
        if not replaying:
            self.rollout_engine = resources.enter_context(build_rollout(cfg))
            if cfg.agent.function is not None:
                # The agents' OpenAI-compatible endpoint, in front of the rollout engine.
                self.chat_endpoint = resources.enter_context(
                    agent_endpoint(cfg, self.rollout_engine, self.task)
                )
            self.producer = self.make_producer(Sampling.training(cfg))
            if cfg.algo.distillation.enabled:
                # Training batches only: evaluation measures the task, not the teacher's view.
                self.producer = TeacherScoredProducer(
                    self.producer,
                    self.model_engines[cfg.algo.distillation.teacher],
                    cfg.rollout.temperature,
                )
        self.ledger = PromptLedger(self.task.stream, cfg.output_dir)
        self.source: BatchSource = make_source(self.producer, self.ledger, self.rollout_engine)
        resources.callback(self.source.stop)
        self.recording: Optional[Path] = (
            Path(cfg.output_dir) / ROLLOUTS_DIR if cfg.rollout.save_rollouts else None
        )
        """Where each step's batch is written (rollout.save_rollouts), or None."""
        self.logger: Optional[MetricsLogger] = None
        self._records: list[dict] = []
        self._batch_prompts: tuple[list[int], list[int]] = ([], [])
        """Stream ids of the prompts the last :meth:`rollout` trained and dropped (dynamic
        sampling's uninformative groups)."""

    def make_producer(self, sampling: Sampling) -> SampleProducer:
        """The run's way of producing samples (an agent's or an environment's episodes, or one
        completion per sample) at ``sampling``'s settings."""
        return select_producer(
            self.cfg,
            self.rollout_engine,
            self.task,
            self.rewards,
            sampling,
            chat_endpoint=self.chat_endpoint,
            environment_factory=self.environment_factory,
        )

    def start(self, step: int, data_state: Optional[dict]) -> None:
        if data_state is not None:
            self.ledger.load_state_dict(data_state)
        self.ledger.start(step)
        self.logger = MetricsLogger(
            self.cfg.output_dir,
            self.cfg.logging,
            total_steps=self.cfg.steps,
            start_step=step,
            run_config=to_dict(self.cfg),
        )
        self.resources.callback(self.logger.close)
        self.source.start(step)

    def rollout(self, step: int) -> RolloutBatch:
        batch = self.source.next_batch(step)
        # Here, not in the producers: only the step's batch is trained (the background source
        # generates aborted groups again and cancels its work in flight when the run stops).
        warn_aborted(batch.samples)
        self._batch_prompts = (batch.trained_prompts, batch.dropped_prompts)
        # The source's metrics last: a replayed batch carries the prompt stream's statistics of
        # the run that recorded it.
        source_metrics = {**self.task.stream.stats(), **batch.metrics}
        if self.recording is not None:
            write_recorded_batch(
                self.recording,
                RecordedBatch(
                    step,
                    batch.samples,
                    batch.trained_prompts,
                    batch.dropped_prompts,
                    source_metrics,
                ),
            )
        return RolloutBatch(batch.samples, {**rollout_metrics(batch.samples), **source_metrics})

    def mark_trained(self, step: int) -> None:
        trained, dropped = self._batch_prompts
        self.ledger.mark_trained(step, trained, dropped=dropped)

    def supervised_batch(self) -> list[TrainSample]:
        # Straight from the stream: warm-up prompts are consumed, not pending RL prompts.
        prompts = self.task.stream.next_batch(self.cfg.algo.rollout_batch_size)
        if self.environment_factory is not None:
            return broadcast_samples(
                demonstration_samples(
                    self.environment_factory, prompts, self.task, self.episode_settings
                )
            )
        return broadcast_samples([reference_sample(prompt, self.task) for prompt in prompts])

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        started = time.perf_counter()
        stats = self.source.sync_weights(named_tensors, version)
        return sync_metrics(stats, time.perf_counter() - started)

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.make_producer, self.task.eval_prompts, self.cfg)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        metrics = {**metrics, **self.source.run_totals()}
        self.logger.log(step, metrics)
        self._records.append({"step": step, **metrics})

    @property
    def records(self) -> list[dict]:
        return self._records

    def state_dict(self) -> dict:
        return self.ledger.state_dict()
