"""Prefix-cache hits of multi-turn sessions on two real SGLang servers, by the benchmark that
gives docs/agentic.md its numbers (benchmarks/prefix_cache_hits.py, the command the docs show).

Sticky sessions keep every turn of a session on one server, which holds the session's prefix:
every later turn hits, and the hit rate beats the round-robin baseline, whose next turn always
lands on the server that did not see the previous one (turn 1 hits nothing). Across a weight
sync that flushes nothing (paused in place), the weight-version salt (``extra_key``) alone keeps
the first turn of version 1 off version 0's KV (0 cached tokens), and the turn after it hits
again; with one salt for every version (the control) the same turn reuses the stale KV.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .server import SKIP_REASON, VENV_ENV, sglang_python

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCHMARK = REPO_ROOT / "benchmarks" / "prefix_cache_hits.py"

# Two server starts: 15-120 s each on 2 idle cores, ten minutes on a crowded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def report() -> dict:
    if sglang_python() is None:
        pytest.skip(SKIP_REASON)
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, str(BENCHMARK), "--sglang-venv", os.environ[VENV_ENV], "--json"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads(result.stdout)


def test_sticky_sessions_hit_more_than_round_robin(report):
    sticky, baseline = report["phases"]["sticky"], report["phases"]["round_robin"]
    sessions = report["settings"]["sessions"]
    # New sessions spread over both servers (least loaded first, then fewest sessions), and no
    # session ever moves.
    assert len(sticky["sessions_per_server"]) == 2 and min(sticky["sessions_per_server"]) >= 1
    assert sticky["sessions_changing_server"] == 0
    assert baseline["sessions_changing_server"] == sessions
    for turn, values in sticky["per_turn"].items():
        if int(turn) >= 1:
            # Everything but the last sampled token of the previous turn (its KV is computed
            # only when the next token is) and the appended tokens is cached.
            assert (
                values["cached_min"]
                >= values["input_mean"] - 1 - report["settings"]["appended_tokens"]
            ), (turn, values)
    assert baseline["per_turn"]["1"]["cached_max"] == 0
    assert sticky["hit_rate_after_turn0"] > baseline["hit_rate_after_turn0"] + 0.2, report


def test_a_new_weight_version_never_reuses_old_kv(report):
    first_new = str(report["settings"]["sync_after_turn"] + 1)
    next_turn = str(int(first_new) + 1)
    salted = report["phases"]["version_salted"]["per_turn"]
    unsalted = report["phases"]["version_unsalted"]["per_turn"]
    assert salted[first_new]["weight_versions"] == [1]
    assert salted[first_new]["cached_max"] == 0, salted
    if next_turn in salted:
        assert salted[next_turn]["cached_min"] > 0, salted
    # The control: the sync flushed nothing, so without the salt version 1 reuses version 0's KV.
    assert unsalted[first_new]["weight_versions"] == [1]
    assert unsalted[first_new]["cached_min"] > 0, unsalted
