"""Environments of the environment tests (also loaded by import path in end-to-end runs).

They answer whatever the (untrained) model writes, so that episodes have several turns,
observations and tool calls without a trained policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from megatron_gspo.envs import Environment, EnvStart, EnvStep, Turn
from megatron_gspo.envs.tools import run_tool, tool_limits


class ScriptedEnvironment(Environment):
    """Answers every turn with ``observation`` (token ids) and ends after ``turns`` turns; turn
    ``k`` earns ``turn_reward * (k + 1)``. ``fail_at``: raise at that turn (-1: never;
    ``"reset"``: raise in ``reset``); ``context``: extra ids before the prompt's."""

    def __init__(
        self,
        *,
        tokenizer: Any = None,
        turns: int = 3,
        observation: Sequence[int] = (5, 6, 7),
        stop_token_ids: Sequence[int] = (),
        turn_reward: float = 0.0,
        fail_at: int | str = -1,
        context: Sequence[int] = (),
    ):
        self.turns, self.observation = turns, list(observation)
        self.stop_token_ids, self.turn_reward = list(stop_token_ids), turn_reward
        self.fail_at, self.context = fail_at, list(context)
        self.seen: list[list[int]] = []

    def reset(self, prompt) -> EnvStart:
        if self.fail_at == "reset":
            raise RuntimeError("scripted failure in reset")
        return EnvStart(
            context_ids=[*self.context, *prompt.prompt_ids], stop_token_ids=self.stop_token_ids
        )

    def step(self, turn: Turn) -> EnvStep:
        if turn.index == self.fail_at:
            raise RuntimeError(f"scripted failure at turn {turn.index}")
        self.seen.append(list(turn.token_ids))
        return EnvStep(
            observation_ids=self.observation,
            reward=self.turn_reward * (turn.index + 1),
            done=turn.index + 1 >= self.turns,
        )


class ToolScriptEnvironment(Environment):
    """Every turn runs the prompt's ``metadata["program"]`` in the sandbox as a tool call and
    answers with its output (or error) as ids of ``tokenizer``; ends after ``turns``; turns
    end at ``stop_token_ids`` too."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        turns: int = 2,
        tool_timeout_s: float = 2.0,
        isolation: str = "bubblewrap",
        stop_token_ids: Sequence[int] = (),
    ):
        self.tokenizer, self.turns = tokenizer, turns
        self.stop_token_ids = list(stop_token_ids)
        self.limits = tool_limits(
            tool_timeout_s=tool_timeout_s, tool_memory_mb=256, isolation=isolation, key="test"
        )
        self.program: Optional[str] = None

    def reset(self, prompt) -> EnvStart:
        self.program = prompt.metadata["program"]
        return EnvStart(context_ids=list(prompt.prompt_ids), stop_token_ids=self.stop_token_ids)

    def step(self, turn: Turn) -> EnvStep:
        result = run_tool(self.program, limits=self.limits)
        text = result.output if not result.failed else f"error: {result.output}"
        return EnvStep(
            observation_ids=self.tokenizer.encode(f"<{text.strip()}>", add_special_tokens=False),
            done=turn.index + 1 >= self.turns,
            tool_calls=1,
            tool_failures=int(result.failed),
            tool_timeouts=int(result.status == "timeout"),
        )
