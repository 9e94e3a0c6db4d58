#!/usr/bin/env python
"""The CPU tool-use task trained synchronously and one step off-policy: the two reward curves.

    python tools/agentic_async_curve.py --out docs/agentic_async

Runs ``python -m megatron_gspo.train --preset cpu_tool_use`` twice with the same seed (the
calculator unconfined, ``env.options.isolation=none``; the sandbox does not change the numbers):

* ``sync``: the preset as it is (``rollout.max_staleness=0``);
* ``async``: ``rollout.max_staleness=1`` with the sequence-level correction toward the engine's
  per-token behaviour log-probs (``algo.rollout_correction.level=sequence``, what docs/async.md
  recommends for GSPO one step off-policy); the old log-probs are recomputed (the preset's).

Both start from the same supervised cold start (the preset's 100 steps, the same seed: the same
weights at RL step 0). Writes ``OUT/summary.json`` (every step's reward and tool metrics of both
runs, the mean reward of the last ``--last`` steps, the wall time), ``OUT/summary.md`` (the table
docs/agentic.md shows) and ``OUT/reward.png`` (both curves). The runs go to ``--runs DIR`` (``DIR/sync``, ``DIR/async``;
default ``outputs/agentic_async``); ``--plot-only`` re-reads runs already made; ``--parallel``
runs the two at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--preset", "cpu_tool_use", "env.options.isolation=none", "logging.progress_bar=false"]
VARIANTS = {
    "sync": [],
    "async": ["rollout.max_staleness=1", "algo.rollout_correction.level=sequence"],
}
KEYS = (
    "reward_mean",
    "env/tool_success_frac",
    "env/done_frac",
    "staleness_mean",
    "partial_sample_frac",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/agentic_async_curve.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="summary, table and plot")
    parser.add_argument(
        "--runs",
        type=Path,
        default=REPO_ROOT / "outputs" / "agentic_async",
        help="the runs' output directories (DIR/sync, DIR/async)",
    )
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    parser.add_argument("--last", type=int, default=10, help="steps of the final mean reward")
    parser.add_argument("--every", type=int, default=3, help="table rows every this many steps")
    parser.add_argument("--parallel", action="store_true", help="run both variants at once")
    parser.add_argument("--plot-only", action="store_true", help="only read the runs in --runs")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for both runs")
    return parser.parse_args(argv)


def command(variant: str, output_dir: Path, args: argparse.Namespace) -> list[str]:
    steps = [] if args.steps is None else [f"steps={args.steps}"]
    return [
        sys.executable,
        "-m",
        "megatron_gspo.train",
        *COMMON,
        *VARIANTS[variant],
        *steps,
        *args.overrides,
        "overwrite_output_dir=true",
        f"output_dir={output_dir}",
    ]


def run_variants(args: argparse.Namespace, runs: Path) -> dict[str, float]:
    """Run both variants (one after the other, or ``--parallel``); their wall seconds."""
    runs.mkdir(parents=True, exist_ok=True)
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    started, processes, walls = {}, {}, {}
    for variant in VARIANTS:
        log = (runs / f"{variant}.log").open("w")
        started[variant] = time.time()
        processes[variant] = subprocess.Popen(
            command(variant, runs / variant, args),
            cwd=REPO_ROOT,
            env=environment,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        if not args.parallel:
            walls[variant] = wait(processes[variant], variant, runs) - started[variant]
    while len(walls) < len(processes):  # --parallel: each run's own end
        for variant, process in processes.items():
            if variant not in walls and process.poll() is not None:
                walls[variant] = wait(process, variant, runs) - started[variant]
        time.sleep(1.0)
    return walls


def wait(process: subprocess.Popen, variant: str, runs: Path) -> float:
    if process.wait() != 0:
        raise SystemExit(f"the {variant} run failed ({process.returncode}): {runs / variant}.log")
    return time.time()


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(records: dict[str, list[dict]], last: int) -> dict:
    """Per variant: every step's :data:`KEYS`, and the mean reward of the last ``last`` steps
    (and of the first step: the cold start's, before any RL update)."""
    summary = {}
    for variant, rows in records.items():
        final = rows[-last:]
        summary[variant] = {
            "steps": [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows],
            "reward_first": rows[0]["reward_mean"],
            f"reward_mean_last_{last}": sum(r["reward_mean"] for r in final) / len(final),
            "reward_last": rows[-1]["reward_mean"],
        }
    return summary


def markdown(summary: dict, last: int, every: int) -> str:
    variants = list(summary)
    lines = [
        "| step | " + " | ".join(f"{v} reward_mean | {v} tool_success" for v in variants) + " |",
        "|---:|" + "---:|---:|" * len(variants),
    ]
    rows = {v: {r["step"]: r for r in summary[v]["steps"]} for v in variants}
    steps = sorted(set.intersection(*(set(r) for r in rows.values())))
    chosen = [s for s in steps if s % every == 0 or s == steps[-1]]
    for step in chosen:
        cells = []
        for variant in variants:
            row = rows[variant][step]
            cells.append(f"{row['reward_mean']:.3f} | {row.get('env/tool_success_frac', 0.0):.3f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines.append("")
    for variant in variants:
        lines.append(
            f"- `{variant}`: reward {summary[variant]['reward_first']:.3f} at step 0, "
            f"{summary[variant][f'reward_mean_last_{last}']:.3f} over the last {last} steps"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward_mean", "env/tool_success_frac")
    figure, axes = plt.subplots(1, len(keys), figsize=(5.0 * len(keys), 3.4), squeeze=False)
    for axis, key in zip(axes[0], keys):
        for variant, data in summary.items():
            rows = [r for r in data["steps"] if key in r]
            axis.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".", label=variant)
        axis.set_xlabel("RL step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("cpu_tool_use: synchronous against max_staleness=1")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    runs = args.runs
    walls = {} if args.plot_only else run_variants(args, runs)
    records = {variant: read_records(runs / variant / "metrics.jsonl") for variant in VARIANTS}
    summary = summarize(records, args.last)
    for variant, seconds in walls.items():
        summary[variant]["wall_s"] = seconds
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = markdown(summary, args.last, args.every)
    (args.out / "summary.md").write_text(table)
    plot(summary, args.out / "reward.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
