"""Asynchronous training against the synchronous loop: does generation really overlap training?

Variants, each a fresh ``python -m megatron_gspo.train`` subprocess, interleaved round by round
(``sync async1 async2 [async1_thread] sync async1 ...``) so that a shared machine's load falls on
all of them alike:

* ``sync``: ``rollout.max_staleness=0``, the embedded engine in the trainer (today's loop);
* ``async1`` / ``async2``: ``max_staleness`` 1 / 2, the loopback server in a process of its own
  (``rollout.engine=embedded_http rollout.embedded_server_process=true``), partial rollouts;
* ``async1_thread`` (``--thread``): ``max_staleness=1`` with the embedded engine generating in a
  thread of the trainer, which shares the trainer's Python interpreter lock;
* ``async1_proc``: ``async1`` with two producer processes (``rollout.producer_processes=2``):
  episode stepping, answer decoding, reward dispatch and sample building run beside the trainer
  instead of in its producer thread, and two chunks may be in flight at once.

Every process runs ``--threads`` torch threads (default 1: trainer and engine then each have one
of the two cores of the CI machine; OpenMP barriers across more threads than cores cost more
than they gain on a shared box). Scenarios:

* ``demo``: the CPU demo (32 prompts x 8 samples, responses up to 10 tokens), no SFT warm-up;
* ``long``: fixed-length responses of ``--long-tokens`` tokens (``min_new_tokens``) and 16
  prompts, where generation costs about as much as training;
* ``large``: ``long`` with a model of 16x the parameters (hidden 256, 4 layers) and the
  engine's log-probs as the old policy: generation and training take seconds each, so the
  per-sample Python work of the producer (HTTP, parsing, reward calls; it shares the trainer's
  interpreter lock) is small next to them;
* ``tool``: multi-turn episodes of the CPU tool-use task (``env.name=multiply_tool``, the
  calculator unconfined, at most 3 turns, 16 prompts x 8 episodes) after a short supervised
  cold start (20 steps of demonstrations at lr 1e-2, before step 0: not timed) so that the
  episodes call the tool; ``env/turns_mean`` is reported.

Besides wall-clock times, the CPU seconds per step of each process (psutil, from outside):
the trainer's main thread, its other threads (the producer), the loopback server and the reward
workers. ``CPU: step / max`` is the step's busiest process in CPU seconds over the sync run's
max(generation, training) scaled to CPU: what the ratio would be without the machine's other
load (see :func:`cpu_ratio`).

Per variant and scenario (medians over runs of the steps after the first, which carries one-time
costs): step time, generated tokens per second, and for the synchronous loop its generation
(rollout + reward) and training (old log-probs, advantages, update, weight sync) times. The
ratio ``async step / max(generation, training)`` uses the sync run's phase times of the same
round; an asynchronous loop that overlaps perfectly reaches 1.0, the synchronous one pays
``(generation + training) / max(...)``.

Usage (from the repository root)::

    python benchmarks/async_overlap.py                   # 8 steps, 2 rounds, every scenario
    python benchmarks/async_overlap.py --quick           # 4 steps, 1 round: a few minutes
    python benchmarks/async_overlap.py --thread --json   # + the in-process thread engine; JSON
    python benchmarks/async_overlap.py --scenarios demo,tool --json   # the issue-27 scenarios
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
from typing import Optional

from megatron_gspo.rollout.sglang_cpu import cpu_model_name

REPO_ROOT = Path(__file__).resolve().parents[1]

SCENARIOS = {
    "demo": ["sft_warmup_steps=0"],
    "long": [
        "sft_warmup_steps=0",
        "algo.rollout_batch_size=16",
        "algo.num_mini_batches=4",
    ],
    # A model 16x the demo's parameters (hidden 256, 4 layers), where a step's generation and
    # training take seconds and per-sample Python costs (HTTP, parsing, reward calls) are small
    # next to them; the engine's log-probs as the old policy (no old-log-prob forward), so that
    # training costs about what generation does.
    "large": [
        "sft_warmup_steps=0",
        "algo.rollout_batch_size=16",
        "model.hidden_size=256",
        "model.head_dim=64",
        "model.num_layers=4",
        "model.ffn_hidden_size=512",
        "model.moe_ffn_hidden_size=256",
        "algo.old_log_prob_source=rollout",
    ],
    # Multi-turn tool use (docs/agentic.md): the episodes' environment steps (a calculator
    # program each), decoding and sample building are per-sample Python work.
    "tool": [
        "data.task=multiply",
        "model.vocab_size=24",
        "env.name=multiply_tool",
        "env.max_turns=3",
        "env.max_tokens_per_turn=12",
        "+env.options.isolation=none",
        "reward.functions=[]",
        "algo.response_length=32",
        "algo.rollout_batch_size=16",
        "algo.importance_sampling=seq_token",
        "sft_warmup_steps=20",
        "sft_warmup_lr=0.01",
    ],
}
SERVER_PROCESS = ["rollout.engine=embedded_http", "rollout.embedded_server_process=true"]
VARIANTS = {
    "sync": ["rollout.max_staleness=0"],
    "async1": ["rollout.max_staleness=1", *SERVER_PROCESS],
    "async2": ["rollout.max_staleness=2", *SERVER_PROCESS],
    "async1_thread": ["rollout.max_staleness=1"],
    "async1_proc": ["rollout.max_staleness=1", "rollout.producer_processes=2", *SERVER_PROCESS],
}
GENERATION_KEYS = ("time/rollout_s", "time/reward_s", "time/env_s")
"""A synchronous step's generation phase: the engine's calls, scoring and (episodes) the
environments' steps."""
TRAINING_KEYS = ("time/old_log_probs_s", "time/advantages_s", "time/update_s", "time/weight_sync_s")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/async_overlap.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant")
    parser.add_argument(
        "--scenarios", default="demo,long,large", help="comma-separated: demo, long, large, tool"
    )
    parser.add_argument(
        "--long-tokens", type=int, default=48, help="response length of long, large"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--thread", action="store_true", help="also the in-process thread engine")
    parser.add_argument(
        "--variants",
        default="sync,async1,async2,async1_proc",
        help="comma-separated, in run order: sync (always first), async1, async2, async1_proc",
    )
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
    if scenario in ("long", "large"):
        tokens = args.long_tokens
        overrides += [f"algo.response_length={tokens}", f"rollout.min_new_tokens={tokens}"]
    if variant in ("async1", "async2", "async1_proc"):
        overrides.append(f"rollout.engine_threads={args.threads}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, "-m", "megatron_gspo.train", *overrides]
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.parent / f"{output_dir.name}.log"
    (output_dir / "metrics.jsonl").unlink(missing_ok=True)  # a kept directory's earlier run
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
        cpu = CpuMeter(process.pid, output_dir / "metrics.jsonl")
        while process.poll() is None:
            cpu.sample()
            time.sleep(0.02)
    if process.returncode != 0:
        raise SystemExit(f"{scenario}/{variant} failed ({process.returncode}); log: {log_path}")
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return records, cpu.per_step()


class CpuMeter:
    """CPU seconds per RL step of the run's processes, from outside (psutil), over the steps
    after the first: the trainer's main thread (training), its other threads (the producer:
    HTTP, sample assembly, reward dispatch), the loopback server process (generation) and the
    rest (reward workers). On a machine shared with other work, wall-clock times stretch with
    the load but CPU times hardly do: they say what an idle machine would see. Producer
    processes (``rollout.producer_processes``, started by ``multiprocessing``'s spawn) are
    counted apart."""

    def __init__(self, pid: int, metrics_path: Path):
        import psutil

        self.trainer = psutil.Process(pid)
        self.metrics_path = metrics_path
        self.first: Optional[tuple[int, float, dict[str, float]]] = None
        self.last: Optional[tuple[int, float, dict[str, float]]] = None

    def _steps_logged(self) -> int:
        try:
            return self.metrics_path.read_text().count("\n")
        except FileNotFoundError:
            return 0

    def _cpu(self) -> dict[str, float]:
        import psutil

        parts = {
            "trainer_main": 0.0,
            "trainer_threads": 0.0,
            "server": 0.0,
            "producers": 0.0,
            "other": 0.0,
        }
        try:
            for thread in self.trainer.threads():
                seconds = thread.user_time + thread.system_time
                parts["trainer_main" if thread.id == self.trainer.pid else "trainer_threads"] += (
                    seconds
                )
            children = self.trainer.children(recursive=True)
        except psutil.Error:
            return {}
        for child in children:
            try:
                times = child.cpu_times()
                command = " ".join(child.cmdline())
            except psutil.Error:
                continue
            if "megatron_gspo.rollout.server" in command:
                part = "server"
            elif "multiprocessing.spawn" in command:
                part = "producers"
            else:
                part = "other"
            parts[part] += times.user + times.system
        return parts

    def sample(self) -> None:
        """Called every few milliseconds: records the CPU times when a new step's line
        appears (not later: the shutdown after the last step would count, and the server's
        times vanish once it has exited)."""
        steps = self._steps_logged()
        if steps < 1 or (self.last is not None and steps <= self.last[0]):
            return
        cpu = self._cpu()
        if not cpu:
            return
        point = (steps, time.monotonic(), cpu)
        if self.first is None:
            self.first = point
        self.last = point

    def per_step(self) -> dict[str, float]:
        if self.first is None or self.last is None or self.last[0] <= self.first[0]:
            return {}
        steps = self.last[0] - self.first[0]
        result = {
            f"cpu_{name}_s": (self.last[2][name] - self.first[2].get(name, 0.0)) / steps
            for name in self.last[2]
        }
        result["cpu_wall_s"] = (self.last[1] - self.first[1]) / steps
        return result


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
    # Where the step goes: the trainer's stages, the engine's generation (async: the chunks
    # made since the previous batch), and the async driver's measurements.
    keys = {
        "update_s": "time/update_s",
        "old_log_probs_s": "time/old_log_probs_s",
        "weight_sync_s": "time/weight_sync_s",
        "reward_s": "time/reward_s",
        "engine_generation_s": "generation_s",
        "engine_idle_s": "engine_idle_s",
        "staleness_mean": "staleness_mean",
        "overlap_frac": "overlap_frac",
        "trainer_wait_s": "trainer_wait_s",
        "partial_sample_frac": "partial_sample_frac",
        "turns_mean": "env/turns_mean",
    }
    for name, key in keys.items():
        values = [r[key] for r in steady if key in r]
        if values:
            summary[name] = statistics.median(values)
    return summary


def cpu_ratio(run: dict, sync: dict) -> Optional[float]:
    """What ``step_over_max_phase`` would be without the machine's other load: the step's
    busiest process (trainer, loopback server with the reward workers, or the producer
    processes together) in CPU seconds, over
    the sync run's max(generation, training) scaled by that run's CPU / wall (the share of its
    wall time the sync trainer got a core; the load stretches both phases alike)."""
    keys = ("cpu_trainer_main_s", "cpu_trainer_threads_s", "cpu_server_s", "cpu_other_s")
    if not all(key in run and key in sync for key in keys):
        return None
    trainer = run["cpu_trainer_main_s"] + run["cpu_trainer_threads_s"]
    engine = run["cpu_server_s"] + run["cpu_other_s"]
    producers = run.get("cpu_producers_s", 0.0)
    sync_cpu = sum(sync[key] for key in keys)
    sync_share = min(1.0, sync_cpu / sync["cpu_wall_s"])
    busiest = max(trainer, engine, producers)
    return busiest / (max(sync["generation_s"], sync["training_s"]) * sync_share)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    variants = ["sync"] + [v.strip() for v in args.variants.split(",") if v.strip() != "sync"]
    variants += ["async1_thread"] if args.thread else []
    unknown = [variant for variant in variants if variant not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; these exist: {sorted(VARIANTS)}")
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="async_overlap_"))
    results: dict[str, dict[str, list[dict]]] = {s: {v: [] for v in variants} for s in scenarios}
    started = time.time()
    load_at_start = round(os.getloadavg()[0], 2)
    for round_index in range(args.rounds):
        for scenario in scenarios:
            for variant in variants:
                run_dir = root / f"{scenario}-{variant}-{round_index}"
                records, cpu = run_variant(args, scenario, variant, run_dir)
                results[scenario][variant].append({**summarize(records), **cpu})
                print(
                    f"[async_overlap] {scenario}/{variant} round {round_index}: "
                    f"{results[scenario][variant][-1]['step_s']:.2f} s/step",
                    file=sys.stderr,
                )
    report = {
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "cpu_model": cpu_model_name(),
        "load_average_at_start": load_at_start,
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
            cpu_ratios = [cpu_ratio(run, sync) for run, sync in zip(runs, sync_runs)]
            if all(ratio is not None for ratio in cpu_ratios):
                row["cpu_step_over_max_phase"] = statistics.median(cpu_ratios)
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
        f"# async_overlap: {report['machine']} ({report['cpu_model']}; load average "
        f"{report['load_average_at_start']} at the start); {report['threads_per_process']} torch "
        f"thread(s) per process; {report['steps']} steps x {report['rounds']} rounds"
    )
    for scenario, rows in report["scenarios"].items():
        sync = rows["sync"]
        print(
            f"\n## {scenario}: sync generation {sync['generation_s']:.2f} s, training "
            f"{sync['training_s']:.2f} s per step\n"
        )
        print(
            "| variant | step s | tokens/s | step / max(gen, train) | CPU: step / max | vs sync "
            "| staleness | overlap | update s | sync s | CPU s/step trainer (main+other) "
            "| CPU s/step engine (server+rewards) | CPU s/step producer processes | turns |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for variant, row in rows.items():
            print(
                f"| {variant} | {row['step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                f"{row['step_over_max_phase']:.2f} | {_number(row, 'cpu_step_over_max_phase')} | "
                f"{row['speedup_vs_sync']:.2f}x | {_number(row, 'staleness_mean')} | "
                f"{_number(row, 'overlap_frac')} | {_number(row, 'update_s', 3)} | "
                f"{_number(row, 'weight_sync_s', 3)} | "
                f"{_number(row, 'cpu_trainer_main_s', 3)}+{_number(row, 'cpu_trainer_threads_s', 3)} | "
                f"{_number(row, 'cpu_server_s', 3)}+{_number(row, 'cpu_other_s', 3)} | "
                f"{_number(row, 'cpu_producers_s', 3)} | {_number(row, 'turns_mean')} |"
            )


def _number(row: dict, key: str, digits: int = 2) -> str:
    return "-" if key not in row else f"{row[key]:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
