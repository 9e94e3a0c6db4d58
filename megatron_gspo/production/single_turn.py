"""One completion per sample: generate, then score."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_gspo.production.producer import (
    SampleProducer,
    ScoredSamples,
    aborted_group_id,
    finish_samples,
)
from megatron_gspo.production.retokenization import Retokenizer
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.scoring import score_responses
from megatron_gspo.production.task import Task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout import RolloutEngine
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


class SingleTurnProducer(SampleProducer):
    """One completion per sample: :func:`generate`, then :func:`score` (today's rollout); with
    ``sampling.retokenize``, the responses are decoded and encoded again in between
    (:class:`~megatron_gspo.production.retokenization.Retokenizer`)."""

    def __init__(
        self, rollout: RolloutEngine, task: Task, rewards: RewardRunner, sampling: Sampling
    ):
        self.rollout, self.task, self.rewards, self.sampling = rollout, task, rewards, sampling
        self.group_size = sampling.group_size
        self.retokenizer = Retokenizer(task.tokenizer) if sampling.retokenize else None

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        started = time.perf_counter()
        samples, sample_prompts = generate(
            self.rollout, self.task, list(prompts), self.sampling, step, first_index=first_index
        )
        generated = time.perf_counter()
        # What the rewards and the trainer see: the ids a naive harness would train on.
        retokenized = self.retokenizer(samples) if self.retokenizer is not None else {}
        reward_stats = score(samples, sample_prompts, self.rewards, self.task)
        if self.sampling.finish is not None:
            reward_stats.update(finish_samples(samples, self.sampling.finish))
        return ScoredSamples(
            samples,
            {
                **retokenized,
                **reward_stats,
                "time/rollout_s": generated - started,
                "time/reward_s": time.perf_counter() - generated,
            },
        )


def generate(
    rollout: RolloutEngine,
    task: Task,
    prompts: list[Prompt],
    sampling: Sampling,
    step: int,
    *,
    first_index: int = 0,
) -> tuple[list[TrainSample], list[Prompt]]:
    """``sampling.group_size`` responses per prompt, as :class:`TrainSample`\\ s, and the prompt
    of each sample.

    Sampling seeds derive from (run seed, step, ``first_index`` + prompt position), so a resumed
    run samples exactly what the uninterrupted one would. An aborted request keeps its sample
    with an empty loss mask and a group of its own (advantage 0): it is counted, never trained
    on.
    """
    group_size = sampling.group_size
    requests = [
        sampling.request(
            prompt.prompt_ids,
            seed=sampling.prompt_seed(step, first_index + index),
            stop_token_ids=task.stop_token_ids,
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
                rollout_route_weights=None
                if result.routed_expert_weights is None
                else torch.from_numpy(result.routed_expert_weights),
                finish_reason=result.finish_reason,
                weight_version=result.weight_version,
            )
        )
        sample_prompts.append(prompt)
    return samples, sample_prompts


def score(
    samples: list[TrainSample], prompts: list[Prompt], rewards: RewardRunner, task: Task
) -> dict[str, float]:
    """Score every sample against its prompt (``prompts[i]`` for ``samples[i]``; the rule of
    :func:`~megatron_gspo.production.scoring.score_responses`); failures are counted in the
    returned metrics and logged by the runner."""
    scores, metrics = score_responses(rewards, task.tokenizer, prompts, samples)
    for sample, reward in zip(samples, scores):
        sample.reward = reward
    return metrics
