"""Sample production: scored samples from prompts (rank 0, no Megatron).

The unit of production is one batch-level call, :meth:`SampleProducer.produce`: a list of
prompts and the RL step in, their scored :class:`TrainSample`\\ s and the metrics of producing
them out. Who calls it decides when and how often: the synchronous driver once per step
(:func:`collect_step_batch`), a wrapper that filters and calls again for more prompts, or a
background producer that runs ahead of training.

Contract of :meth:`SampleProducer.produce`:

- samples are prompt-major: ``group_size`` samples per prompt, in the order of the prompts;
  sample ``j`` of prompt ``i`` is ``samples[i * group_size + j]``;
- every sample is scored (``reward`` set) and carries its prompt's ``group_id``, except an
  aborted one, which keeps an empty loss mask and a group of its own (counted, never trained);
- sampling seeds derive from (run seed, ``step``, ``first_index + i``) for prompt ``i``, so the
  same call gives the same samples (and a resumed run samples what the uninterrupted one would);
  ``first_index`` is the position of ``prompts[0]`` among the prompts of the step, which keeps
  a second call of the same step (more prompts for dynamic sampling) from reusing seeds;
- the metrics hold ``time/rollout_s`` (generation) and ``time/reward_s`` (scoring) and the
  reward runner's counts (``reward_errors``, ...), never the batch statistics that the caller
  computes on the final batch (``reward_mean``, lengths: :func:`megatron_gspo.metrics.
  rollout_metrics`).

:class:`SingleTurnProducer` is one completion per sample (:func:`generate` then :func:`score`).
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from megatron_gspo.config import TrainConfig
from megatron_gspo.run_setup import step_seed
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.data.stream import PromptStream
    from megatron_gspo.driver import Task
    from megatron_gspo.reward import RewardRunner
    from megatron_gspo.rollout import RolloutEngine

logger = logging.getLogger(__name__)


@dataclass
class ScoredSamples:
    """What one :meth:`SampleProducer.produce` call (or one step's collection) made."""

    samples: list[TrainSample]
    """Prompt-major, ``group_size`` per prompt (module docstring)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``time/rollout_s``, ``time/reward_s``, the reward runner's counts and the producer's own
    metrics (e.g. ``env/...``)."""


class SampleProducer(abc.ABC):
    """Prompts in, scored samples out (the contract of the module docstring)."""

    group_size: int
    """Samples per prompt."""

    @abc.abstractmethod
    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        """The scored samples of ``prompts`` at RL step ``step``."""


class SingleTurnProducer(SampleProducer):
    """One completion per sample: :func:`generate`, then :func:`score` (today's rollout)."""

    def __init__(self, rollout: RolloutEngine, task: Task, rewards: RewardRunner, cfg: TrainConfig):
        self.rollout, self.task, self.rewards, self.cfg = rollout, task, rewards, cfg
        self.group_size = cfg.algo.num_return_sequences_in_group

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        started = time.perf_counter()
        samples, sample_prompts = generate(
            self.rollout, self.task, list(prompts), self.cfg, step, first_index=first_index
        )
        generated = time.perf_counter()
        reward_stats = score(samples, sample_prompts, self.rewards, self.task)
        return ScoredSamples(
            samples,
            {
                **reward_stats,
                "time/rollout_s": generated - started,
                "time/reward_s": time.perf_counter() - generated,
            },
        )


def collect_step_batch(
    producer: SampleProducer, stream: PromptStream, step: int, cfg: TrainConfig
) -> ScoredSamples:
    """The scored samples of RL step ``step``: ``algo.rollout_batch_size`` prompts from
    ``stream``, produced once."""
    prompts = stream.next_batch(cfg.algo.rollout_batch_size)
    return producer.produce(prompts, step)


# ----------------------------------------------------------------------------------------------
# One completion per sample
# ----------------------------------------------------------------------------------------------


def sampling_seed(cfg: TrainConfig, step: int, index: int) -> int:
    """Seed of the requests of prompt ``index`` of step ``step`` (eval: step -1)."""
    base_seed = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.seed
    return step_seed(base_seed, step) * 100_003 + index


def generate(
    rollout: RolloutEngine,
    task: Task,
    prompts: list[Prompt],
    cfg: TrainConfig,
    step: int,
    *,
    temperature: Optional[float] = None,
    group_size: Optional[int] = None,
    return_routes: Optional[bool] = None,
    first_index: int = 0,
) -> tuple[list[TrainSample], list[Prompt]]:
    """``num_return_sequences_in_group`` responses per prompt, as :class:`TrainSample`\\ s, and
    the prompt of each sample.

    Sampling seeds derive from (run seed, step, ``first_index`` + prompt position), so a resumed
    run samples exactly what the uninterrupted one would. An aborted request keeps its sample
    with an empty loss mask and a group of its own (advantage 0): it is counted, never trained
    on. ``temperature`` (0: greedy), ``group_size`` and ``return_routes`` override the training
    settings (evaluation uses them; they are arguments, not a modified config, because the
    config rejects ``temperature=0``).
    """
    if temperature is None:
        temperature = cfg.rollout.temperature
    if group_size is None:
        group_size = cfg.algo.num_return_sequences_in_group
    if return_routes is None:
        return_routes = cfg.algo.routing_replay == "r3"
    from megatron_gspo.rollout import GenerateRequest

    requests = [
        GenerateRequest(
            input_ids=prompt.prompt_ids,
            max_new_tokens=cfg.algo.response_length,
            temperature=temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            stop_token_ids=[task.eos_token_id] if task.eos_token_id is not None else [],
            min_new_tokens=cfg.rollout.min_new_tokens,
            seed=sampling_seed(cfg, step, first_index + index),
            return_logprob=True,
            return_routed_experts=return_routes,
        )
        for index, prompt in enumerate(prompts)
    ]
    # Results are prompt-major: sample i answers prompt i // group_size.
    results = rollout.generate(requests, n=group_size)
    samples, sample_prompts = [], []
    for index, result in enumerate(results):
        prompt = prompts[index // group_size]
        tokens = torch.tensor(list(prompt.prompt_ids) + list(result.output_ids), dtype=torch.long)
        aborted = result.finish_reason == "abort"
        routes = result.routed_experts
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=len(prompt.prompt_ids),
                group_id=aborted_group_id(first_index * group_size + index)
                if aborted
                else prompt.group_id,
                loss_mask=torch.zeros(len(result.output_ids), dtype=torch.bool)
                if aborted
                else None,
                rollout_log_probs=None
                if result.output_log_probs is None
                else torch.as_tensor(result.output_log_probs, dtype=torch.float32),
                rollout_routes=None if routes is None else torch.from_numpy(routes),
                finish_reason=result.finish_reason,
                weight_version=result.weight_version,
            )
        )
        sample_prompts.append(prompt)
    warn_aborted(samples)
    return samples, sample_prompts


def aborted_group_id(sample_index: int) -> int:
    """The group of its own of an aborted sample: negative, so it never meets a prompt's group
    (prompt group ids are stream positions, >= 0); ``sample_index`` counts the samples of the
    step."""
    return -1 - sample_index


def warn_aborted(samples: Sequence[TrainSample]) -> None:
    aborted = sum(s.finish_reason == "abort" for s in samples)
    if aborted:
        logger.warning(
            "%d of %d rollout samples were aborted; they are kept out of the loss",
            aborted,
            len(samples),
        )


def score(
    samples: list[TrainSample], prompts: list[Prompt], rewards: RewardRunner, task: Task
) -> dict[str, float]:
    """Score every sample against its prompt (``prompts[i]`` for ``samples[i]``); failures are
    counted in the returned metrics and logged by the runner."""
    from megatron_gspo.reward import RewardInput

    inputs = []
    for sample, prompt in zip(samples, prompts):
        response_ids = sample.tokens[sample.prompt_length :].tolist()
        inputs.append(
            RewardInput(
                prompt=prompt.prompt_text,
                response=task.tokenizer.decode(response_ids, skip_special_tokens=True),
                answer=prompt.answer,
                metadata=prompt.metadata,
                prompt_ids=list(prompt.prompt_ids),
                response_ids=response_ids,
                finish_reason=sample.finish_reason,
            )
        )
    result = rewards.score(inputs)
    for sample, reward in zip(samples, result.rewards):
        sample.reward = float(reward)
    return {
        k: float(v) for k, v in result.metrics.items() if k not in ("reward_mean", "reward_max")
    }
