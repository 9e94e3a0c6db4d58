#!/usr/bin/env python
"""Regenerate the README's CPU demo table ("The CPU demo, first versus last steps") from a run of
the demo, or check it.

    python tools/readme_demo.py                   # run the demo (about a minute), rewrite README
    python tools/readme_demo.py --metrics FILE    # rewrite from a finished demo's metrics.jsonl
    python tools/readme_demo.py --check --steps 2 # run 2 RL steps, compare them with the README
    python tools/readme_demo.py --check --steps 2 --metrics FILE  # a finished demo's first steps

The table lives between the markers ``<!-- demo-table:start -->`` and ``<!-- demo-table:end -->``
with the sentence that says how long the run took and on which CPU. The demo's first RL steps do
not depend on how many steps follow (constant learning rate, seeds per step), so ``--check
--steps 2`` compares the table's first rows with a short run, or with a finished demo's first
steps: ``tests/docs/test_readme_demo.py`` does that with the demo that
``tests/docs/test_curve_gate.py`` gates. Rows agree to :data:`TOLERANCE`, the spread measured between CPU classes (AVX2 and
AVX-512 kernels round differently); later rows are not checked, since sampling amplifies
rounding over tens of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
START, END = "<!-- demo-table:start -->", "<!-- demo-table:end -->"
SHOWN_STEPS = (0, 1, 10, 20, 30, 39)
COLUMNS = (
    ("mean reward", "reward_mean", 3),
    ("clipped tokens", "clip_frac_token", 3),
    ("routing change", "routing_change_frac", 3),
    ("entropy", "entropy", 2),
)
TOLERANCE = 0.02
"""Largest difference allowed between a README row and a run's row (every column)."""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_demo(
    steps: int | None, output_dir: Path, overrides: tuple[str, ...] | list[str] = ()
) -> tuple[list[dict], float]:
    """Run ``python -m megatron_gspo.train`` (the demo, with ``overrides``) into ``output_dir``;
    its records and wall seconds."""
    command = [sys.executable, "-m", "megatron_gspo.train", f"output_dir={output_dir}", *overrides]
    if steps is not None:
        command.append(f"steps={steps}")
    started = time.monotonic()
    subprocess.run(
        command, cwd=REPO_ROOT, check=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    )
    seconds = time.monotonic() - started
    return read_records(output_dir / "metrics.jsonl"), seconds


def read_records(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def table(records: list[dict]) -> str:
    by_step = {record["step"]: record for record in records}
    lines = [
        "| step | " + " | ".join(title for title, _, _ in COLUMNS) + " |",
        "|---:|" + "---:|" * len(COLUMNS),
    ]
    for step in SHOWN_STEPS:
        if step in by_step:
            values = [f"{by_step[step][key]:.{digits}f}" for _, key, digits in COLUMNS]
            lines.append(f"| {step} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def block(records: list[dict], seconds: float) -> str:
    steps = len(records)
    return (
        f"{START}\n{table(records)}\n\nThe whole run (imports, warm-up, {steps} steps) took "
        f"{seconds:.0f} s on a 2-core {cpu_name()} (`python tools/readme_demo.py` regenerates this "
        f"table);\n{END}"
    )


def readme_rows(text: str) -> dict[int, list[float]]:
    inside = text.split(START, 1)[1].split(END, 1)[0]
    rows = {}
    for line in inside.splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|(.*)\|\s*$", line)
        if match:
            rows[int(match.group(1))] = [float(value) for value in match.group(2).split("|")]
    return rows


def differences(text: str, records: list[dict]) -> list[str]:
    """Rows of the README that a run's records do not reproduce within :data:`TOLERANCE`."""
    rows = readme_rows(text)
    problems = []
    for record in records:
        if record["step"] not in rows:
            continue
        shown = rows[record["step"]]
        for (title, key, _), value in zip(COLUMNS, shown):
            if abs(record[key] - value) > TOLERANCE:
                problems.append(
                    f"step {record['step']} {title}: README {value}, the demo {record[key]:.4f}"
                )
    checked = [record["step"] for record in records if record["step"] in rows]
    if not checked:
        problems.append("no step of the run is in the README's table")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", type=Path, help="a finished demo's metrics.jsonl")
    parser.add_argument(
        "--steps",
        type=int,
        help="RL steps to run (default: the demo's 40); with --metrics, the first steps to use",
    )
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting")
    args = parser.parse_args(argv)
    text = README.read_text(encoding="utf-8")
    seconds = 0.0
    if args.metrics is not None:
        records = read_records(args.metrics)
        if args.steps is not None:  # the first steps of a longer run
            records = [record for record in records if record["step"] < args.steps]
    else:
        with tempfile.TemporaryDirectory() as folder:
            records, seconds = run_demo(args.steps, Path(folder) / "demo")
    if args.check:
        problems = differences(text, records)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(
                "the README's demo table is stale: run python tools/readme_demo.py", file=sys.stderr
            )
        return 1 if problems else 0
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    README.write_text(before + block(records, seconds) + after, encoding="utf-8")
    print(f"wrote the demo table of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
