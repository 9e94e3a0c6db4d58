"""The environment interface: one episode of a multi-turn rollout, token in and token out.

An episode alternates model turns and observations::

    start = env.reset(prompt)                  # the context the first turn continues
    while True:
        turn = <the model's tokens, generated from the context so far>
        step = env.step(turn)                  # observation tokens, reward part, done
        if step.done: break
        context += turn + step.observation_ids

Everything is token ids. The environment may decode the model's turn to read it (a tool call)
and encodes its observations itself; the trajectory the trainer sees is exactly the tokens the
rollout engine was given and produced, never text encoded again (which need not give the same
ids: a tokenizer's merges, special tokens, whitespace). Observation tokens are context: they
enter no loss.

An environment is a class (or any callable) called once per trajectory as
``factory(tokenizer=..., **options)`` with ``env.options``; it is named in ``env.name`` by a
built-in name (:data:`BUILTIN_ENVIRONMENTS`) or an import path ``package.module:Class``, like a
reward function. It runs in the trainer's process (rank 0); code it executes for the model
belongs in the sandbox (:mod:`megatron_gspo.envs.tools`). ``reset`` and ``step`` may raise: the
trajectory is then aborted (kept out of the loss) and counted in ``env/step_errors``.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.config import ConfigError
from megatron_gspo.config.import_paths import load_named_callable

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from megatron_gspo.data.prompts import Prompt


@dataclass(frozen=True)
class EnvStart:
    """What an episode starts from."""

    context_ids: Sequence[int]
    """The tokens the model's first turn continues: usually the prompt's ids, or a context the
    environment builds from the prompt (a system message listing its tools)."""
    stop_token_ids: Sequence[int] = ()
    """Tokens that end a model turn, besides the tokenizer's EOS (which always does): a tool
    call's closing tag, so that the environment can answer it."""


@dataclass(frozen=True)
class Turn:
    """One model turn, as the rollout engine produced it. Only turns that a stop token ended
    reach the environment (the stop token is the last id): a turn cut by a token limit ends
    its trajectory as truncated instead."""

    token_ids: Sequence[int]
    index: int
    """0 for the first turn."""


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to a model turn."""

    observation_ids: Sequence[int] = ()
    """Tokens appended after the turn when the episode goes on (a tool's output, the next user
    message, with whatever template tokens frame them); ignored when ``done``."""
    reward: float = 0.0
    """This turn's part of the reward (the trajectory's reward is the sum of its parts plus the
    reward functions' score; per-turn advantages use the parts, docs/algorithms.md)."""
    done: bool = False
    """The episode ended (the model answered): the trajectory is finished, not truncated."""
    tool_calls: int = 0
    """Tool calls this turn made."""
    tool_failures: int = 0
    """Of them, calls that failed (raised, exited non-zero, ran out of time or memory); the
    observation says so to the model."""
    tool_timeouts: int = 0
    """Of the failures, calls stopped by their time limit."""


class Environment(abc.ABC):
    """One episode (module docstring). Made fresh for every trajectory."""

    @abc.abstractmethod
    def reset(self, prompt: Prompt) -> EnvStart:
        """Begin the episode of ``prompt`` (its ids, text, answer and metadata)."""

    @abc.abstractmethod
    def step(self, turn: Turn) -> EnvStep:
        """React to the model's turn."""

    def demonstration(self) -> Optional[list[list[int]]]:
        """The model turns of an expert episode of the prompt given to :meth:`reset`, for the
        supervised cold start (``sft_warmup_steps``), or None when the environment has none.
        They are played through :meth:`step`, so the observations between them are the
        environment's own."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook with nothing to release by default
        """Release what the episode holds."""


EnvironmentFactory = Callable[..., Environment]

BUILTIN_ENVIRONMENTS: dict[str, str] = {
    "single_turn": "megatron_gspo.envs.single_turn:SingleTurnEnvironment",
    "python_tool": "megatron_gspo.envs.tools:PythonToolEnvironment",
    "multiply_tool": "megatron_gspo.envs.multiply:MultiplyToolEnvironment",
}
"""Name -> import path of each built-in environment (imported only when used)."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A configured environment: how to find it and what to build it with."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def import_path(self) -> str:
        return BUILTIN_ENVIRONMENTS.get(self.name, self.name)


def load_environment(spec: EnvironmentSpec) -> EnvironmentFactory:
    """The factory of ``spec`` (a class or callable taking ``tokenizer`` and the options); a
    :class:`ConfigError` for an unknown name, a failing import or an option it does not take.
    A factory with a ``check(**options)`` attribute (a classmethod) is asked at start whether it
    can work here (the tool environments check the sandbox), and raises ConfigError if not."""
    key = f"env.name={spec.name!r}"
    factory = load_named_callable(
        "env.name",
        spec.name,
        BUILTIN_ENVIRONMENTS,
        "environment",
        "class or function",
        placeholder="Class",
    )
    _check_options(key, factory, spec.options)
    check = getattr(factory, "check", None)
    if callable(check):
        check(**spec.options)
    return factory


def _check_options(key: str, factory: Callable, options: Mapping[str, Any]) -> None:
    try:
        parameters = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [
        name
        for name, p in parameters.items()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        and name != "tokenizer"
    ]
    unknown = [name for name in options if name not in accepted]
    if unknown:
        raise ConfigError(
            "env.options",
            f"unknown option(s) {', '.join(map(repr, unknown))} for {key}",
            "options are passed to the environment as keyword arguments",
            f"valid options: {', '.join(accepted) or '(none)'}",
        )


def make_environment(
    factory: EnvironmentFactory, tokenizer: PreTrainedTokenizerBase, options: Mapping[str, Any]
) -> Environment:
    """One fresh environment (one per trajectory)."""
    return factory(tokenizer=tokenizer, **options)
