"""``env.turn_scheduling``: episodes that take turns all together (``lockstep``) or each as soon
as its own environment step is done (``independent``), on the real embedded engine.

- With a batch-invariant engine (``rollout.embedded_max_batch_size=1``) both schedules make the
  same trajectories (tokens, log-probs, routes, versions, turns, rewards, finish reasons) from
  the same seeds, on environments whose steps take different times: which engine call a turn
  lands in changes nothing about it.
- Independence is real: while one trajectory's tool call is slow, the engine calls made before
  it returns hold the other trajectories' later turns, up to their last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

import pytest
import torch

from megatron_gspo.config import ConfigError
from megatron_gspo.envs import EnvStart, EnvStep, Turn
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.task import Task
from megatron_gspo.rollout import derive_seed, derive_turn_seed
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest, GenerateResult

from .conftest import EOS, OBS, RecordingEngine, environment_producer, prompts, tiny_moe
from .conftest import train_config as environment_config
from .scripted import ScriptedEnvironment

SCHEDULES = ("lockstep", "independent")


class UnevenEnvironment(ScriptedEnvironment):
    """:class:`ScriptedEnvironment` whose steps take 0 to 40 ms, by the turn's tokens: the steps
    of one call end in an order of their own. The episodes of prompt 2 fail at their second
    step. With ``hold``, the first step of prompt 0's episodes also waits (at most 30 s) until
    an episode of another prompt steps its second turn (which only an independent schedule
    lets it do), and says in ``held`` whether it had to time out."""

    def __init__(self, *, hold: Optional[threading.Event] = None, held=None, **options):
        super().__init__(**options)
        self.hold, self.held = hold, held

    def reset(self, prompt) -> EnvStart:
        self.group = prompt.group_id
        self.fail_at = 1 if prompt.group_id == 2 else -1
        return super().reset(prompt)

    def step(self, turn: Turn) -> EnvStep:
        if self.hold is not None and self.group == 0 and turn.index == 0:
            self.held.append(self.hold.wait(timeout=30))
        elif self.hold is not None and turn.index == 1:
            self.hold.set()
        time.sleep(0.01 * (sum(turn.token_ids) % 5))
        return super().step(turn)


class TimedEngine(RecordingEngine):
    """:class:`RecordingEngine` (the real engine, every call's requests and results) that also
    remembers when each call ended."""

    def __init__(self, engine: EmbeddedEngine):
        super().__init__(engine)
        self.ended: list[float] = []

    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        results = super().generate(requests, n)
        self.ended.append(time.monotonic())
        return results


def train_config(schedule: str, **env):
    options = {"observation": [OBS, 10], "turn_reward": 0.1, **env.pop("options", {})}
    return environment_config(
        env={"turn_scheduling": schedule, "options": options, **env},
        algo={"response_length": 28, "rollout_batch_size": 3},
        rollout={"embedded_max_batch_size": 1},
    )


def produce(engine, tokenizer, cfg, factory, batch):
    task = Task(tokenizer, None, [], EOS)
    return environment_producer(engine, task, None, cfg, factory).produce(batch, 0)


@pytest.fixture(scope="module")
def engine():
    """The tiny MoE, one sample per forward: its tokens and log-probs do not depend on which
    other requests share a call."""
    engine = EmbeddedEngine(tiny_moe(), seed=5, max_batch_size=1)
    yield engine
    engine.close()


def test_both_schedules_make_the_same_trajectories(engine, tokenizer):
    """Three-turn episodes (turns end at ``c`` or ``<eos>``, some cut by the response budget,
    one prompt's environment failing at its second step) with R3 routes: the independent
    schedule's samples equal the lockstep schedule's, field for field, bit for bit, although
    its engine calls held other sets of turns."""
    batch = prompts(3)
    options = {"turns": 3, "stop_token_ids": [2]}
    hold, held = threading.Event(), []
    factories = {
        "lockstep": UnevenEnvironment,
        "independent": lambda **o: UnevenEnvironment(hold=hold, held=held, **o),
    }
    results = {}
    for schedule in SCHEDULES:
        recording = TimedEngine(engine)
        cfg = train_config(schedule, options=options)
        results[schedule] = (
            recording,
            produce(recording, tokenizer, cfg, factories[schedule], batch),
        )
    (lockstep_engine, lockstep), (independent_engine, independent) = results.values()
    assert len(lockstep.samples) == len(independent.samples) == 6
    for want, got in zip(lockstep.samples, independent.samples):
        assert torch.equal(want.tokens, got.tokens) and want.prompt_length == got.prompt_length
        assert torch.equal(want.rollout_log_probs, got.rollout_log_probs)
        assert torch.equal(want.rollout_routes, got.rollout_routes)
        assert torch.equal(want.rollout_weight_versions, got.rollout_weight_versions)
        assert torch.equal(want.loss_mask, got.loss_mask) and torch.equal(want.turns, got.turns)
        assert torch.equal(want.turn_rewards, got.turn_rewards) and want.reward == got.reward
        assert (want.group_id, want.finish_reason) == (got.group_id, got.finish_reason)
    reasons = {sample.finish_reason for sample in lockstep.samples}
    # Done, truncated and aborted episodes all compared.
    assert {"stop", "length", "abort"} <= reasons, reasons
    assert lockstep.metrics["env/turns_mean"] > 2.0
    # The schedules really differed: lockstep's calls hold one turn of every live trajectory;
    # independent's second turns came in several calls (prompt 0's after another's).
    assert held == [True, True], "prompt 0's first steps timed out: no second turn went ahead"
    assert lockstep.metrics["env/engine_calls_count"] == lockstep.metrics["env/turns_max"]
    turn_of = turn_finder(cfg, batch)
    for recording, many in ((lockstep_engine, False), (independent_engine, True)):
        second_turn_calls = {
            index
            for index, call in enumerate(recording.calls)
            for request, _ in call
            if turn_of(request)[1] == 1
        }
        assert (len(second_turn_calls) > 1) == many
    for key in ("env/turns_mean", "env/done_frac", "env/truncated_frac", "env/step_errors"):
        assert lockstep.metrics[key] == independent.metrics[key]


def turn_finder(cfg, batch: list) -> Callable[[GenerateRequest], tuple[int, int]]:
    """The (trajectory, turn) of a request of a call with ``batch`` at step 0, by its seed: turn
    ``k`` of sample ``j`` of prompt ``i`` samples with ``derive_turn_seed(derive_seed(s_i, j),
    k)`` (``production/episodes.py``), each seed its own."""
    sampling, turns = Sampling.training(cfg), {}
    for i in range(len(batch)):
        for j in range(sampling.group_size):
            for k in range(cfg.env.max_turns):
                seed = derive_turn_seed(derive_seed(sampling.prompt_seed(0, i), j), k)
                assert seed not in turns, f"turn {k} of sample {j} of prompt {i} reuses a seed"
                turns[seed] = (i * sampling.group_size + j, k)

    def find(request: GenerateRequest) -> tuple[int, int]:
        return turns[request.seed]

    return find


def test_a_slow_tool_call_holds_up_only_its_own_episode(engine, tokenizer):
    """The first trajectory's first step waits until every other trajectory
    has finished its episode (at most 30 s); independent scheduling lets them: their second and third turns
    are generated in engine calls that ended before the slow step returned, and the slow
    trajectory's own later turns come after it. (Lockstep would wait for the slow step before
    any second turn: the step would time out and the test fail.)"""
    batch, group, turns = prompts(3), 2, 3
    others = len(batch) * group - 1
    finished, released = [], threading.Event()
    returned: dict[str, float] = {}
    made = []

    class SlowFirstEnvironment(ScriptedEnvironment):
        def step(self, turn: Turn) -> EnvStep:
            step = super().step(turn)
            if self is made[0]:
                if turn.index == 0:
                    returned["released"] = released.wait(timeout=30)
                    returned["at"] = time.monotonic()
            elif step.done:
                finished.append(self)
                if len(finished) == others:
                    released.set()
            return step

    def factory(**options):
        made.append(SlowFirstEnvironment(**options))
        return made[-1]

    recording = TimedEngine(engine)
    cfg = train_config(
        "independent", num_workers=others + 1, options={"turns": turns, "stop_token_ids": [2, 3]}
    )
    scored = produce(recording, tokenizer, cfg, factory, batch)
    assert returned["released"], "the other episodes never finished while the slow step waited"
    assert all(sample.finish_reason == "stop" for sample in scored.samples)
    # Which call made each turn: a turn's request carries the seed of its (prompt, sample, turn).
    turn_of = turn_finder(cfg, batch)
    call_of = {}
    for index, call in enumerate(recording.calls):
        for request, _ in call:
            call_of[turn_of(request)] = index
    assert len(call_of) == len(batch) * group * turns  # every turn of every episode, once
    slow_step_returned = returned["at"]
    for trajectory in range(1, others + 1):
        for k in (1, 2):
            assert recording.ended[call_of[trajectory, k]] < slow_step_returned, (trajectory, k)
    for k in (1, 2):
        assert recording.ended[call_of[0, k]] > slow_step_returned
    assert call_of[0, 1] > max(call_of[t, 2] for t in range(1, others + 1))
    assert scored.metrics["env/engine_calls_count"] > turns


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="env.turn_scheduling"):
        train_config("per_turn")


class AbortingEngine(TimedEngine):
    """The real engine, which aborts the first request of its second call (the engine's own
    ``abort`` of that request id, as a stopping run's abort reaches a call in flight)."""

    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        if len(self.calls) == 1:
            self.engine.abort([requests[0].request_id])
        return super().generate(requests, n)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_aborted_turn_ends_the_episodes_still_running(engine, tokenizer, schedule):
    """Once a call returns an aborted turn (the run is stopping), the producer starts no more
    turns: every episode still running is aborted (out of the loss, a group of its own), with
    or without its own turn in that call."""
    recording = AbortingEngine(engine)
    cfg = train_config(schedule, options={"turns": 3, "stop_token_ids": list(range(12))})
    scored = produce(recording, tokenizer, cfg, UnevenEnvironment, prompts(2))
    aborted = [result for _, result in recording.calls[1] if result.finish_reason == "abort"]
    assert len(aborted) == 1 and len(recording.calls) == 2
    for sample in scored.samples:
        assert sample.finish_reason == "abort" and not sample.loss_mask.any()
        assert sample.group_id < 0
