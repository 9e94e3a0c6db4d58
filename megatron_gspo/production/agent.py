"""Episodes run by a user's agent program through the OpenAI-compatible endpoint.

:class:`AgentProducer` is a :class:`~megatron_gspo.production.producer.SampleProducer`. For each
sample it opens a session on the run's :class:`~megatron_gspo.rollout.chat_endpoint.ChatEndpoint`
and calls the agent function (``agent.function``) with an :class:`AgentSession`: the endpoint's
URL and key, the session's header, the prompt. The function runs its loop with any OpenAI client
and returns a reward; ``agent.num_workers`` episodes run at the same time (threads: an agent
mostly waits for the endpoint and its tools). The session's recorded calls become the samples:

- one sample per episode (default): the trajectory ``context + turn_0 + new_0 + turn_1 + ...``
  (the endpoint's token history; the model's tokens in the loss, the appended messages out),
  with the engine's log-probs, per-token weight versions and R3 routes (each route row from the
  call that first ran it, as :mod:`~megatron_gspo.production.episodes` does). An episode whose
  agent rewrote its context between turns has no such sequence: it is kept out of the loss;
  ``agent/rewritten_episodes`` counts such episodes (with per-turn samples too, which train
  them);
- one sample per model turn (``agent.per_turn_samples``): the call's input as the prompt, its
  output as the response, every sample of the episode with the episode's reward, its turn
  index in ``turns`` and the episode's key in ``metadata["episode"]``, which the advantage
  stage uses to count the episode once (``trainer/stages.py``).

Reward: the agent function's return value (a finite number), plus the reward functions'
weighted score when ``reward.functions`` (or a judge) is set, by the environments' rule
(:func:`~megatron_gspo.production.scoring.score_responses`: failures score
``reward.failure_reward`` and are counted). The functions see the episode's conversation as the
model last saw it: the last call's input and output after the part it shares with the first
call's input (the prompt); for an episode that never rewrote its context, that is its
trajectory's response. Every sample of the episode gets the sum. An agent that raises, returns
something else or makes no model call aborts its episode (finish reason ``abort``: out of the
loss, a group of its own, ``agent/errors``). An episode the endpoint ended for its budget or
turn limit is truncated (finish reason ``length``).

Seeds: the session of sample ``j`` of prompt ``i`` samples turn ``k`` with
``derive_turn_seed(derive_seed(s_i, j), k)``, ``s_i`` the prompt's seed, as the environments'
episodes.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from megatron_gspo.config import TrainConfig
from megatron_gspo.config.import_paths import load_named_callable
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
from megatron_gspo.rollout import derive_seed
from megatron_gspo.rollout.chat_endpoint import (
    SESSION_HEADER,
    ChatEndpoint,
    ChatSession,
    ModelCall,
    SessionSettings,
)
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt

logger = logging.getLogger(__name__)

MAX_LOGGED_ERRORS = 5


@dataclass(frozen=True)
class AgentSession:
    """What an agent function receives: where to send its requests and the prompt."""

    base_url: str
    """The endpoint's ``/v1`` URL: ``OpenAI(base_url=session.base_url, ...)``."""
    api_key: str
    """The run's key: ``OpenAI(api_key=session.api_key, ...)``."""
    session_id: str
    prompt: str
    """The prompt's text (after the data's chat template, when ``data.apply_chat_template``)."""
    answer: Optional[str]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def headers(self) -> dict[str, str]:
        """Headers that put every request in this session: ``OpenAI(default_headers=...)``."""
        return {SESSION_HEADER: self.session_id}


AgentFunction = Callable[[AgentSession], float]


@dataclass(frozen=True)
class AgentSettings:
    """``agent.*`` resolved against the tokenizer."""

    function: str
    max_turns: int
    max_tokens_per_turn: Optional[int]
    num_workers: int
    stop_token_ids: tuple[int, ...]
    """``agent.stop_tokens`` as ids, with the tokenizer's EOS."""
    per_turn_samples: bool

    @classmethod
    def from_config(cls, cfg: TrainConfig, task: Task) -> AgentSettings:
        stops = list(task.stop_token_ids)
        for token in cfg.agent.stop_tokens:
            ids = task.tokenizer(token, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ValueError(
                    f"agent.stop_tokens: {token!r} is {len(ids)} tokens of the tokenizer, not "
                    "one; list the chat template's end-of-turn token"
                )
            stops += [int(ids[0])] if ids[0] not in stops else []
        return cls(
            function=str(cfg.agent.function),
            max_turns=cfg.agent.max_turns,
            max_tokens_per_turn=cfg.agent.max_tokens_per_turn,
            num_workers=cfg.agent.num_workers,
            stop_token_ids=tuple(stops),
            per_turn_samples=cfg.agent.per_turn_samples,
        )


def load_agent_function(path: str) -> AgentFunction:
    """The agent function named ``package.module:function``."""
    return load_named_callable(
        "agent.function", path, {}, "agent function", "function", "run_episode"
    )


class AgentProducer(SampleProducer):
    """Scored samples from an agent program's episodes (module docstring)."""

    def __init__(
        self,
        endpoint: ChatEndpoint,
        task: Task,
        rewards: Optional[RewardRunner],
        sampling: Sampling,
        settings: AgentSettings,
        function: Optional[AgentFunction] = None,
    ):
        self.endpoint, self.task, self.rewards = endpoint, task, rewards
        self.sampling, self.settings = sampling, settings
        self.group_size = sampling.group_size
        self.function = function or load_agent_function(settings.function)
        self._errors_logged = 0

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        started = time.perf_counter()
        episodes = []
        for index, prompt in enumerate(prompts):
            prompt_seed = self.sampling.prompt_seed(step, first_index + index)
            for j in range(self.group_size):
                sample_index = (first_index + index) * self.group_size + j
                session_id = self.endpoint.open_session(
                    self._session_settings(derive_seed(prompt_seed, j)),
                    session_id=f"step{step}-sample{sample_index}-{time.monotonic_ns()}",
                )
                episodes.append((prompt, sample_index, session_id))
        with ThreadPoolExecutor(self.settings.num_workers, thread_name_prefix="agent") as pool:
            outcomes = list(pool.map(lambda episode: self._run(*episode), episodes))
        samples: list[TrainSample] = []
        counts = {"errors": 0, "rewritten": 0, "truncated": 0, "turns": 0, "rewrites": 0}
        # Per episode that the reward functions score: its prompt, its view and its samples.
        scored: list[tuple[Prompt, TrainSample, list[TrainSample]]] = []
        for (prompt, sample_index, session_id), outcome in zip(episodes, outcomes):
            session = self.endpoint.close_session(session_id)
            episode = self._samples(prompt, sample_index, session, outcome, counts)
            samples += episode
            # An aborted episode is out of the loss: scoring it would only spend reward calls.
            if self.rewards is not None and episode[-1].finish_reason != "abort":
                view = scoring_view(session.calls)
                view.finish_reason = episode[-1].finish_reason
                scored.append((prompt, view, episode))
        metrics: dict[str, float] = {}
        scoring_started = time.perf_counter()
        if scored:
            scores, reward_metrics = score_responses(
                self.rewards,
                self.task.tokenizer,
                [prompt for prompt, _, _ in scored],
                [view for _, view, _ in scored],
            )
            for (_, _, episode), score in zip(scored, scores):
                for sample in episode:
                    sample.reward += score
            metrics.update(reward_metrics)
        scoring_seconds = time.perf_counter() - scoring_started
        if self.sampling.finish is not None:
            metrics.update(finish_samples(samples, self.sampling.finish))
        count = max(len(episodes), 1)
        metrics.update(
            {
                "agent/errors": float(counts["errors"]),
                "agent/rewritten_episodes": float(counts["rewritten"]),
                "agent/rewrites_mean": counts["rewrites"] / count,
                "agent/truncated_frac": counts["truncated"] / count,
                "agent/turns_mean": counts["turns"] / count,
                "agent/samples_per_episode": len(samples) / count,
                # Generation and the agents' own work overlap: the episodes' wall time.
                "time/rollout_s": scoring_started - started,
                "time/reward_s": scoring_seconds,
            }
        )
        return ScoredSamples(samples, metrics)

    def _session_settings(self, seed: int) -> SessionSettings:
        sampling = self.sampling
        return SessionSettings(
            seed=seed,
            response_budget=sampling.max_new_tokens,
            max_turns=self.settings.max_turns,
            max_tokens_per_turn=self.settings.max_tokens_per_turn,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            stop_token_ids=self.settings.stop_token_ids,
            return_routes=sampling.return_routes,
            return_route_weights=sampling.return_route_weights,
        )

    def _run(self, prompt: Prompt, sample_index: int, session_id: str) -> Any:
        session = AgentSession(
            base_url=self.endpoint.base_url,
            api_key=self.endpoint.api_key,
            session_id=session_id,
            prompt=prompt.prompt_text,
            answer=prompt.answer,
            metadata=dict(prompt.metadata),
        )
        try:
            reward = self.function(session)
            if isinstance(reward, bool) or not isinstance(reward, (int, float)):
                return TypeError(f"returned {type(reward).__name__}, not a number")
            if not math.isfinite(reward):
                return ValueError(f"returned the reward {reward}, not a finite number")
            return float(reward)
        except Exception as error:  # the agent's code: counted, never fatal
            return error

    # ------------------------------------------------------------------ samples

    def _samples(
        self,
        prompt: Prompt,
        sample_index: int,
        session: ChatSession,
        outcome: Any,
        counts: dict[str, int],
    ) -> list[TrainSample]:
        calls = session.calls
        counts["turns"] += len(calls)
        counts["rewrites"] += session.rewrites
        error = outcome if isinstance(outcome, Exception) else None
        if error is None and not calls:
            error = ValueError("the agent made no model call")
        if error is None and session.ended == "abort":
            error = RuntimeError("the engine aborted a call")
        truncated = session.ended == "length" or (
            bool(calls) and calls[-1].result.finish_reason == "length"
        )
        counts["truncated"] += truncated and error is None
        if error is not None:
            counts["errors"] += 1
            self._log(prompt, error)
            return [self._aborted(prompt, sample_index, calls)]
        reward = float(outcome)
        finish = "length" if truncated else "stop"
        # Counted with per-turn samples too: it says the option is needed (and used).
        counts["rewritten"] += bool(session.rewrites)
        if self.settings.per_turn_samples:
            key = f"{sample_index}:{session.session_id}"
            return [
                self._turn_sample(prompt, call, index, len(calls), reward, finish, key)
                for index, call in enumerate(calls)
            ]
        if session.rewrites:
            return [self._aborted(prompt, sample_index, calls)]
        sample = trajectory_sample(calls, len(calls[0].input_ids))
        sample.group_id, sample.reward, sample.finish_reason = prompt.group_id, reward, finish
        return [sample]

    def _turn_sample(
        self,
        prompt: Prompt,
        call: ModelCall,
        index: int,
        num_turns: int,
        reward: float,
        finish: str,
        key: str,
    ) -> TrainSample:
        result = call.result
        output = list(result.output_ids)
        sample = _sample_of(call.input_ids + output, len(call.input_ids))
        sample.loss_mask = torch.ones(len(output), dtype=torch.bool)
        sample.rollout_log_probs = _log_probs(result)
        sample.rollout_weight_versions = _versions(result)
        if result.routed_experts is not None:
            sample.rollout_routes = torch.from_numpy(np.asarray(result.routed_experts))
        if result.routed_expert_weights is not None:
            sample.rollout_route_weights = torch.from_numpy(
                np.asarray(result.routed_expert_weights)
            )
        sample.turns = torch.full((len(output),), index, dtype=torch.int16)
        # The episode's reward counts at its last turn (reward-to-go: every turn gets it).
        sample.turn_rewards = torch.zeros(num_turns, dtype=torch.float64)
        sample.group_id, sample.reward = prompt.group_id, reward
        sample.finish_reason = finish if index == num_turns - 1 else "stop"
        sample.weight_version = int(result.weight_version)
        sample.metadata["episode"] = key
        return sample

    def _aborted(self, prompt: Prompt, sample_index: int, calls: list[ModelCall]) -> TrainSample:
        """A sample out of the loss that the trainer still takes: every trained sample needs a
        response token, masked or not (``engine/batches.py``)."""
        # The calls up to the first rewrite form one sequence (the first call always does).
        appended = list(itertools.takewhile(lambda call: call.appended, calls))
        if appended:
            sample = trajectory_sample(appended, len(appended[0].input_ids))
        else:
            # No model call: one masked placeholder token (EOS where there is one) after the
            # prompt.
            filler = (self.task.stop_token_ids or [prompt.prompt_ids[-1]])[0]
            sample = _sample_of([*prompt.prompt_ids, int(filler)], len(prompt.prompt_ids))
            sample.rollout_log_probs = torch.zeros(1)
        sample.loss_mask = torch.zeros(sample.response_length, dtype=torch.bool)
        sample.group_id = aborted_group_id(sample_index)
        sample.finish_reason = "abort"
        return sample

    def _log(self, prompt: Prompt, error: Exception) -> None:
        if self._errors_logged < MAX_LOGGED_ERRORS:
            self._errors_logged += 1
            logger.warning(
                "agent %r failed on %s (the episode is kept out of the loss): %s: %s",
                self.settings.function,
                prompt.source,
                type(error).__name__,
                error,
            )


def _sample_of(tokens: list[int], prompt_length: int) -> TrainSample:
    return TrainSample(tokens=torch.tensor(tokens, dtype=torch.long), prompt_length=prompt_length)


def _log_probs(result: Any) -> torch.Tensor:
    if result.output_log_probs is None:
        return torch.zeros(len(result.output_ids), dtype=torch.float32)
    return torch.as_tensor(np.asarray(result.output_log_probs), dtype=torch.float32)


def _versions(result: Any) -> torch.Tensor:
    if result.output_weight_versions is not None:
        return torch.as_tensor(np.asarray(result.output_weight_versions), dtype=torch.int64)
    return torch.full((len(result.output_ids),), int(result.weight_version), dtype=torch.int64)


def scoring_view(calls: Sequence[ModelCall]) -> TrainSample:
    """An episode as the reward functions see it: the last call's input and output, the part
    they share with the first call's input as the prompt. Without rewrites that is the
    trajectory's prompt and response; after one, the conversation as the model last saw it."""
    first, last = calls[0].input_ids, calls[-1]
    tokens = list(last.input_ids) + list(last.result.output_ids)
    shared = 0
    while shared < min(len(first), len(tokens)) and first[shared] == tokens[shared]:
        shared += 1
    return _sample_of(tokens, shared)


def trajectory_sample(calls: Sequence[ModelCall], prompt_length: int) -> TrainSample:
    """The one sequence of an episode whose every call extended the previous one: the last
    call's input and output; model tokens in the loss with the engine's log-probs, versions and
    routes, appended tokens out of it (log-prob 0, turn -1)."""
    last = calls[-1]
    tokens = list(last.input_ids) + list(last.result.output_ids)
    length = len(tokens) - prompt_length
    mask = torch.zeros(length, dtype=torch.bool)
    log_probs = torch.zeros(length, dtype=torch.float32)
    turns = torch.full((length,), -1, dtype=torch.int16)
    versions = torch.full((length,), int(calls[0].result.weight_version), dtype=torch.int64)
    chunks, weight_chunks, covered = [], [], 0
    for index, call in enumerate(calls):
        start = len(call.input_ids) - prompt_length
        end = start + len(call.result.output_ids)
        mask[start:end] = True
        log_probs[start:end] = _log_probs(call.result)
        versions[start:end] = _versions(call.result)
        turns[start:end] = index
        if call.result.routed_experts is not None:
            # Rows of the call's input and new tokens but the last; keep the uncovered ones.
            rows = len(call.input_ids) + len(call.result.output_ids) - 1
            chunks.append(np.asarray(call.result.routed_experts)[covered:rows])
            if call.result.routed_expert_weights is not None:
                # The weights of the same rows, in the ids' order (R3 with replayed weights).
                weight_chunks.append(np.asarray(call.result.routed_expert_weights)[covered:rows])
            covered = max(covered, rows)
    sample = _sample_of(tokens, prompt_length)
    sample.loss_mask, sample.rollout_log_probs = mask, log_probs
    sample.rollout_weight_versions, sample.turns = versions, turns
    sample.turn_rewards = torch.zeros(len(calls), dtype=torch.float64)
    sample.weight_version = int(versions[mask].min()) if bool(mask.any()) else 0
    if chunks:
        sample.rollout_routes = torch.from_numpy(np.concatenate(chunks, axis=0))
    if weight_chunks:
        if len(weight_chunks) != len(chunks):
            raise ValueError(
                f"{len(weight_chunks)} calls of an episode reported route weights, {len(chunks)} "
                "reported routes; every call must report both"
            )
        sample.rollout_route_weights = torch.from_numpy(np.concatenate(weight_chunks, axis=0))
    return sample
