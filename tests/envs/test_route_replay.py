"""R3 with multi-turn trajectories: the trainer, replaying the routes assembled turn by turn,
reproduces the rollout engine's log-probs of every turn (``route_replay_worker.py``, a fresh
process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("route_replay_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKS = [
    "episodes_have_several_turns",
    "replay_reproduces_every_turn",
    "wrong_observation_routes_change_later_turns",
    "route_weights_sit_at_their_ids",
    "replayed_weights_reproduce_every_turn",
    "an_update_moves_towards_positive_advantages",
    "episodes_that_failed_at_reset_train_beside_the_others",
]


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    completed = subprocess.run(
        [sys.executable, str(WORKER)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-6000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", CHECKS)
def test_route_replay(results, check):
    assert results[check] == "ok", results[check]
