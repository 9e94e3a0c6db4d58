"""The suite's grouping for pytest-xdist (``tests/conftest.py``, ``group_for_workers``) reaches
the scheduler: under ``-n 2 --dist loadgroup`` every test of a module runs in one worker, so a
module-scoped fixture (a trained checkpoint, an exported model, a server) is built once, not
once per worker. A grouping hook that ran after pytest-xdist's own would leave the marks unread
and the modules split. The groups that wait for the SGLang venv built beside the suite are
scheduled last (``order_for_workers``), whatever their size."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODULES = (
    "tests/routes/test_routes.py",
    "tests/samples/test_recorded_batch.py",
    "tests/config/test_retokenize_responses.py",
)
WAITING = "tests/real_sglang/test_build_wait.py"
"""Waits for a build beside the suite: 4 tests, so pytest-xdist's own ordering by size would
put it second of the four modules, the first that the second worker runs."""


def test_each_module_runs_in_one_worker_and_the_waiting_ones_last():
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", WAITING, *MODULES, "-n", "2", "--dist", "loadgroup"]
        + ["-v"]
        + ["-p", "no:cacheprovider"],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    workers = collections.defaultdict(set)
    runs = collections.defaultdict(list)
    for worker, module in re.findall(r"^\[(gw\d+)\].*? (tests/\S+?\.py)::", completed.stdout, re.M):
        workers[module].add(worker)
        runs[worker].append(module)
    assert sorted(workers) == sorted((WAITING, *MODULES)), completed.stdout[-3000:]
    for module, used in workers.items():
        assert len(used) == 1, f"{module} ran in workers {sorted(used)}: its tests were split"
    # Each worker gets two groups at the start, in the scheduler's order: the waiting module is
    # the last of the four, so its worker runs another module first.
    (worker,) = workers[WAITING]
    assert runs[worker][0] != WAITING, runs
