"""The CPU demo's step time on different megatron-core versions (one Python environment each).

Each environment (``--python NAME=PATH``, the interpreter of a venv with megatron_gspo installed
editable from this checkout) runs the CPU demo (``python -m megatron_gspo.train``, one process,
GSPO, no supervised warm-up) for ``--steps`` RL steps in a fresh subprocess with ``--threads``
torch threads. The environments alternate A B A B ... (``--repeats`` runs each), so that load from
other jobs on a shared machine hits them alike. Reported per environment: its torch and
megatron-core versions, and the minimum and the median (over runs and over the steps after the
first, which carries one-time costs; on a shared machine the minimum is the fairer figure) of the
step's training-engine stages from ``metrics.jsonl``: the
old-log-prob forward (``time/old_log_probs_s``), the policy update (``time/update_s``, four
mini-batches of forward + backward + optimizer step) and the whole step, plus each one's ratio to
the first environment. A micro-benchmark isolates megatron-core's packed-sequence (THD) RoPE
without fused kernels, ``rope_utils._apply_rotary_pos_emb_thd``, forward + backward on one
micro-batch of the demo's shape (64 sequences of 19 tokens, 4 heads of 16, one thread): the best
of 30 calls, in its own subprocess per environment (``--rope-worker``).

Usage (from the repository root; see benchmarks/README.md, "megatron-core versions")::

    python benchmarks/megatron_versions.py --python mc17=.venv-py312/bin/python \\
        --python mc19=/tmp/venv-mc019/bin/python
    python benchmarks/megatron_versions.py ... --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("old_log_probs", "update", "step")
ROPE_SEQUENCES, ROPE_LENGTH, ROPE_HEADS, ROPE_HEAD_DIM = 64, 19, 4, 16
VERSIONS = (
    "import importlib.metadata as m, sys; "
    "print(sys.version.split()[0], m.version('torch'), m.version('megatron-core'))"
)


def run_demo(python: str, steps: int, threads: int) -> dict[str, list[float]]:
    """Seconds per stage of each step after the first, from one fresh run of the CPU demo."""
    with tempfile.TemporaryDirectory() as output_dir:
        command = [
            python,
            "-m",
            "megatron_gspo.train",
            f"steps={steps}",
            "sft_warmup_steps=0",
            f"output_dir={output_dir}",
            "logging.tensorboard=false",
            "logging.progress_bar=false",
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        records = [
            json.loads(line)
            for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()
        ]
    records = [record for record in records if "time/update_s" in record][1:]
    times = {stage: [record[f"time/{stage}_s"] for record in records] for stage in STAGES[:2]}
    times["step"] = [
        sum(value for key, value in record.items() if key.startswith("time/")) for record in records
    ]
    return times


def rope_worker() -> None:
    """Prints the best forward + backward time (ms) of the THD RoPE of this megatron-core."""
    import time
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core.models.common.embeddings import rope_utils

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    lengths = torch.full((ROPE_SEQUENCES,), ROPE_LENGTH)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
    hidden = torch.randn(int(cu_seqlens[-1]), ROPE_HEADS, ROPE_HEAD_DIM, requires_grad=True)
    freqs = torch.randn(ROPE_LENGTH * 4, 1, 1, ROPE_HEAD_DIM)
    group = dist.new_group([0])

    def call() -> float:
        start = time.perf_counter()
        rope_utils._apply_rotary_pos_emb_thd(
            hidden, cu_seqlens, freqs, cp_group=group
        ).sum().backward()
        return time.perf_counter() - start

    for _ in range(5):
        call()
    print(min(call() for _ in range(30)) * 1e3)
    dist.destroy_process_group()


def rope_milliseconds(python: str) -> float:
    command = [python, str(Path(__file__).resolve()), "--rope-worker"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return float(completed.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--python",
        action="append",
        metavar="NAME=PATH",
        help="an environment's interpreter (repeat; default: this interpreter)",
    )
    parser.add_argument("--steps", type=int, default=6, help="RL steps per run (first dropped)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per environment")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rope-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rope_worker:
        rope_worker()
        return
    environments = dict(
        entry.split("=", 1) for entry in (args.python or [f"here={sys.executable}"])
    )

    samples: dict[str, dict[str, list[float]]] = {
        name: {stage: [] for stage in STAGES} for name in environments
    }
    rope: dict[str, list[float]] = {name: [] for name in environments}
    for _ in range(args.repeats):
        for name, python in environments.items():
            for stage, seconds in run_demo(python, args.steps, args.threads).items():
                samples[name][stage] += seconds
            rope[name].append(rope_milliseconds(python))

    first = next(iter(environments))
    result = {}
    for name, python in environments.items():
        versions = subprocess.run(
            [python, "-c", VERSIONS], capture_output=True, text=True, check=True
        ).stdout.split()
        minima = {stage: min(samples[name][stage]) for stage in STAGES}
        medians = {stage: statistics.median(samples[name][stage]) for stage in STAGES}
        result[name] = {
            "python": versions[0],
            "torch": versions[1],
            "megatron_core": versions[2],
            **{f"{stage}_min_s": seconds for stage, seconds in minima.items()},
            **{f"{stage}_median_s": seconds for stage, seconds in medians.items()},
            **{
                f"{stage}_min_vs_{first}": seconds / min(samples[first][stage])
                for stage, seconds in minima.items()
            },
            **{
                f"{stage}_median_vs_{first}": seconds / statistics.median(samples[first][stage])
                for stage, seconds in medians.items()
            },
            "thd_rope_ms": min(rope[name]),
            f"thd_rope_vs_{first}": min(rope[name]) / min(rope[first]),
            "samples_per_stage": len(samples[name]["step"]),
        }
    if args.json:
        print(json.dumps(result))
        return
    print(
        "| environment | python | torch | megatron-core | old log-probs s | update s | step s "
        f"| update vs {first} | step vs {first} | THD RoPE ms | RoPE vs {first} |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in result.items():
        print(
            f"| {name} | {row['python']} | {row['torch']} | {row['megatron_core']} "
            f"| {row['old_log_probs_min_s']:.3f} | {row['update_min_s']:.3f} "
            f"| {row['step_min_s']:.3f} | {row[f'update_min_vs_{first}']:.2f} "
            f"| {row[f'step_min_vs_{first}']:.2f} | {row['thd_rope_ms']:.2f} "
            f"| {row[f'thd_rope_vs_{first}']:.1f} |"
        )
    print(
        f"(minima over {result[first]['samples_per_stage']} steps; medians: update "
        + ", ".join(f"{name} {row['update_median_s']:.3f} s" for name, row in result.items())
        + "; step "
        + ", ".join(f"{name} {row['step_median_s']:.3f} s" for name, row in result.items())
        + ")"
    )


if __name__ == "__main__":
    main()
