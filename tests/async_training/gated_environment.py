"""An environment whose first step waits for the test (``GATE``): a weight sync can then land
between two turns of every episode in flight. Loaded by import path
(``tests.async_training.gated_environment:GatedEnvironment``); tests import ``GATE`` by the same
path, so that both see one module."""

from __future__ import annotations

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
