"""What a reward function receives, the built-in functions by name, and resolving a name.

A reward function is ``fn(sample: RewardInput, **options) -> float``: ``options`` are keyword-only
and come from ``reward.options[name]``. It may raise; the runner counts and logs the failure and
scores ``reward.failure_reward`` (see :mod:`megatron_gspo.reward.runner`). It must return a finite
number.

A function may carry a ``check`` attribute: a callable taking the same keyword options, called
once when the runner starts, that raises :class:`ConfigError` when the function cannot work on
this machine (the code reward checks that its sandbox can isolate code here), so that the run
stops at start instead of failing every call.

Names: a built-in (:data:`BUILTIN_REWARDS`) or an import path ``package.module:function``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_gspo.config import ConfigError
from megatron_gspo.config.import_paths import load_named_callable


@dataclass(frozen=True)
class RewardInput:
    """One sample to score. Plain data, so it can be sent to a worker process."""

    prompt: str
    """Prompt text (after the chat template)."""
    response: str
    """Response text: ``tokenizer.decode(response_ids, skip_special_tokens=True)`` (as TRL and
    verl pass it), so format and exact-match checks do not see end-of-sequence markers."""
    answer: Optional[str] = None
    """Reference answer from the data set, if any."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The prompt's other columns (e.g. ``tests`` for the code reward) and ``task`` for the
    synthetic tasks."""
    prompt_ids: Sequence[int] = ()
    response_ids: Sequence[int] = ()
    finish_reason: str = "stop"
    """``stop`` (end-of-sequence or stop string), ``length`` (hit response_length) or ``abort``."""


RewardFunction = Callable[..., float]

BUILTIN_REWARDS: dict[str, str] = {
    "math": "megatron_gspo.reward.math_answer:math_reward",
    "exact_match": "megatron_gspo.reward.text:exact_match_reward",
    "format": "megatron_gspo.reward.text:format_reward",
    "code": "megatron_gspo.reward.code_execution:code_reward",
    "synthetic": "megatron_gspo.reward.synthetic:synthetic_reward",
}
"""Name -> import path of each built-in reward (imported only when used)."""


@dataclass(frozen=True)
class RewardSpec:
    """A configured reward function: how to find it and what to call it with."""

    name: str
    """As written in ``reward.functions`` (a built-in name or an import path)."""
    weight: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def import_path(self) -> str:
        return BUILTIN_REWARDS.get(self.name, self.name)

    @property
    def metric_name(self) -> str:
        """``math`` for a built-in; ``module_function`` for an import path."""
        if self.name in BUILTIN_REWARDS:
            return self.name
        module, _, function = self.name.rpartition(":")
        return f"{module.rsplit('.', 1)[-1]}_{function}"


def load_reward_function(spec: RewardSpec) -> Callable[[RewardInput], float]:
    """The callable for ``spec`` with its options bound; a :class:`ConfigError` for an unknown name,
    a failing import or an option the function does not take."""
    key = f"reward.functions[{spec.name!r}]"
    function = load_named_callable(
        key, spec.name, BUILTIN_REWARDS, "reward function", "function", placeholder="function"
    )
    _check_options(key, function, spec.options)
    return functools.partial(function, **spec.options) if spec.options else function


def check_reward_function(spec: RewardSpec, function: Callable[[RewardInput], float]) -> None:
    """Run the start-up ``check`` of ``function`` (see the module docstring), if it has one,
    with the spec's options; it raises :class:`ConfigError` when the function cannot work here."""
    check = getattr(getattr(function, "func", function), "check", None)
    if check is not None:
        check(**spec.options)


def _check_options(key: str, function: Callable, options: Mapping[str, Any]) -> None:
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check against
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    keywords = [p.name for p in parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = [name for name in options if name not in keywords and not accepts_any]
    if unknown:
        raise ConfigError(
            key,
            f"unknown option(s) {', '.join(map(repr, unknown))}",
            "options are passed to the function as keyword arguments",
            f"valid options: {', '.join(keywords) or '(none)'}",
        )


def reward_specs(
    functions: Sequence[str],
    weights: Sequence[float] = (),
    options: Optional[Mapping[str, Mapping[str, Any]]] = None,
) -> list[RewardSpec]:
    """One :class:`RewardSpec` per name (weights default to 1)."""
    weights = list(weights) or [1.0] * len(functions)
    options = options or {}
    return [
        RewardSpec(name=name, weight=float(weight), options=dict(options.get(name, {})))
        for name, weight in zip(functions, weights)
    ]


def check_score(value: Any) -> float:
    """A reward function's return value as a float; TypeError/ValueError if it is not a finite
    number (a NaN reward would poison every advantage of its group)."""
    if isinstance(value, bool):
        return float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"returned {value!r} ({type(value).__name__}), expected a finite float"
        ) from None
    if number != number or number in (float("inf"), float("-inf")):
        raise ValueError(f"returned {number}, expected a finite float")
    return number
