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
- rewards are final: the length shaping and the truncation mask of :func:`finish_samples` are
  applied;
- the metrics hold ``time/rollout_s`` (generation) and ``time/reward_s`` (scoring) and the
  reward runner's counts (``reward_errors``, ...), never the batch statistics that the caller
  computes on the final batch (``reward_mean``, lengths: :func:`megatron_gspo.metrics.
  rollout_metrics`).

:class:`SingleTurnProducer` is one completion per sample (:func:`generate` then :func:`score`).
:func:`collect_step_batch` makes one step's batch: one call, or with ``algo.dynamic_sampling``
calls for more prompts until the batch holds ``rollout_batch_size`` informative groups.
"""

from __future__ import annotations

import abc
import logging
import math
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


@dataclass(frozen=True)
class Sampling:
    """How a producer samples: the training settings (:meth:`training`) or evaluation's."""

    temperature: float
    """0: greedy."""
    group_size: int
    return_routes: bool
    finish: bool = True
    """Apply :func:`finish_samples` (length shaping, truncation mask): for training, not for
    evaluation, which reports the rewards themselves."""

    @classmethod
    def training(cls, cfg: TrainConfig) -> Sampling:
        return cls(
            temperature=cfg.rollout.temperature,
            group_size=cfg.algo.num_return_sequences_in_group,
            return_routes=cfg.requests_rollout_routes,
        )


class SingleTurnProducer(SampleProducer):
    """One completion per sample: :func:`generate`, then :func:`score` (today's rollout)."""

    def __init__(
        self,
        rollout: RolloutEngine,
        task: Task,
        rewards: RewardRunner,
        cfg: TrainConfig,
        sampling: Optional[Sampling] = None,
    ):
        self.rollout, self.task, self.rewards, self.cfg = rollout, task, rewards, cfg
        self.sampling = sampling or Sampling.training(cfg)
        self.group_size = self.sampling.group_size

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        started = time.perf_counter()
        samples, sample_prompts = generate(
            self.rollout,
            self.task,
            list(prompts),
            self.cfg,
            step,
            temperature=self.sampling.temperature,
            group_size=self.sampling.group_size,
            return_routes=self.sampling.return_routes,
            first_index=first_index,
        )
        generated = time.perf_counter()
        reward_stats = score(samples, sample_prompts, self.rewards, self.task)
        if self.sampling.finish:
            reward_stats.update(finish_samples(samples, cfg=self.cfg))
        return ScoredSamples(
            samples,
            {
                **reward_stats,
                "time/rollout_s": generated - started,
                "time/reward_s": time.perf_counter() - generated,
            },
        )


def finish_samples(samples: Sequence[TrainSample], *, cfg: TrainConfig) -> dict[str, float]:
    """After scoring: DAPO's over-long penalty added to the rewards (``reward.overlong_buffer``)
    and truncated responses kept out of the loss (``algo.mask_truncated``); their metrics (none
    when both are off). Aborted samples are left as they are (already out of the loss)."""
    from megatron_gspo.reward.shaping import overlong_penalty

    metrics: dict[str, float] = {}
    live = [s for s in samples if s.finish_reason != "abort"]
    if cfg.reward.overlong_buffer and samples:
        penalties = []
        for sample in live:
            penalty = overlong_penalty(
                sample.response_length,
                cfg.algo.response_length,
                cfg.reward.overlong_buffer,
                cfg.reward.overlong_penalty_factor,
            )
            sample.reward += penalty
            penalties.append(penalty)
        metrics["reward_overlong_penalty_mean"] = sum(penalties) / len(samples)
        metrics["reward_overlong_penalized_frac"] = sum(p < 0 for p in penalties) / len(samples)
    if cfg.algo.mask_truncated and samples:
        truncated = [s for s in live if s.finish_reason == "length"]
        for sample in truncated:
            sample.loss_mask = torch.zeros(sample.response_length, dtype=torch.bool)
        metrics["truncated_masked_frac"] = len(truncated) / len(samples)
    return metrics


def collect_step_batch(
    producer: SampleProducer, stream: PromptStream, step: int, cfg: TrainConfig
) -> ScoredSamples:
    """The scored samples of RL step ``step``: ``algo.rollout_batch_size`` prompts from
    ``stream``, produced once; with ``algo.dynamic_sampling``, :func:`collect_informative_groups`.
    """
    if cfg.algo.dynamic_sampling:
        return collect_informative_groups(
            producer,
            stream,
            step,
            num_groups=cfg.algo.rollout_batch_size,
            max_rounds=cfg.algo.dynamic_sampling_max_rounds,
        )
    prompts = stream.next_batch(cfg.algo.rollout_batch_size)
    return producer.produce(prompts, step)


# ----------------------------------------------------------------------------------------------
# DAPO dynamic sampling
# ----------------------------------------------------------------------------------------------


def is_informative(group: Sequence[TrainSample]) -> bool:
    """Whether a group carries signal: the rewards of its samples (aborted ones have groups of
    their own and are left out) are not all equal, and some sample is trained on. Otherwise
    every group-relative advantage of it is 0."""
    members = [s for s in group if s.finish_reason != "abort"]
    trained = any(bool(s.response_mask().any()) for s in members)
    return trained and len({s.reward for s in members}) > 1


def collect_informative_groups(
    producer: SampleProducer,
    stream: PromptStream,
    step: int,
    *,
    num_groups: int,
    max_rounds: int,
) -> ScoredSamples:
    """DAPO dynamic sampling: ``num_groups`` informative groups (:func:`is_informative`).

    Round 1 produces ``num_groups`` prompts; each further round produces the missing number of
    groups divided by the share kept so far (at most ``num_groups``, at least the number
    missing). Informative groups are kept in the order they were produced; once there are
    enough, the surplus of the last round is dropped. Every prompt drawn from ``stream`` is
    consumed, kept or not (the stream's position moves past it, so a resumed run never serves it
    again). After ``max_rounds`` a short batch is filled with the latest dropped groups.

    Metrics (``dynamic_sampling/``): ``rounds``, ``prompts_consumed``, ``kept_group_frac`` (kept
    informative groups / groups produced), ``informative_group_frac`` (informative / produced),
    ``filled_groups``, ``reward_mean_produced`` (the mean reward before filtering: the batch's
    ``reward_mean`` is of the kept groups only). The producers' metrics are merged over rounds
    (:func:`merge_round_metrics`).
    """
    group_size = producer.group_size
    kept: list[list[TrainSample]] = []
    dropped: list[list[TrainSample]] = []
    parts: list[tuple[dict[str, float], int]] = []
    produced_groups = informative_groups = 0
    reward_sum = 0.0
    rounds = 0
    while len(kept) < num_groups and rounds < max_rounds:
        missing = num_groups - len(kept)
        if rounds == 0:
            count = num_groups
        else:
            share = max(informative_groups / produced_groups, 1.0 / num_groups)
            count = min(num_groups, max(missing, math.ceil(missing / share)))
        prompts = stream.next_batch(count)
        scored = producer.produce(prompts, step, first_index=produced_groups)
        rounds += 1
        parts.append((scored.metrics, len(scored.samples)))
        reward_sum += sum(s.reward for s in scored.samples)
        for index in range(len(prompts)):
            group = scored.samples[index * group_size : (index + 1) * group_size]
            if is_informative(group):
                informative_groups += 1
                (kept if len(kept) < num_groups else dropped).append(group)
            else:
                dropped.append(group)
        produced_groups += len(prompts)
    filled = 0
    while len(kept) < num_groups:
        kept.append(dropped.pop())
        filled += 1
    if filled:
        logger.warning(
            "dynamic sampling: only %d of %d groups were informative after %d rounds (%d prompts); "
            "filled the batch with %d groups whose rewards are all equal (advantage 0). Raise "
            "algo.dynamic_sampling_max_rounds, or check that the task is neither too hard nor "
            "too easy for the policy",
            num_groups - filled,
            num_groups,
            rounds,
            produced_groups,
            filled,
        )
    metrics = merge_round_metrics(parts)
    metrics.update(
        {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/prompts_consumed": float(produced_groups),
            "dynamic_sampling/kept_group_frac": (num_groups - filled) / produced_groups,
            "dynamic_sampling/informative_group_frac": informative_groups / produced_groups,
            "dynamic_sampling/filled_groups": float(filled),
            "dynamic_sampling/reward_mean_produced": reward_sum / (produced_groups * group_size),
        }
    )
    return ScoredSamples([sample for group in kept for sample in group], metrics)


_SUMMED_SUFFIXES = (
    "_errors",
    "_failures",
    "_timeouts",
    "_seconds",
    "_s",
    "_count",
    "_all_failed",
)


def merge_round_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of several :meth:`SampleProducer.produce` calls as one: counts and times
    (names ending in ``_errors``, ``_failures``, ``_timeouts``, ``_seconds``, ``_s``,
    ``_count``, ``_all_failed``) summed, ``*_min`` / ``*_max`` the extreme, the rest averaged weighted by
    each call's samples."""
    if len(parts) == 1:
        return dict(parts[0][0])
    names = list(dict.fromkeys(name for metrics, _ in parts for name in metrics))
    merged: dict[str, float] = {}
    for name in names:
        present = [(metrics[name], weight) for metrics, weight in parts if name in metrics]
        values = [value for value, _ in present]
        if name.endswith(_SUMMED_SUFFIXES):
            merged[name] = float(sum(values))
        elif name.endswith("_min"):
            merged[name] = float(min(values))
        elif name.endswith("_max"):
            merged[name] = float(max(values))
        else:
            total = sum(weight for _, weight in present)
            merged[name] = float(sum(v * w for v, w in present) / total) if total else 0.0
    return merged


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
        return_routes = cfg.requests_rollout_routes
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
                rollout_weight_versions=None
                if result.output_weight_versions is None
                else torch.as_tensor(result.output_weight_versions, dtype=torch.int64),
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
