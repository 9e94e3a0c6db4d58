"""An environment whose first step waits for the test (``GATE``): a weight sync can then land
between two turns of every episode in flight. Loaded by import path
(``tests.async_training.gated_environment:GatedEnvironment``); tests import ``GATE`` by the same
path, so that both see one module."""

from __future__ import annotations

import itertools
import os
import threading

from megatron_gspo.envs import EnvStep, Turn
from tests.envs.scripted import ScriptedEnvironment

GATE = threading.Event()
"""Set: steps go through. Cleared: the step of turn 0 waits (at most a minute)."""
GATE.set()
WAITING = threading.Semaphore(0)
"""Released once per step that starts waiting at the gate."""


class GatedEnvironment(ScriptedEnvironment):
    """:class:`ScriptedEnvironment` whose step of turn 0 waits for ``GATE``."""

    def step(self, turn: Turn) -> EnvStep:
        if turn.index == 0 and not GATE.is_set():
            WAITING.release()
            GATE.wait(timeout=60)
        return super().step(turn)


class ProcessReportingEnvironment(ScriptedEnvironment):
    """:class:`ScriptedEnvironment` whose last turn earns the id of the process that stepped
    it: where episode stepping ran."""

    def step(self, turn: Turn) -> EnvStep:
        step = super().step(turn)
        if step.done:
            step = EnvStep(observation_ids=[], reward=float(os.getpid()), done=True)
        return step


ENDED = threading.Semaphore(0)
"""Released once per episode of :class:`HalfGatedEnvironment` that ended while the gate was
closed."""


class HalfGatedEnvironment(GatedEnvironment):
    """Every other environment made (count from ``made``, which a test resets) waits at the
    gate as :class:`GatedEnvironment` does; the others go through, and release ``ENDED`` at the
    end of their episode while the gate is closed. In a chunk of groups of even size, the
    episodes with an even index in their group wait."""

    made = itertools.count()

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.gated = next(HalfGatedEnvironment.made) % 2 == 0

    def step(self, turn: Turn) -> EnvStep:
        if self.gated:
            return super().step(turn)
        step = ScriptedEnvironment.step(self, turn)
        if step.done and not GATE.is_set():
            ENDED.release()
        return step
