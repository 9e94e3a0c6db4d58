"""Starting the worker scripts of tests/engine (fresh processes; gloo on 127.0.0.1), and the
checks runner those workers share."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # One thread per process: several ranks share 2 cores, and results stay reproducible.
    env["OMP_NUM_THREADS"] = "1"
    return env


def worker_command(worker: Path, world: int) -> list[str]:
    """``python WORKER`` for one process, ``torchrun`` on a free loopback port for several."""
    if world == 1:
        return [sys.executable, str(worker)]
    # Here, not at the top: the worker scripts import this module (run_checks) in processes
    # whose path lacks tests/, where tests/free_ports.py lives.
    from free_ports import free_port

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(worker),
    ]


def run_worker(command: list[str], timeout: int) -> str:
    """Run ``command`` from the repository root; its stdout, or an AssertionError with its tail."""
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=worker_env(), capture_output=True, text=True, timeout=timeout
    )
    if result.returncode:
        raise AssertionError(
            f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
            f"{result.stderr[-8000:]}"
        )
    return result.stdout


def run_json_worker(worker: Path, timeout: int) -> dict:
    """Run ``python WORKER`` in a fresh process (the CPU shims change torch and Megatron
    globals); the JSON object on the last line of its stdout."""
    return json.loads(run_worker(worker_command(worker, 1), timeout).strip().splitlines()[-1])


def run_checks(
    checks: dict[str, Callable[[], object]], traceback_limit: int = 4, falsy_fails: bool = False
) -> dict[str, str]:
    """Inside a worker: each check's outcome, ``"ok"`` or the traceback of what it raised (and,
    with ``falsy_fails``, ``"returned False"`` for a check whose result is falsy)."""
    results = {}
    for name, check in checks.items():
        try:
            passed = check()
            results[name] = "returned False" if falsy_fails and not passed else "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=traceback_limit)
    return results
