"""Score a batch of samples with the configured reward functions.

``reward_b = sum_f weight_f * score_{f,b}`` over the functions ``f`` of ``reward.functions``.
Each ``score_{f,b}`` is one call with its own time limit (``reward.timeout_s``). A call that
raises, returns something other than a finite number, loses its worker, or times out scores
``reward.failure_reward`` for that function; it is counted (``reward_errors``,
``reward_timeouts``), logged with the function's name and the sample's index, and listed in
:attr:`RewardResult.failures` - never silently scored as zero.

A judge (``reward.judge``, :mod:`megatron_gspo.reward.judge`) is one more function, named
``judge``, weighted by ``reward.judge.weight``: it scores the whole batch in this process through
its engine, and its failures and time-outs are counted and logged the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config import ConfigError, RewardConfig
from megatron_gspo.reward.functions import (
    RewardInput,
    check_reward_function,
    load_reward_function,
    reward_specs,
)
from megatron_gspo.reward.judge import JudgeBackend, JudgeReward
from megatron_gspo.reward.pool import CallOutcome, ProcessPool, ThreadPool
from megatron_gspo.runtime.health import RunStopped

logger = logging.getLogger(__name__)

MAX_LOGGED_FAILURES = 20
"""Failures logged one by one per batch; the rest are summarised in one line."""


class RewardsFailedError(RunStopped):
    """A reward function failed on every sample of ``reward.max_failed_steps`` batches in a
    row."""


@dataclass(frozen=True)
class RewardFailure:
    sample_index: int
    function: str
    kind: str
    """``error`` or ``timeout``."""
    message: str


@dataclass
class RewardResult:
    """Scores of one batch of ``B`` samples."""

    rewards: list[float]
    """``[B]`` weighted sum over the functions (failed calls count as failure_reward)."""
    scores: dict[str, list[float]]
    """Function metric name -> ``[B]`` unweighted scores (failure_reward where the call failed)."""
    failures: list[RewardFailure] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward_mean/std/min/max`` (of ``rewards``), ``reward_<function>_mean``,
    ``reward_errors``, ``reward_timeouts`` (call counts), ``reward_functions_all_failed``
    (functions that failed on every sample), ``reward_seconds`` (wall clock)."""


class RewardRunner:
    """The configured reward functions and a worker pool to call them in.

    Construction resolves every function (unknown names, failing imports and unknown options
    raise :class:`ConfigError`), runs their start-up checks (``check``, see
    :mod:`megatron_gspo.reward.functions`; the code reward's sandbox) and starts the workers. Use as a context manager, or call
    :meth:`close`. ``judge_backend`` reaches the judge's engine; it is required when
    ``reward.judge.role`` is set (the driver builds it from the role's engine).
    """

    def __init__(self, config: RewardConfig, judge_backend: Optional[JudgeBackend] = None):
        self.config = config
        self.judge: Optional[JudgeReward] = None
        if config.judge.enabled:
            if judge_backend is None:
                raise ConfigError(
                    "reward.judge.role",
                    f"no engine for the judge role {config.judge.role!r}",
                    "the judge answers through its own engine, built from models.<role>",
                    f"set models.{config.judge.role}.hf_path (the driver builds its engine)",
                )
            self.judge = JudgeReward(config.judge, judge_backend)
        self.consecutive_failed_batches = 0
        """Batches in a row in which some function failed on every sample."""
        self.specs = reward_specs(config.functions, config.weights, config.options)
        names = [spec.metric_name for spec in self.specs]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(
                "reward.functions",
                f"{', '.join(duplicates)} listed more than once",
                "each function's score is reported under its own name",
                "list each function once (use reward.weights to weight it)",
            )
        # Resolving here, in the trainer, makes a bad name fail at start-up (with the valid names)
        # rather than in a worker; thread workers then call these very functions.
        functions = [load_reward_function(spec) for spec in self.specs]
        for spec, function in zip(self.specs, functions):
            check_reward_function(spec, function)
        # A judge-only reward starts no workers: nothing would run in them.
        self.pool: Optional[ProcessPool | ThreadPool] = None
        if self.specs and config.executor == "thread":
            self.pool = ThreadPool(functions, config.num_workers, config.timeout_s)
        elif self.specs:
            self.pool = ProcessPool(self.specs, config.num_workers, config.timeout_s)
        terms = [f"{spec.weight:g} * {spec.name}" for spec in self.specs]
        if self.judge is not None:
            terms.append(f"{config.judge.weight:g} * judge (models.{config.judge.role})")
        logger.info(
            "reward: %s (%d %s workers, %g s per call)",
            " + ".join(terms),
            config.num_workers,
            config.executor,
            config.timeout_s,
        )

    @property
    def columns(self) -> list[tuple[str, str, float]]:
        """``(name, metric name, weight)`` of each scoring function, the judge last."""
        columns = [(spec.name, spec.metric_name, spec.weight) for spec in self.specs]
        if self.judge is not None:
            columns.append((self.judge.name, self.judge.name, self.config.judge.weight))
        return columns

    def score(self, samples: Sequence[RewardInput]) -> RewardResult:
        """Score ``samples``; the result's lists follow their order."""
        start = time.monotonic()
        calls = [
            (function_index, sample)
            for sample in samples
            for function_index in range(len(self.specs))
        ]
        outcomes = self.pool.run(calls) if self.pool is not None else []
        num_functions = len(self.specs)
        # outcome_of(sample, column): the pool's functions, then the judge (one batched call).
        judge_outcomes: list[CallOutcome] = []
        judge_metrics: dict[str, float] = {}
        if self.judge is not None and samples:
            judge_outcomes, judge_metrics = self.judge.score(samples)
        columns = self.columns
        scores: dict[str, list[float]] = {metric: [] for _, metric, _ in columns}
        rewards: list[float] = []
        failures: list[RewardFailure] = []
        for sample_index in range(len(samples)):
            total = 0.0
            for column, (name, metric, weight) in enumerate(columns):
                outcome = (
                    outcomes[sample_index * num_functions + column]
                    if column < num_functions
                    else judge_outcomes[sample_index]
                )
                value = outcome.value
                if outcome.status != "ok":
                    value = self.config.failure_reward
                    failures.append(
                        RewardFailure(sample_index, name, outcome.status, outcome.message)
                    )
                scores[metric].append(value)
                total += weight * value
            rewards.append(total)
        self._log_failures(failures, len(samples))
        metrics = {**_metrics(rewards, scores, failures), **judge_metrics}
        metrics["reward_seconds"] = time.monotonic() - start
        all_failed = self._functions_that_failed_everywhere(failures, len(samples))
        metrics["reward_functions_all_failed"] = float(len(all_failed))
        self._stop_if_failing(all_failed, failures)
        return RewardResult(rewards=rewards, scores=scores, failures=failures, metrics=metrics)

    def _functions_that_failed_everywhere(
        self, failures: list[RewardFailure], num_samples: int
    ) -> list[str]:
        if num_samples == 0:
            return []
        failed_samples: dict[str, set[int]] = {}
        for failure in failures:
            failed_samples.setdefault(failure.function, set()).add(failure.sample_index)
        return [
            name for name, _, _ in self.columns if len(failed_samples.get(name, ())) == num_samples
        ]

    def _stop_if_failing(self, all_failed: list[str], failures: list[RewardFailure]) -> None:
        self.consecutive_failed_batches = self.consecutive_failed_batches + 1 if all_failed else 0
        limit = self.config.max_failed_steps
        if not limit or self.consecutive_failed_batches < limit:
            return
        last = next(failure for failure in failures if failure.function == all_failed[0])
        raise RewardsFailedError(
            f"reward {', '.join(map(repr, all_failed))} failed on every sample of "
            f"{self.consecutive_failed_batches} batches in a row (last: {last.kind}: "
            f"{last.message})",
            f"every sample scores reward.failure_reward={self.config.failure_reward:g}, so the "
            "advantages carry no signal and the policy would train on noise",
            "fix the function (its failures are logged above; a prompt file needs a reward "
            "that fits its answers, e.g. reward.functions=[math]), or raise "
            "reward.max_failed_steps (0 never stops)",
        )

    def _log_failures(self, failures: list[RewardFailure], num_samples: int) -> None:
        for failure in failures[:MAX_LOGGED_FAILURES]:
            logger.warning(
                "reward %r %s on sample %d (scored %g): %s",
                failure.function,
                "timed out" if failure.kind == "timeout" else "failed",
                failure.sample_index,
                self.config.failure_reward,
                failure.message,
            )
        if len(failures) > MAX_LOGGED_FAILURES:
            logger.warning(
                "... and %d more reward failures in this batch of %d samples",
                len(failures) - MAX_LOGGED_FAILURES,
                num_samples,
            )

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _metrics(
    rewards: list[float], scores: dict[str, list[float]], failures: list[RewardFailure]
) -> dict[str, float]:
    metrics = {
        "reward_errors": float(sum(failure.kind == "error" for failure in failures)),
        "reward_timeouts": float(sum(failure.kind == "timeout" for failure in failures)),
    }
    if not rewards:
        return metrics
    mean = math.fsum(rewards) / len(rewards)
    metrics["reward_mean"] = mean
    metrics["reward_std"] = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))
    metrics["reward_min"] = min(rewards)
    metrics["reward_max"] = max(rewards)
    for name, values in scores.items():
        metrics[f"reward_{name}_mean"] = math.fsum(values) / len(values)
    return metrics
