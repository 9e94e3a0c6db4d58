"""What a process pays to start: Megatron-Core's import with ``torch.compile`` deferred
(``engine/deferred_compile.py``) against upstream's eager decoration, interleaved.

Two commands, each run as a fresh interpreter in both forms, round after round:

* ``import``: ``import megatron_gspo.engine.train_step`` (the trainer's engine: Megatron-Core,
  our shims and models). Deferred is that import as the trainer does it; upstream imports
  ``megatron.core`` first, so its fused functions are decorated with the real ``torch.compile``
  (what every process paid before the change).
* ``run``: a whole 2-step run of the tests' tiny configuration (``python -m
  megatron_gspo.train``, 8 samples of at most 8 tokens per step), the same two ways.

The report is the median over ``--rounds`` of each child's CPU time (user + system: steadier than
wall time on a shared machine) and wall time, and the CPU they ran on.

    python benchmarks/startup.py
    python benchmarks/startup.py --rounds 5 --commands import
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# The repository (the package) and tests/ (the end-to-end harness imports its siblings as the
# tests do).
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from e2e.harness import TINY  # noqa: E402

from megatron_gspo.rollout.sglang_cpu import cpu_model_name  # noqa: E402

TINY_RUN = ("steps=2", *TINY)
"""The end-to-end tests' tiny configuration for two steps: a run whose time is mostly its start."""

UPSTREAM_FIRST = "import megatron.core; "
"""Imports Megatron-Core before the engine installs its deferral: upstream's eager decoration."""


def python_code(command: str, output_dir: str) -> str:
    if command == "import":
        return "import megatron_gspo.engine.train_step"
    arguments = [*TINY_RUN, f"output_dir={output_dir}"]
    return (
        "import runpy, sys; "
        f"sys.argv = ['megatron_gspo.train', *{arguments!r}]; "
        "runpy.run_module('megatron_gspo.train', run_name='__main__')"
    )


def timed_child(code: str) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of ``python -c code``, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode:
        raise SystemExit(f"python -c {code!r} failed:\n{completed.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--commands", nargs="+", default=["import", "run"], choices=["import", "run"]
    )
    args = parser.parse_args()

    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for command in args.commands:
                for form, prefix in (("deferred", ""), ("upstream", UPSTREAM_FIRST)):
                    output_dir = str(Path(scratch) / f"{command}-{form}-{round_index}")
                    result = timed_child(prefix + python_code(command, output_dir))
                    samples.setdefault((command, form), []).append(result)
    print(f"# startup: {cpu_model_name()}, {os.cpu_count()} CPUs, {args.rounds} rounds")
    report = {}
    for command in args.commands:
        row = {}
        for form in ("deferred", "upstream"):
            cpu = statistics.median(cpu for cpu, _ in samples[(command, form)])
            wall = statistics.median(wall for _, wall in samples[(command, form)])
            row[form] = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}
        row["cpu_saved"] = round(1 - row["deferred"]["cpu_s"] / row["upstream"]["cpu_s"], 3)
        report[command] = row
        print(
            f"{command:>6}: CPU {row['upstream']['cpu_s']:.2f} s upstream -> "
            f"{row['deferred']['cpu_s']:.2f} s deferred ({row['cpu_saved']:.0%} less); wall "
            f"{row['upstream']['wall_s']:.2f} -> {row['deferred']['wall_s']:.2f} s"
        )
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
