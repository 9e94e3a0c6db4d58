"""The one-turn environment: the prompt, one completion, done. Scored by the reward functions
alone, it makes the samples of a run without an environment (the contract test of the
environment rollout: tests/envs/test_environment_rollout.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from megatron_gspo.envs.base import Environment, EnvStart, EnvStep, Turn

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


class SingleTurnEnvironment(Environment):
    def __init__(self, *, tokenizer: Any = None):
        del tokenizer

    def reset(self, prompt: Prompt) -> EnvStart:
        return EnvStart(context_ids=list(prompt.prompt_ids))

    def step(self, turn: Turn) -> EnvStep:
        return EnvStep(done=True)
