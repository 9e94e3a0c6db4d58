"""Multi-turn rollouts: an environment's episodes, their turns batched across trajectories.

:class:`EnvironmentProducer` is a :class:`~megatron_gspo.production.producer.SampleProducer`.
For a list of prompts it runs ``group_size`` episodes per prompt: each engine call holds one
request per trajectory ready for a turn (its whole context as token ids), and each turn the
engine returns goes to the environments at once (``env.num_workers`` threads: tool calls run
concurrently, and beside the engine's next call). How it samples is a
:class:`~megatron_gspo.production.sampling.Sampling`; its environment and the environment's
limits are an :class:`EpisodeSettings`.

Turn scheduling (``env.turn_scheduling``), one loop for both: one engine call at a time, with
every trajectory ready for its next turn; then the loop waits for environment steps:

- ``lockstep`` (default) waits for every step in flight, so every call holds one turn of every
  live trajectory, turn 0 of all, then turn 1 of all, ...: a slow tool call holds up every
  episode, and the engine idles while the tools run;
- ``independent`` waits for at least one, so a trajectory goes on as soon as its own step is
  done and a slow tool call holds up only its own episode (verl's agent loop, slime, SkyRL and
  AReaL run episodes this way). Which call a turn lands in depends on the timing of the steps;
  what the turn is does not (its seed, below), so with a batch-invariant engine (the embedded
  engine at ``rollout.embedded_max_batch_size=1``) both schedules make the same trajectories.

A weight sync lands between two engine calls or, with partial rollouts, inside one (the engine
pauses the call in place): either way each token keeps the version and log-prob of the forward
that sampled it and its routes, per trajectory, whichever other trajectories shared its calls.
An aborted turn (the engine aborted its call: the run is stopping) aborts its trajectory, and
the producer then starts no more turns: the trajectories still running are aborted too.

A trajectory is the exact token sequence the engine saw and produced::

    tokens = context_0 + turn_0 + observation_0 + turn_1 + ... + turn_{K-1}

- ``loss_mask``: True on model tokens, False on observations (context);
- ``rollout_log_probs``: the engine's log-probs of model tokens, 0 on observations (masked);
- ``rollout_weight_versions``: the weight version that sampled each model token (an observation
  token carries its predecessor's). With asynchronous training a weight sync may land between
  two turns or inside one (partial rollouts): the episode then spans versions, each token
  keeping the version and log-prob that produced it, and ``weight_version`` is the oldest;
- ``rollout_routes`` ``[L - 1, M, K]`` (R3): each call of the engine returns the routes of its
  whole input (prefill) and of its new tokens but the last; a trajectory keeps, from each call,
  the rows no earlier call covered. So a turn's tokens keep the routes they were generated
  with, and an observation's rows (with the row of the last token of the turn before it) come
  from the prefill of the next turn: every row exactly once, each from the call that first ran
  it, never the last turn's routes for all; ``rollout_route_weights`` (R3 with replayed
  weights) are taken from the same calls, rows and order as the ids;
- ``turns`` (turn index per response token, -1 on observations) and ``turn_rewards`` (the
  environment's reward part per model turn).

Limits: ``env.max_turns`` model turns, ``env.max_tokens_per_turn`` tokens per turn and
``algo.response_length`` tokens after the prompt in all (model and observation tokens). A
trajectory that reaches one without the environment saying ``done`` is truncated (finish reason
``length``; ``env/truncated_*`` counts why); its observation that would not fit is not
appended. An environment that raises aborts its trajectory (finish reason ``abort``: out of the
loss, a group of its own, ``env/step_errors``).

Seeds: turn ``k`` of sample ``j`` of prompt ``i`` samples with ``derive_turn_seed(derive_seed(s_i,
j), k)`` where ``s_i`` is the single-turn seed of prompt ``i``; turn 0 therefore samples exactly
what one completion per sample would (``derive_turn_seed(x, 0) = x``), and no two turns of a
group share a seed.

Reward: the sum of the turns' parts, plus the reward functions' weighted score when
``reward.functions`` is not empty (they see the whole response, observations included, as
verl's and slime's multi-turn rewards do), then :func:`~megatron_gspo.production.producer.
finish_samples` (with the sampling's finishing rules, when it has any).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from megatron_gspo.config import TrainConfig
from megatron_gspo.envs.base import (
    Environment,
    EnvironmentFactory,
    EnvironmentSpec,
    EnvStart,
    EnvStep,
    Turn,
    load_environment,
    make_environment,
)
from megatron_gspo.production.producer import (
    SampleProducer,
    ScoredSamples,
    aborted_group_id,
    finish_samples,
)
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.scoring import score_responses
from megatron_gspo.production.task import Task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout import (
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    derive_seed,
    derive_turn_seed,
)
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt

logger = logging.getLogger(__name__)

TRUNCATIONS = ("max_turns", "turn_tokens", "budget")
"""Why a trajectory was truncated: too many turns, a turn cut at ``env.max_tokens_per_turn``,
the response budget ``algo.response_length`` spent."""

MAX_LOGGED_ERRORS = 5


@dataclass(frozen=True)
class EpisodeSettings:
    """The environment of the episodes and their limits (``env.*``); the response budget of a
    trajectory is its sampling's ``max_new_tokens`` (``algo.response_length``)."""

    environment: Optional[str]
    """``env.name``: the environment, in messages; the producer loads it unless it is given a
    factory."""
    options: Mapping[str, Any]
    """``env.options``: keyword arguments of every environment made."""
    max_turns: int
    """``env.max_turns``: most model turns of a trajectory."""
    max_tokens_per_turn: Optional[int]
    """``env.max_tokens_per_turn``; None: what is left of the response budget."""
    num_workers: int
    """``env.num_workers``: environment steps running at the same time."""
    turn_scheduling: str
    """``env.turn_scheduling``: ``lockstep`` (each engine call waits for every environment step
    in flight) or ``independent`` (for at least one); module docstring."""
    vocab_size: int
    """``model.vocab_size``: observation token ids must fall below it."""

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> EpisodeSettings:
        return cls(
            environment=cfg.env.name,
            # A read-only copy: the settings are frozen, and every environment sees the same.
            options=MappingProxyType(dict(cfg.env.options)),
            max_turns=cfg.env.max_turns,
            max_tokens_per_turn=cfg.env.max_tokens_per_turn,
            num_workers=cfg.env.num_workers,
            turn_scheduling=cfg.env.turn_scheduling,
            vocab_size=cfg.model.vocab_size,
        )


@dataclass
class Trajectory:
    """One episode being rolled out."""

    prompt: Prompt
    seed: int
    sample_index: int
    """Position among the samples of the call (aborted samples' group ids)."""
    environment: Optional[Environment] = None
    tokens: list[int] = field(default_factory=list)
    prompt_length: int = 0
    stop_token_ids: tuple[int, ...] = ()
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    """Per response token, the weight version that sampled it; an observation token carries the
    version of the token before it (it was sampled by none, and so never makes the trajectory
    look older than its model tokens)."""
    loss_mask: list[bool] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    route_chunks: list[np.ndarray] = field(default_factory=list)
    route_weight_chunks: list[np.ndarray] = field(default_factory=list)
    """The combine weights of ``route_chunks``' rows, chunk for chunk (when the engine reports
    them)."""
    route_rows: int = 0
    """Route rows collected so far: rows ``[0, route_rows)`` of the trajectory."""
    weight_version: Optional[int] = None
    num_turns: int = 0
    status: str = "running"
    """running, done (the environment ended it), truncated or aborted."""
    truncation: Optional[str] = None
    error: Optional[str] = None
    """Why the environment failed (reset or step raised, or answered something invalid)."""
    pending_turn: Optional[Turn] = None
    tool_calls: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0

    @property
    def response_length(self) -> int:
        return len(self.tokens) - self.prompt_length

    def add_turn(self, result: GenerateResult, request: GenerateRequest, budget: int) -> None:
        """Append the engine's turn (ids, log-probs, routes) and decide what happens next."""
        output = list(result.output_ids)
        self.tokens += output
        self.loss_mask += [True] * len(output)
        self.turns += [self.num_turns] * len(output)
        if result.output_log_probs is not None:
            self.log_probs += [float(value) for value in result.output_log_probs]
        else:
            self.log_probs += [0.0] * len(output)
        if result.routed_experts is not None:
            # The call's rows cover its input and new tokens but the last; keep those that no
            # earlier call covered (module docstring).
            end = len(request.input_ids) + len(output) - 1
            self.route_chunks.append(np.asarray(result.routed_experts)[self.route_rows : end])
            if result.routed_expert_weights is not None:
                weights = np.asarray(result.routed_expert_weights)[self.route_rows : end]
                self.route_weight_chunks.append(weights)
            self.route_rows = max(self.route_rows, end)
        version = int(result.weight_version)
        if result.output_weight_versions is not None:
            self.versions += [int(value) for value in result.output_weight_versions]
        else:
            self.versions += [version] * len(output)
        # An episode may span weight versions (a sync between turns, or inside one with
        # partial rollouts): the trajectory is as old as its oldest model token.
        self.weight_version = (
            version if self.weight_version is None else min(self.weight_version, version)
        )
        self.turn_rewards.append(0.0)
        turn = Turn(token_ids=output, index=self.num_turns)
        self.num_turns += 1
        if result.finish_reason == "abort":
            self.status = "aborted"
        elif result.finish_reason == "length":
            self.status = "truncated"
            self.truncation = "budget" if self.response_length >= budget else "turn_tokens"
        else:
            self.pending_turn = turn

    def add_step(self, step: EnvStep, *, max_turns: int, budget: int) -> None:
        """Take the environment's answer to the pending turn."""
        self.pending_turn = None
        self.turn_rewards[-1] = float(step.reward)
        self.tool_calls += int(step.tool_calls)
        self.tool_failures += int(step.tool_failures)
        self.tool_timeouts += int(step.tool_timeouts)
        if step.done:
            self.status = "done"
        elif self.num_turns >= max_turns:
            self.status, self.truncation = "truncated", "max_turns"
        elif self.response_length + len(step.observation_ids) >= budget:
            # Not even one model token would fit after the observation.
            self.status, self.truncation = "truncated", "budget"
        else:
            observation = [int(token) for token in step.observation_ids]
            self.tokens += observation
            self.loss_mask += [False] * len(observation)
            self.log_probs += [0.0] * len(observation)
            self.versions += [self.versions[-1] if self.versions else 0] * len(observation)
            self.turns += [-1] * len(observation)

    def sample(self) -> TrainSample:
        aborted = self.status == "aborted"
        if aborted and len(self.tokens) == self.prompt_length:
            # Aborted before its first turn (reset failed, or the run stopped): one masked filler
            # token, since every trained sample needs a response token (engine/batches.py).
            self.tokens.append(self.tokens[-1])
            self.loss_mask.append(False)
            self.log_probs.append(0.0)
            self.versions.append(self.weight_version or 0)
            self.turns.append(-1)
        routes = route_weights = None
        if self.route_chunks:
            routes = torch.from_numpy(np.concatenate(self.route_chunks, axis=0))
        if self.route_weight_chunks:
            if len(self.route_weight_chunks) != len(self.route_chunks):
                raise ValueError(
                    f"{len(self.route_weight_chunks)} engine calls of an episode reported route "
                    f"weights, {len(self.route_chunks)} reported routes; every call must report both"
                )
            route_weights = torch.from_numpy(np.concatenate(self.route_weight_chunks, axis=0))
        return TrainSample(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            prompt_length=self.prompt_length,
            group_id=aborted_group_id(self.sample_index) if aborted else self.prompt.group_id,
            loss_mask=torch.tensor(
                [False] * len(self.loss_mask) if aborted else self.loss_mask, dtype=torch.bool
            ),
            rollout_log_probs=torch.tensor(self.log_probs, dtype=torch.float32),
            rollout_weight_versions=torch.tensor(self.versions, dtype=torch.int64),
            rollout_routes=routes,
            rollout_route_weights=route_weights,
            turns=torch.tensor(self.turns, dtype=torch.int16),
            turn_rewards=torch.tensor(self.turn_rewards, dtype=torch.float64),
            reward=float(sum(self.turn_rewards)),
            finish_reason={"done": "stop", "truncated": "length"}.get(self.status, "abort"),
            weight_version=self.weight_version or 0,
        )


class EnvironmentProducer(SampleProducer):
    """Scored samples from an environment's episodes (module docstring)."""

    def __init__(
        self,
        rollout: RolloutEngine,
        task: Task,
        rewards: Optional[RewardRunner],
        sampling: Sampling,
        settings: EpisodeSettings,
        factory: Optional[EnvironmentFactory] = None,
    ):
        self.rollout, self.task, self.rewards = rollout, task, rewards
        self.sampling, self.settings = sampling, settings
        self.group_size = sampling.group_size
        self.factory = factory or load_environment(
            EnvironmentSpec(settings.environment, dict(settings.options))
        )
        self._errors_logged = 0

    # ------------------------------------------------------------------ the batch-level call

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        started = time.perf_counter()
        trajectories = self.start_episodes(prompts, step, first_index)
        try:
            generation_s, calls = self.play(trajectories)
        finally:
            for trajectory in trajectories:
                if trajectory.environment is not None:
                    self._close(trajectory)
        samples = [trajectory.sample() for trajectory in trajectories]
        scored = time.perf_counter()
        metrics = self.score(samples, trajectories)
        if self.sampling.finish is not None:
            metrics.update(finish_samples(samples, self.sampling.finish))
        metrics.update(episode_metrics(trajectories))
        metrics["env/engine_calls_count"] = float(calls)
        metrics["time/rollout_s"] = generation_s
        # Everything before scoring that is not generation: resets, and the environments' steps
        # while the engine had nothing to do (independent scheduling runs the rest beside it).
        metrics["time/env_s"] = scored - started - generation_s
        metrics["time/reward_s"] = time.perf_counter() - scored
        return ScoredSamples(samples, metrics)

    # ------------------------------------------------------------------ the stages

    def start_episodes(
        self, prompts: Sequence[Prompt], step: int, first_index: int
    ) -> list[Trajectory]:
        trajectories = []
        for index, prompt in enumerate(prompts):
            prompt_seed = self.sampling.prompt_seed(step, first_index + index)
            for j in range(self.group_size):
                trajectory = Trajectory(
                    prompt=prompt,
                    seed=derive_seed(prompt_seed, j),
                    sample_index=(first_index + index) * self.group_size + j,
                )
                try:
                    trajectory.environment = make_environment(
                        self.factory, self.task.tokenizer, self.settings.options
                    )
                    start: EnvStart = trajectory.environment.reset(prompt)
                    trajectory.tokens = [int(token) for token in start.context_ids]
                    trajectory.stop_token_ids = tuple(int(t) for t in start.stop_token_ids)
                    if not trajectory.tokens:
                        raise ValueError("reset() returned an empty context")
                except Exception as error:  # the environment's code: counted, never fatal
                    self._fail(trajectory, "reset", error)
                    trajectory.tokens = list(prompt.prompt_ids)
                trajectory.prompt_length = len(trajectory.tokens)
                trajectories.append(trajectory)
        return trajectories

    def play(self, trajectories: list[Trajectory]) -> tuple[float, int]:
        """Every trajectory's turns and steps to its end (module docstring, "Turn scheduling");
        the seconds spent in engine calls and their number. Lockstep is this loop waiting for
        every step in flight, independent this loop waiting for at least one."""
        independent = self.settings.turn_scheduling == "independent"
        wait_for = FIRST_COMPLETED if independent else ALL_COMPLETED
        ready = [t for t in trajectories if t.status == "running"]
        stepping: dict[Future, Trajectory] = {}
        generation_s, calls, aborted = 0.0, 0, False
        with ThreadPoolExecutor(self.settings.num_workers, thread_name_prefix="env") as pool:
            while ready or stepping:
                if aborted:
                    for trajectory in ready:  # the run is stopping: no more turns
                        trajectory.status = "aborted"
                elif ready:
                    began = time.perf_counter()
                    aborted = self.generate_turn(ready)
                    generation_s += time.perf_counter() - began
                    calls += 1
                    for trajectory in ready:
                        if trajectory.pending_turn is not None:
                            stepping[pool.submit(self.step_environment, trajectory)] = trajectory
                ready = []
                if not stepping:
                    break
                done, _ = wait(stepping, return_when=wait_for)
                # In the trajectories' order, whatever order the steps ended in: the order of
                # the next call's requests (and of the failures logged) never depends on it.
                for future in sorted(done, key=lambda f: stepping[f].sample_index):
                    trajectory = stepping.pop(future)
                    self.take_step(trajectory, future.result())
                    if trajectory.status == "running":
                        ready.append(trajectory)
        return generation_s, calls

    def generate_turn(self, ready: list[Trajectory]) -> bool:
        """One engine call with the next turn of every trajectory of ``ready``; whether the
        engine aborted any of them. Turn ``k`` of a trajectory samples with its seed for ``k``
        whichever call it lands in."""
        budget = self.sampling.max_new_tokens
        per_turn = self.settings.max_tokens_per_turn or budget
        eos = self.task.stop_token_ids
        requests = [
            self.sampling.request(
                t.tokens,
                seed=derive_turn_seed(t.seed, t.num_turns),
                stop_token_ids=[*eos, *(s for s in t.stop_token_ids if s not in eos)],
                max_new_tokens=min(per_turn, budget - t.response_length),
            )
            for t in ready
        ]
        aborted = False
        for trajectory, request, result in zip(
            ready, requests, self.rollout.generate(requests, n=1)
        ):
            trajectory.add_turn(result, request, budget)
            aborted |= result.finish_reason == "abort"
        return aborted

    @staticmethod
    def step_environment(trajectory: Trajectory) -> Any:
        """The environment's answer to the pending turn, or what it raised (in a worker
        thread: it touches nothing but its own environment)."""
        try:
            return trajectory.environment.step(trajectory.pending_turn)
        except Exception as error:  # the environment's code: counted, never fatal
            return error

    def take_step(self, trajectory: Trajectory, outcome: Any) -> None:
        """Apply an environment step's outcome (:meth:`step_environment`) to its trajectory."""
        problem = outcome if isinstance(outcome, Exception) else self._invalid(outcome)
        if problem is not None:
            self._fail(trajectory, "step", problem)
        else:
            trajectory.add_step(
                outcome, max_turns=self.settings.max_turns, budget=self.sampling.max_new_tokens
            )

    def score(self, samples: list[TrainSample], trajectories: list[Trajectory]) -> dict[str, float]:
        """Add the reward functions' score (when there are any) to the turns' parts."""
        if self.rewards is None:
            return {}
        scores, metrics = score_responses(
            self.rewards, self.task.tokenizer, [t.prompt for t in trajectories], samples
        )
        for sample, score in zip(samples, scores):
            sample.reward += score
        return metrics

    # ------------------------------------------------------------------ failures

    def _invalid(self, step: Any) -> Optional[Exception]:
        """What is wrong with an environment's answer (None: nothing)."""
        if not isinstance(step, EnvStep):
            return TypeError(f"returned {type(step).__name__}, not EnvStep")
        if not math.isfinite(step.reward):
            return ValueError(f"returned the reward {step.reward}, not a finite number")
        vocab = self.settings.vocab_size
        bad = [t for t in step.observation_ids if not 0 <= int(t) < vocab]
        if bad and not step.done:
            return ValueError(
                f"returned observation token ids outside the vocabulary [0, {vocab}): {bad[:5]}"
            )
        return None

    def _fail(self, trajectory: Trajectory, stage: str, error: Exception) -> None:
        trajectory.status = "aborted"
        trajectory.pending_turn = None
        trajectory.error = f"{stage}: {type(error).__name__}: {error}"
        if self._errors_logged < MAX_LOGGED_ERRORS:
            self._errors_logged += 1
            logger.warning(
                "environment %r failed in %s on %s (the trajectory is kept out of the loss): "
                "%s: %s",
                self.settings.environment,
                stage,
                trajectory.prompt.source,
                type(error).__name__,
                error,
            )

    def _close(self, trajectory: Trajectory) -> None:
        try:
            trajectory.environment.close()
        except Exception as error:
            logger.warning("environment %r: close() raised %s", self.settings.environment, error)


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``env/...``: turns per trajectory, truncations (and why), errors, tool calls and their
    success; counts are totals over the call, ``*_mean`` per trajectory."""
    count = len(trajectories)
    if not count:
        return {}
    turns = [t.num_turns for t in trajectories]
    calls = sum(t.tool_calls for t in trajectories)
    failures = sum(t.tool_failures for t in trajectories)
    observed = [sum(1 for kept in t.loss_mask if not kept) for t in trajectories]
    metrics = {
        "env/turns_mean": sum(turns) / count,
        "env/turns_max": float(max(turns)),
        "env/done_frac": sum(t.status == "done" for t in trajectories) / count,
        "env/truncated_frac": sum(t.status == "truncated" for t in trajectories) / count,
        "env/step_errors": float(sum(t.error is not None for t in trajectories)),
        "env/observation_tokens_mean": sum(observed) / count,
        "env/tool_calls_mean": calls / count,
        "env/tool_success_frac": (calls - failures) / calls if calls else 0.0,
        "env/tool_failures": float(failures),
        "env/tool_timeouts": float(sum(t.tool_timeouts for t in trajectories)),
    }
    for reason in TRUNCATIONS:
        metrics[f"env/truncated_{reason}_frac"] = (
            sum(t.truncation == reason for t in trajectories) / count
        )
    return metrics


def demonstration_sample(
    factory: EnvironmentFactory, prompt: Prompt, task: Task, settings: EpisodeSettings
) -> TrainSample:
    """The environment's expert episode of ``prompt`` (:meth:`Environment.demonstration`)
    played through its :meth:`~Environment.step`, as a supervised sample (advantage 1): the
    model turns in the loss, the environment's observations as context."""
    environment = make_environment(factory, task.tokenizer, settings.options)
    try:
        start = environment.reset(prompt)
        turns = environment.demonstration()
        if not turns:
            raise ValueError(
                f"sft_warmup_steps > 0 but environment {settings.environment!r} gives no demonstration "
                f"of the prompt at {prompt.source}; set sft_warmup_steps=0, or implement "
                "Environment.demonstration()"
            )
        tokens = [int(token) for token in start.context_ids]
        mask: list[bool] = []
        for index, turn_ids in enumerate(turns):
            tokens += [int(token) for token in turn_ids]
            mask += [True] * len(turn_ids)
            step = environment.step(Turn(token_ids=list(turn_ids), index=index))
            if step.done:
                break
            tokens += [int(token) for token in step.observation_ids]
            mask += [False] * len(step.observation_ids)
    finally:
        environment.close()
    return TrainSample(
        tokens=torch.tensor(tokens, dtype=torch.long),
        prompt_length=len(start.context_ids),
        group_id=prompt.group_id,
        loss_mask=torch.tensor(mask, dtype=torch.bool),
        advantages=torch.tensor(1.0),
    )


def demonstration_samples(
    factory: EnvironmentFactory, prompts: Sequence[Prompt], task: Task, settings: EpisodeSettings
) -> list[TrainSample]:
    """:func:`demonstration_sample` of every prompt, ``env.num_workers`` at a time (their tool
    calls run concurrently)."""
    with ThreadPoolExecutor(settings.num_workers, thread_name_prefix="env") as pool:
        return list(
            pool.map(lambda prompt: demonstration_sample(factory, prompt, task, settings), prompts)
        )
