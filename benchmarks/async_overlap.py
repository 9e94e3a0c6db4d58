"""Asynchronous training against the synchronous loop: does generation really overlap training?

Variants, each a fresh ``python -m megatron_gspo.train`` subprocess, interleaved round by round
(``sync async1 async2 [async1_thread] sync async1 ...``) so that a shared machine's load falls on
all of them alike:

* ``sync``: ``rollout.max_staleness=0``, the embedded engine in the trainer (today's loop);
* ``async1`` / ``async2``: ``max_staleness`` 1 / 2, the loopback server in a process of its own
  (``rollout.engine=embedded_http rollout.embedded_server_process=true``), partial rollouts;
* ``async1_thread`` (``--thread``): ``max_staleness=1`` with the embedded engine generating in a
  thread of the trainer, which shares the trainer's Python interpreter lock.

Every process runs ``--threads`` torch threads (default 1: trainer and engine then each have one
of the two cores of the CI machine; OpenMP barriers across more threads than cores cost more
than they gain on a shared box). Scenarios:

* ``demo``: the CPU demo (32 prompts x 8 samples, responses up to 10 tokens), no SFT warm-up;
* ``long``: fixed-length responses of ``--long-tokens`` tokens (``min_new_tokens``) and 16
  prompts, where generation costs about as much as training.

Per variant and scenario (medians over runs of the steps after the first, which carries one-time
costs): step time, generated tokens per second, and for the synchronous loop its generation
(rollout + reward) and training (old log-probs, advantages, update, weight sync) times. The
ratio ``async step / max(generation, training)`` uses the sync run's phase times of the same
round; an asynchronous loop that overlaps perfectly reaches 1.0, the synchronous one pays
``(generation + training) / max(...)``.

Usage (from the repository root)::

    python benchmarks/async_overlap.py                   # 8 steps, 2 rounds, demo and long
    python benchmarks/async_overlap.py --quick           # 4 steps, 1 round: a few minutes
    python benchmarks/async_overlap.py --thread --json   # + the in-process thread engine; JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = {
    "demo": ["sft_warmup_steps=0"],
    "long": [
        "sft_warmup_steps=0",
        "algo.rollout_batch_size=16",
        "algo.num_mini_batches=4",
    ],
}
SERVER_PROCESS = ["rollout.engine=embedded_http", "rollout.embedded_server_process=true"]
VARIANTS = {
    "sync": ["rollout.max_staleness=0"],
    "async1": ["rollout.max_staleness=1", *SERVER_PROCESS],
    "async2": ["rollout.max_staleness=2", *SERVER_PROCESS],
    "async1_thread": ["rollout.max_staleness=1"],
}
GENERATION_KEYS = ("time/rollout_s", "time/reward_s")
TRAINING_KEYS = ("time/old_log_probs_s", "time/advantages_s", "time/update_s", "time/weight_sync_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/async_overlap.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant")
    parser.add_argument("--scenarios", default="demo,long", help="comma-separated: demo, long")
    parser.add_argument("--long-tokens", type=int, default=48, help="response length of 'long'")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--thread", action="store_true", help="also the in-process thread engine")
    parser.add_argument("--quick", action="store_true", help="4 steps, 1 round")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--keep", default=None, help="keep the run directories here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds = 4, 1
    return args


def run_variant(
    args: argparse.Namespace, scenario: str, variant: str, output_dir: Path
) -> list[dict]:
    overrides = [
        *SCENARIOS[scenario],
        *VARIANTS[variant],
        f"steps={args.steps}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "overwrite_output_dir=true",
        f"output_dir={output_dir}",
    ]
    if scenario == "long":
        tokens = args.long_tokens
        overrides += [f"algo.response_length={tokens}", f"rollout.min_new_tokens={tokens}"]
    if variant in ("async1", "async2"):
        overrides.append(f"rollout.engine_threads={args.threads}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "megatron_gspo.train", *overrides]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.parent / f"{output_dir.name}.log"
    with log_path.open("w") as log:
        code = subprocess.call(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
    if code != 0:
        raise SystemExit(f"{scenario}/{variant} failed ({code}); log: {log_path}")
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summarize(records: list[dict]) -> dict[str, float]:
    """Medians over the steps after the first."""
    steady = records[1:] or records
    tokens = [r["response_len_mean"] * r["num_samples"] for r in steady]
    times = [r["step_time_s"] for r in steady]
    summary = {
        "step_s": statistics.median(times),
        "tokens_per_s": sum(tokens) / sum(times),
        "generation_s": statistics.median(
            sum(r.get(k, 0.0) for k in GENERATION_KEYS) for r in steady
        ),
        "training_s": statistics.median(sum(r.get(k, 0.0) for k in TRAINING_KEYS) for r in steady),
    }
    for key in ("staleness_mean", "overlap_frac", "trainer_wait_s", "partial_sample_frac"):
        values = [r[key] for r in steady if key in r]
        if values:
            summary[key] = statistics.median(values)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    variants = ["sync", "async1", "async2"] + (["async1_thread"] if args.thread else [])
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_overlap_"))
    results: dict[str, dict[str, list[dict]]] = {s: {v: [] for v in variants} for s in scenarios}
    started = time.time()
    for round_index in range(args.rounds):
        for scenario in scenarios:
            for variant in variants:
                run_dir = root / f"{scenario}-{variant}-{round_index}"
                records = run_variant(args, scenario, variant, run_dir)
                results[scenario][variant].append(summarize(records))
                print(
                    f"[async_overlap] {scenario}/{variant} round {round_index}: "
                    f"{results[scenario][variant][-1]['step_s']:.2f} s/step",
                    file=sys.stderr,
                )
    report = {
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "threads_per_process": args.threads,
        "steps": args.steps,
        "rounds": args.rounds,
        "wall_s": time.time() - started,
        "scenarios": {},
    }
    for scenario in scenarios:
        rows = {}
        sync_runs = results[scenario]["sync"]
        for variant in variants:
            runs = results[scenario][variant]
            row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            # Per round: this variant's step over the same round's sync max(generation, training).
            ratios = [
                run["step_s"] / max(sync["generation_s"], sync["training_s"])
                for run, sync in zip(runs, sync_runs)
            ]
            row["step_over_max_phase"] = statistics.median(ratios)
            row["speedup_vs_sync"] = statistics.median(
                sync["step_s"] / run["step_s"] for run, sync in zip(runs, sync_runs)
            )
            rows[variant] = row
        report["scenarios"][scenario] = rows
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


def print_table(report: dict) -> None:
    print(
        f"# async_overlap: {report['machine']}; {report['threads_per_process']} torch thread(s) "
        f"per process; {report['steps']} steps x {report['rounds']} rounds"
    )
    for scenario, rows in report["scenarios"].items():
        sync = rows["sync"]
        print(
            f"\n## {scenario}: sync generation {sync['generation_s']:.2f} s, training "
            f"{sync['training_s']:.2f} s per step\n"
        )
        print(
            "| variant | step s | tokens/s | step / max(gen, train) | vs sync | staleness | overlap |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for variant, row in rows.items():
            staleness = row.get("staleness_mean")
            overlap = row.get("overlap_frac")
            print(
                f"| {variant} | {row['step_s']:.2f} | {row['tokens_per_s']:.0f} | "
                f"{row['step_over_max_phase']:.2f} | {row['speedup_vs_sync']:.2f}x | "
                f"{'-' if staleness is None else f'{staleness:.2f}'} | "
                f"{'-' if overlap is None else f'{overlap:.2f}'} |"
            )


if __name__ == "__main__":
    sys.exit(main())
