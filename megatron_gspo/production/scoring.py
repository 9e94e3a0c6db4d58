"""The reward functions' score of generated samples: one rule for single completions, an
environment's episodes and an agent's episodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from megatron_gspo.reward import RewardInput, RewardRunner
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


def score_responses(
    rewards: RewardRunner,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    samples: Sequence[TrainSample],
) -> tuple[list[float], dict[str, float]]:
    """The reward functions' weighted score of each sample and the scoring's metrics.

    ``samples[b]`` answers ``prompts[b]``: the functions see its whole response,
    ``tokens[prompt_length:]`` decoded without special tokens (an episode's observations
    included, as verl's and slime's multi-turn rewards do), its ids and its finish reason.
    Failed calls score ``reward.failure_reward`` and are counted
    (:class:`~megatron_gspo.reward.RewardRunner`). The metrics leave out ``reward_mean`` and
    ``reward_max``, which the step computes from the samples' final rewards."""
    inputs = []
    for prompt, sample in zip(prompts, samples):
        response_ids = sample.tokens[sample.prompt_length :].tolist()
        inputs.append(
            RewardInput(
                prompt=prompt.prompt_text,
                response=tokenizer.decode(response_ids, skip_special_tokens=True),
                answer=prompt.answer,
                metadata=prompt.metadata,
                prompt_ids=sample.tokens[: sample.prompt_length].tolist(),
                response_ids=response_ids,
                finish_reason=sample.finish_reason,
            )
        )
    result = rewards.score(inputs)
    metrics = {
        k: float(v) for k, v in result.metrics.items() if k not in ("reward_mean", "reward_max")
    }
    return [float(reward) for reward in result.rewards], metrics
