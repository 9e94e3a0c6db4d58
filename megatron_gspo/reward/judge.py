"""The model-graded reward: a judge model reads each sample through a template and answers with
a verdict or a score (``reward.judge.*``, :class:`~megatron_gspo.config.JudgeConfig`).

Unlike the reward functions, the judge does not run in the worker pool: it needs the judge's
engine, which lives in the driver's process (embedded) or behind HTTP clients the driver owns
(SGLang), and it is asked once per batch, not once per sample, so that the engine batches the
step's judgements (one ``generate`` call per round). What reaches the engine is a
:class:`JudgeBackend` (:class:`~megatron_gspo.rollout.judge_backend.EngineJudgeBackend`: texts in,
answers out, with a time limit); this module renders the prompts, parses the answers, retries
the failed ones and turns each sample's end into a :class:`~megatron_gspo.reward.pool.CallOutcome`,
which the runner counts like any reward call (docs/judges.md).

Answer formats (``reward.judge.format``):

- ``verdict``: the answer's first word (a run of letters and digits, case folded) looked up in
  ``reward.judge.verdicts`` (``yes`` -> 1, ``no`` -> 0 by default);
- ``score``: the answer's first number (``7``, ``0.5``, ``-1``, ``8/10`` reads 8), which must lie
  in ``[score_min, score_max]``; the reward is ``(score - score_min) / (score_max - score_min)``.

Anything else is unparsable: asked again while ``max_retries`` allows, then an ``error``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

from megatron_gspo.config import JudgeConfig
from megatron_gspo.reward.functions import RewardInput
from megatron_gspo.reward.pool import CallOutcome

logger = logging.getLogger(__name__)

JUDGE_REWARD_NAME = "judge"
"""The judge's name among the reward functions (``reward_judge_mean``, failure messages)."""

_FIRST_WORD = re.compile(r"[^\W_]+")
_FIRST_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")


@dataclass(frozen=True)
class JudgeReply:
    """How one judge request ended: ``ok`` with the answer's text, or ``error`` / ``timeout``
    with what happened."""

    status: str
    text: str = ""
    message: str = ""


class JudgeBackend(Protocol):
    """Texts to a judge model's answers (implemented over a rollout engine by
    :class:`megatron_gspo.rollout.judge_backend.EngineJudgeBackend`)."""

    def complete(self, prompts: Sequence[str], timeout_s: float) -> list[JudgeReply]:
        """One answer per prompt, in order, from one batched engine call; requests still
        running after ``timeout_s`` are stopped and come back as ``timeout``."""
        ...


def render_judge_prompt(template: str, sample: RewardInput) -> str:
    """``template`` with ``{prompt}``, ``{response}`` and ``{answer}`` (empty when the data set
    has none) replaced by the sample's texts."""
    return template.format(
        prompt=sample.prompt, response=sample.response, answer=sample.answer or ""
    )


def parse_judgement(text: str, judge: JudgeConfig) -> Optional[float]:
    """The reward an answer gives (the module docstring's formats), or None when the answer is
    unparsable."""
    if judge.format == "verdict":
        match = _FIRST_WORD.search(text)
        if match is None:
            return None
        verdicts = {str(word).casefold(): float(value) for word, value in judge.verdicts.items()}
        return verdicts.get(match.group().casefold())
    match = _FIRST_NUMBER.search(text)
    if match is None:
        return None
    score = float(match.group())
    if not judge.score_min <= score <= judge.score_max:
        return None
    return (score - judge.score_min) / (judge.score_max - judge.score_min)


class JudgeReward:
    """Scores a batch of samples with a judge (see the module docstring).

    :meth:`score` returns one :class:`CallOutcome` per sample (``ok`` with the parsed reward,
    ``error`` for an unparsable answer or an engine failure, ``timeout``) and the judge's
    metrics: ``judge_latency_s`` (wall clock of the batch's engine calls), ``judge_calls``
    (engine calls: 1 + retry rounds), ``judge_retries`` (requests asked again),
    ``judge_failures`` (samples without a judgement after every retry), ``judge_timeouts`` and
    ``judge_unparsable`` (answers, retried or not, that timed out or could not be read).
    """

    name = JUDGE_REWARD_NAME

    def __init__(self, config: JudgeConfig, backend: JudgeBackend):
        self.config = config
        self.backend = backend

    def score(self, samples: Sequence[RewardInput]) -> tuple[list[CallOutcome], dict[str, float]]:
        prompts = [render_judge_prompt(self.config.template, sample) for sample in samples]
        outcomes: list[Optional[CallOutcome]] = [None] * len(samples)
        counts = dict.fromkeys(("calls", "retries", "timeouts", "unparsable"), 0)
        latency = 0.0
        pending = list(range(len(samples)))
        for attempt in range(self.config.max_retries + 1):
            if not pending:
                break
            if attempt:
                counts["retries"] += len(pending)
            started = time.monotonic()
            replies = self.backend.complete(
                [prompts[index] for index in pending], self.config.timeout_s
            )
            seconds = time.monotonic() - started
            latency += seconds
            counts["calls"] += 1
            if len(replies) != len(pending):
                raise RuntimeError(
                    f"the judge backend answered {len(replies)} of {len(pending)} prompts"
                )
            failed = []
            for index, reply in zip(pending, replies):
                outcome = self._outcome(reply, seconds)
                counts["timeouts"] += outcome.status == "timeout"
                counts["unparsable"] += outcome.message.startswith("unparsable")
                outcomes[index] = outcome
                if outcome.status != "ok":
                    failed.append(index)
            pending = failed
        metrics = {
            "judge_latency_s": latency,
            "judge_calls": float(counts["calls"]),
            "judge_retries": float(counts["retries"]),
            "judge_failures": float(len(pending)),
            "judge_timeouts": float(counts["timeouts"]),
            "judge_unparsable": float(counts["unparsable"]),
        }
        return list(outcomes), metrics

    def _outcome(self, reply: JudgeReply, seconds: float) -> CallOutcome:
        if reply.status == "timeout":
            return CallOutcome(
                "timeout",
                float("nan"),
                f"no judgement after {self.config.timeout_s:g} s (reward.judge.timeout_s)"
                + (f": {reply.message}" if reply.message else ""),
                seconds,
            )
        if reply.status != "ok":
            return CallOutcome("error", float("nan"), f"judge engine: {reply.message}", seconds)
        value = parse_judgement(reply.text, self.config)
        if value is None:
            return CallOutcome(
                "error",
                float("nan"),
                f"unparsable judge answer {reply.text[:200]!r} (reward.judge.format="
                f"{self.config.format}{_expected(self.config)})",
                seconds,
            )
        return CallOutcome("ok", value, "", seconds)


def _expected(judge: JudgeConfig) -> str:
    if judge.format == "verdict":
        return ", expected a first word among " + ", ".join(map(repr, judge.verdicts))
    return f", expected a first number in [{judge.score_min:g}, {judge.score_max:g}]"
