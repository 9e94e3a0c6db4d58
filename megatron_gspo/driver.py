"""The driver: the one actor of a run that generates and scores samples (global rank 0).

The RL loop speaks to two actors. The training engine runs on every rank and its calls are
collective. The driver owns the task (prompts, tokenizer, held-out prompts), the rollout engine,
the reward functions and the logs; it generates and scores each step's samples and broadcasts
them, so that every rank holds the whole rollout batch. Every rank holds a :class:`Driver`:
global rank 0 the :class:`RolloutDriver`, the others a :class:`DriverFollower` that takes its part
in the driver's collectives (the broadcast, draining the weight stream) and has nothing else to
do. The loop therefore never tests the rank.

How samples are made is the driver's :class:`~megatron_gspo.production.SampleProducer`
(prompts in, scored samples out; :mod:`megatron_gspo.production`): one completion per prompt
today, an environment's turns, or a background producer that runs ahead of training, each behind
the same batch-level call.
"""

from __future__ import annotations

import abc
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist

from megatron_gspo.config import ConfigError, TrainConfig, to_dict
from megatron_gspo.ledger import PromptLedger
from megatron_gspo.metrics import MetricsLogger, pass_at_k, rollout_metrics
from megatron_gspo.production import (
    SampleProducer,
    Sampling,
    SingleTurnProducer,
    collect_step_batch,
)
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.data.stream import PromptStream
    from megatron_gspo.reward import RewardRunner
    from megatron_gspo.rollout import RolloutEngine

logger = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """One step's scored samples (the same on every rank) and the driver's metrics of them."""

    samples: list[TrainSample]
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout, reward and data metrics and the driver's ``time/rollout_s``, ``time/reward_s``
    (empty on the other ranks, which log nothing)."""


class Driver(abc.ABC):
    """What the RL loop asks of the sample producer. Every rank calls every method in the same
    order; methods marked collective must be called by every rank."""

    @abc.abstractmethod
    def start(self, step: int, data_state: Optional[dict]) -> None:
        """Begin at RL step ``step``, after the supervised warm-up (which needs only
        :meth:`supervised_batch`); ``data_state`` is the :meth:`state_dict` saved in the
        checkpoint a resumed run starts from (None: a fresh run). Opens the log sinks (a resumed
        run drops the records from ``step`` on: they belong to the run that was interrupted)."""

    @abc.abstractmethod
    def rollout(self, step: int) -> RolloutBatch:
        """Collective: the scored samples of RL step ``step``, on every rank."""

    @abc.abstractmethod
    def mark_trained(self, step: int) -> None:
        """Step ``step`` trained the batch :meth:`rollout` gave it: its prompts are no longer
        pending, and ``trained_prompts.jsonl`` gets the step's line (see ``ledger.py``). Called
        before the step's checkpoint."""

    @abc.abstractmethod
    def supervised_batch(self) -> list[TrainSample]:
        """Collective: the next prompts with their reference answers as samples of advantage 1
        (the supervised warm-up), on every rank."""

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        """Collective: hand the trainer's weight stream (Hugging Face names, full tensors) to the
        rollout engine as weight version ``version``. Every rank drains the stream (gathering
        shards is collective). Returns the sync metrics."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (``eval/...``) of the current weights (empty on the other ranks)."""

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record a step's metrics (metrics.jsonl, TensorBoard, progress bar)."""

    @property
    @abc.abstractmethod
    def records(self) -> list[dict]:
        """Every metric record logged so far (empty on the other ranks)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume the data where it stopped: the stream's position
        and the prompts served but not yet trained."""


def build_driver(
    cfg: TrainConfig,
    *,
    rank: int,
    resources: ExitStack,
    weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None,
) -> Driver:
    """The driver of global rank ``rank``: on rank 0 the :class:`RolloutDriver`, or with
    ``rollout.max_staleness >= 1`` the asynchronous one (``async_driver.py``). What it starts
    (reward workers, the rollout engine and its servers, log sinks) is registered in
    ``resources`` as soon as it exists, so the run's exit stack stops it on any exit, also when
    a later piece fails to start. ``weights`` streams the trainer's current weights (collective;
    the asynchronous driver asks for them during a rollout when a restarted server waits for
    them and the weight transport keeps no copy)."""
    if rank != 0:
        return DriverFollower(weights)
    if cfg.rollout.max_staleness:
        from megatron_gspo.async_driver import AsyncRolloutDriver

        return AsyncRolloutDriver(cfg, resources, weights)
    return RolloutDriver(cfg, resources)


class WeightsWanted:
    """What rank 0 broadcasts instead of a batch when a restarted rollout server waits for the
    trainer's weights: every rank streams them (the gather is collective), then the rollout
    goes on (``async_driver.AsyncRolloutDriver``)."""


WEIGHTS_WANTED = WeightsWanted()


def broadcast_samples(
    samples: Union[None, list[TrainSample], BaseException],
) -> list[TrainSample]:
    """Rank 0's samples on every rank (pickled over the default group; small next to a step).

    Rank 0 may send an exception instead: the other ranks raise it (rank 0 raises its own), so
    that a failed rollout stops every rank instead of leaving them waiting here."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return samples
    payload = [samples]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], BaseException) and dist.get_rank() != 0:
        raise payload[0]
    return payload[0]


# ----------------------------------------------------------------------------------------------
# Global rank 0
# ----------------------------------------------------------------------------------------------


@dataclass
class Task:
    """Prompts, tokenizer and held-out prompts of a run."""

    tokenizer: PreTrainedTokenizerBase
    stream: PromptStream
    eval_prompts: list[Prompt]
    eos_token_id: Optional[int]


def build_task(cfg: TrainConfig) -> Task:
    from megatron_gspo.data import build_eval_prompts, build_prompt_stream, build_tokenizer

    tokenizer = build_tokenizer(cfg.data, cfg.model)
    vocab = len(tokenizer)
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"the tokenizer has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}",
            "every token id must have an embedding row",
            f"set model.vocab_size >= {vocab}",
        )
    stream = build_prompt_stream(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    eval_prompts = build_eval_prompts(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    return Task(tokenizer, stream, eval_prompts, getattr(tokenizer, "eos_token_id", None))


def build_rollout(cfg: TrainConfig) -> RolloutEngine:
    from megatron_gspo.rollout.factory import build_rollout_engine

    return build_rollout_engine(
        cfg.rollout,
        cfg.model,
        seed=cfg.seed,
        enable_routed_experts=cfg.requests_rollout_routes,
        work_dir=os.path.join(cfg.output_dir, "rollout"),
    )


class RolloutDriver(Driver):
    """Global rank 0: the task, the rollout engine, the reward functions and the logs."""

    def __init__(self, cfg: TrainConfig, resources: ExitStack):
        from megatron_gspo.reward import RewardRunner

        self.cfg = cfg
        self.resources = resources
        self.task = build_task(cfg)
        # With an environment the reward functions are optional (it may score by itself).
        self.rewards: Optional[RewardRunner] = (
            resources.enter_context(RewardRunner(cfg.reward)) if cfg.reward.functions else None
        )
        self.environment_factory = None
        if cfg.env.name is not None:
            from megatron_gspo.envs import EnvironmentSpec, load_environment

            self.environment_factory = load_environment(
                EnvironmentSpec(cfg.env.name, dict(cfg.env.options))
            )
        self.rollout_engine: RolloutEngine = resources.enter_context(build_rollout(cfg))
        self.producer: SampleProducer = self.make_producer(Sampling.training(cfg))
        self.ledger = PromptLedger(self.task.stream, cfg.output_dir)
        self.logger: Optional[MetricsLogger] = None
        self._records: list[dict] = []
        self._batch_prompts: tuple[list[int], list[int]] = ([], [])
        """Stream ids of the prompts the last :meth:`rollout` trained and dropped (dynamic
        sampling's uninformative groups)."""

    def make_producer(self, sampling: Sampling) -> SampleProducer:
        """The run's way of producing samples (an environment's episodes or one completion per
        sample) at ``sampling``'s settings."""
        if self.environment_factory is not None:
            from megatron_gspo.envs import EnvironmentProducer

            return EnvironmentProducer(
                self.rollout_engine,
                self.task,
                self.rewards,
                self.cfg,
                sampling,
                factory=self.environment_factory,
            )
        return SingleTurnProducer(self.rollout_engine, self.task, self.rewards, self.cfg, sampling)

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

    def rollout(self, step: int) -> RolloutBatch:
        drawn = _DrawnPrompts(self.ledger)
        produced = collect_step_batch(self.producer, drawn, step, self.cfg)
        trained = list(dict.fromkeys(s.group_id for s in produced.samples if s.group_id >= 0))
        dropped = [prompt.group_id for prompt in drawn.prompts if prompt.group_id not in trained]
        # Every prompt drawn for a synchronous step is resolved by it: trained, or dropped by
        # dynamic sampling (its groups all aborted, it was not trained either).
        self._batch_prompts = (trained, dropped)
        if self.cfg.rollout.sglang_release_memory:
            # Colocated servers give their GPU memory to the trainer until the weight sync.
            self.rollout_engine.release_memory()
        samples = broadcast_samples(produced.samples)
        metrics = {
            **rollout_metrics(samples),
            **produced.metrics,
            **self.task.stream.stats(),
        }
        return RolloutBatch(samples, metrics)

    def mark_trained(self, step: int) -> None:
        trained, dropped = self._batch_prompts
        self.ledger.mark_trained(step, trained, dropped=dropped)

    def supervised_batch(self) -> list[TrainSample]:
        # Straight from the stream: warm-up prompts are consumed, not pending RL prompts.
        prompts = self.task.stream.next_batch(self.cfg.algo.rollout_batch_size)
        if self.environment_factory is not None:
            from megatron_gspo.envs import demonstration_samples

            return broadcast_samples(
                demonstration_samples(self.environment_factory, prompts, self.task, self.cfg)
            )
        return broadcast_samples([reference_sample(prompt, self.task) for prompt in prompts])

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        from megatron_gspo.rollout import sync_weights_paused

        stats = sync_weights_paused(self.rollout_engine, named_tensors, version)
        return {
            "weight_sync_s": stats.seconds,
            "weight_sync_bytes": float(stats.num_bytes),
            "weight_sync_tensors": float(stats.num_tensors),
            "weight_sync_buckets": float(stats.num_buckets),
        }

    def evaluate(self) -> dict[str, float]:
        return evaluate(self.make_producer, self.task.eval_prompts, self.cfg)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(step, metrics)
        self._records.append({"step": step, **metrics})

    @property
    def records(self) -> list[dict]:
        return self._records

    def state_dict(self) -> dict:
        return self.ledger.state_dict()


class _DrawnPrompts:
    """The prompt source of one synchronous step: the ledger's prompts (re-queued ones first),
    remembering which it served."""

    def __init__(self, ledger: PromptLedger):
        self.ledger = ledger
        self.prompts: list[Prompt] = []

    def next_batch(self, batch_size: int) -> list[Prompt]:
        prompts = self.ledger.take(batch_size)
        self.prompts += prompts
        return prompts


# ----------------------------------------------------------------------------------------------
# The other ranks
# ----------------------------------------------------------------------------------------------


class DriverFollower(Driver):
    """Every rank but 0: receives the driver's samples and drains the weight stream."""

    def __init__(self, weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None):
        self.weights = weights

    def start(self, step: int, data_state: Optional[dict]) -> None:
        pass

    def rollout(self, step: int) -> RolloutBatch:
        samples = broadcast_samples(None)
        while isinstance(samples, WeightsWanted):  # rank 0 sends the trainer's weights first
            self.sync_weights(self.weights(), version=step)
            samples = broadcast_samples(None)
        return RolloutBatch(samples)

    def mark_trained(self, step: int) -> None:
        pass

    def supervised_batch(self) -> list[TrainSample]:
        return broadcast_samples(None)

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        for _ in named_tensors:
            pass
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    @property
    def records(self) -> list[dict]:
        return []

    def state_dict(self) -> dict:
        return {}


# ----------------------------------------------------------------------------------------------
# Evaluating and supervised samples (rank 0); generating and scoring: production.py
# ----------------------------------------------------------------------------------------------


def evaluate(
    make_producer: Callable[[Sampling], SampleProducer], prompts: list[Prompt], cfg: TrainConfig
) -> dict[str, float]:
    """Held-out prompts: greedy accuracy, mean reward and pass@k of sampled responses, with the
    run's producer (``make_producer``) at evaluation's sampling settings.

    A response counts as correct when its reward reaches ``eval.correct_reward``.
    """
    if not prompts:
        return {}
    samples_per_prompt = cfg.eval.num_samples
    metrics = {}
    for name, temperature, n in (
        ("greedy", 0.0, 1),
        ("sampled", cfg.eval.temperature, samples_per_prompt),
    ):
        producer = make_producer(
            Sampling(temperature=temperature, group_size=n, return_routes=False, finish=False)
        )
        samples = producer.produce(prompts, step=-1).samples
        correct = [s.reward >= cfg.eval.correct_reward for s in samples]
        metrics[f"eval/{name}_reward_mean"] = sum(s.reward for s in samples) / len(samples)
        if name == "greedy":
            metrics["eval/greedy_accuracy"] = sum(correct) / len(correct)
        else:
            for k in sorted({1, n}):
                values = [
                    pass_at_k(n, sum(correct[i * n : (i + 1) * n]), k) for i in range(len(prompts))
                ]
                metrics[f"eval/pass@{k}"] = sum(values) / len(values)
    return metrics


def reference_sample(prompt: Prompt, task: Task) -> TrainSample:
    """The prompt followed by its reference answer (and EOS), advantage 1: a supervised sample."""
    if prompt.answer is None:
        raise ValueError(
            f"sft_warmup_steps > 0 but the prompt at {prompt.source} has no answer to imitate; "
            "set sft_warmup_steps=0 or give the data an answer column"
        )
    answer_ids = task.tokenizer.encode(prompt.answer, add_special_tokens=False)
    eos = [task.eos_token_id] if task.eos_token_id is not None else []
    return TrainSample(
        tokens=torch.tensor(list(prompt.prompt_ids) + answer_ids + eos, dtype=torch.long),
        prompt_length=len(prompt.prompt_ids),
        group_id=prompt.group_id,
        advantages=torch.tensor(1.0),
    )
