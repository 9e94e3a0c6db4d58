"""The bf16 trainer's step (``model.dtype=bfloat16``) against fp32, at the sizes of ``vs_trl.py``.

Two worker processes, one per dtype, each build our ``TrainEngine`` for ``--size`` (seed weights,
tp = pp = ep = 1) on the vs-TRL job's shapes (``train_step_profile.make_config`` /
``make_samples``: 64 samples of 9 prompt + R response tokens, 4 mini-batches of 16, one
micro-batch each) and wait. The parent then asks them for one training step at a time, in turn
(fp32, bf16, fp32, bf16, ...; never both at once), so that load from other jobs on a shared
machine hits both alike. A step is what one rollout step costs the trainer: the recompute of the
old log-probs over the 64 samples (``forward_log_probs``) and the 4 mini-batches'
``forward_backward`` + ``optimizer_step``. Each worker's first step is a warm-up. Times are the
worker's process CPU time (all its threads; ``--wall`` for wall time): on a shared machine CPU
time is much steadier, and at 1 thread on an idle one they agree. The report is the median per
dtype, the fp32 / bf16 ratio, and the CPU (``/proc/cpuinfo``'s model name and whether it has
native bf16: ``avx512_bf16`` or ``amx_bf16``).

With ``--profile`` each worker also prints where a mini-batch's time goes by operator (torch
profiler, self CPU time, one mini-batch after the timed steps).

Usage (from the repository root)::

    python benchmarks/bf16_train_step.py                       # tiny and medium, 3 steps each
    python benchmarks/bf16_train_step.py --size medium --steps 2 --profile
    python benchmarks/bf16_train_step.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

BENCHMARKS = Path(__file__).resolve().parent
for _path in (str(BENCHMARKS), str(BENCHMARKS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

DTYPES = ("float32", "bfloat16")


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and its native bf16 instructions, from ``/proc/cpuinfo``."""
    name, flags = "unknown", set()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    native = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})
    return {"model_name": name, "native_bf16": native, "avx512f": "avx512f" in flags}


# ---------------------------------------------------------------------------------------------
# Worker: one engine, one dtype; steps on request
# ---------------------------------------------------------------------------------------------


def worker(size: str, dtype: str, threads: int, wall: bool, profile: bool) -> None:
    import torch

    torch.set_num_threads(threads)
    from train_step_profile import make_config, make_samples
    from vs_trl_job import MINI_BATCHES, SAMPLES_PER_STEP

    from megatron_gspo.engine import TrainEngine

    clock = time.perf_counter if wall else time.process_time
    cfg = make_config(size)
    cfg.model.dtype = dtype
    engine = TrainEngine(cfg)
    samples = make_samples(size)
    mini = SAMPLES_PER_STEP // MINI_BATCHES
    batches = [samples[i * mini : (i + 1) * mini] for i in range(MINI_BATCHES)]
    print(json.dumps({"ready": dtype}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = clock()
        engine.forward_log_probs(samples)
        recompute = clock() - start
        losses = []
        for batch in batches:
            metrics = engine.optimizer_step(engine.forward_backward(batch))
            losses.append(metrics["loss"])
        update = clock() - start - recompute
        print(json.dumps({"recompute": recompute, "update": update, "loss": losses[0]}), flush=True)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as profiler:
            engine.optimizer_step(engine.forward_backward(batches[0]))
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
        print(json.dumps({"profile": table}), flush=True)


# ---------------------------------------------------------------------------------------------
# Parent: interleave the two workers
# ---------------------------------------------------------------------------------------------


def _start(size: str, dtype: str, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, __file__, "--worker", dtype, "--size", size]
    command += ["--threads", str(args.threads)] + (["--wall"] if args.wall else [])
    command += ["--profile"] if args.profile else []
    # Megatron's import-time notices about missing apex / TE, once per worker: expected on CPU.
    env = {"OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
        cwd=BENCHMARKS.parent,
    )


def _read(process: subprocess.Popen) -> dict[str, Any]:
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({process.wait()})")
        if line.startswith("{"):
            return json.loads(line)


def measure(size: str, args: argparse.Namespace) -> dict[str, Any]:
    workers = {dtype: _start(size, dtype, args) for dtype in DTYPES}
    try:
        for process in workers.values():
            _read(process)  # built
        times: dict[str, list[dict[str, float]]] = {dtype: [] for dtype in DTYPES}
        for step in range(args.steps + 1):  # the first is a warm-up
            for dtype, process in workers.items():
                process.stdin.write("step\n")
                process.stdin.flush()
                result = _read(process)
                if step:
                    times[dtype].append(result)
        profiles = {}
        for dtype, process in workers.items():
            process.stdin.write("stop\n")
            process.stdin.close()
            if args.profile:
                profiles[dtype] = _read(process)["profile"]
            process.wait(timeout=600)
    finally:
        for process in workers.values():
            if process.poll() is None:
                process.kill()
    out: dict[str, Any] = {"size": size, "steps": args.steps}
    for dtype, results in times.items():
        out[dtype] = {
            name: statistics.median(result[name] for result in results)
            for name in ("recompute", "update")
        }
        out[dtype]["step"] = statistics.median(r["recompute"] + r["update"] for r in results)
        out[dtype]["loss_first_minibatch"] = results[0]["loss"]
    out["speedup"] = {
        name: out["float32"][name] / out["bfloat16"][name]
        for name in ("recompute", "update", "step")
    }
    if profiles:
        out["profiles"] = profiles
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny,medium", help="comma-separated vs_trl sizes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per dtype")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--wall", action="store_true", help="wall time instead of CPU time")
    parser.add_argument("--profile", action="store_true", help="operator table per dtype")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--worker", choices=DTYPES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.size, args.worker, args.threads, args.wall, args.profile)
        return 0
    from vs_trl_job import SIZES

    sizes = args.size.split(",")
    unknown = set(sizes) - set(SIZES)
    if unknown:
        raise SystemExit(f"--size: unknown {sorted(unknown)}; choose from {list(SIZES)}")
    report = {
        "cpu": cpu_description(),
        "threads": args.threads,
        "clock": "wall" if args.wall else "process CPU",
        "sizes": [measure(size, args) for size in sizes],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    cpu = report["cpu"]
    native = ", ".join(cpu["native_bf16"]) or "none (bf16 is emulated: keep fp32)"
    print(f"CPU: {cpu['model_name']}; native bf16: {native}")
    print(f"{args.threads} thread(s), {report['clock']} time, median of {args.steps} steps\n")
    print("| size | dtype | recompute (s) | update (s) | step (s) | fp32 / bf16 (step) |")
    print("|---|---|---|---|---|---|")
    for block in report["sizes"]:
        for dtype in DTYPES:
            row = block[dtype]
            ratio = f"**{block['speedup']['step']:.2f}x**" if dtype == "bfloat16" else ""
            print(
                f"| {block['size']} | {dtype} | {row['recompute']:.3f} | {row['update']:.3f} | "
                f"{row['step']:.3f} | {ratio} |"
            )
        for dtype, table in block.get("profiles", {}).items():
            print(f"\n{block['size']} {dtype}, one mini-batch by operator:\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
