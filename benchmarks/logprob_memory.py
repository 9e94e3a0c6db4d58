"""Peak extra memory and time of per-token log-probs + entropy, forward and backward.

Compares ``megatron_gspo.engine.logprobs.vocab_parallel_log_probs`` (chunked, logits recomputed in
backward) with the naive path that materialises the ``[N, V]`` fp32 logits::

    log_softmax = torch.log_softmax((h @ W.T).float() / T, -1)
    log_probs   = log_softmax.gather(1, y[:, None])
    entropy     = -(log_softmax.exp() * log_softmax).sum(-1)

Both compute ``loss = sum(a * log_probs) + sum(b * entropy)`` and its gradient wrt ``h`` and ``W``.
Each variant runs in a fresh subprocess; its memory figure is the peak resident set size (RSS)
above the RSS right after the inputs were built (the weight gradient, needed by both, is included).
Time is the minimum over ``--repeats`` forward+backward runs (the box is shared, so the minimum is
the least noisy estimate). Run from the repository root:

    python benchmarks/logprob_memory.py                  # table
    python benchmarks/logprob_memory.py --json           # one JSON object
    python benchmarks/logprob_memory.py --sweep 128,256,512,1024
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
MEGABYTE = 1024 * 1024


class PeakRss:
    """Highest RSS seen by a 1 ms sampling thread, cross-checked with the kernel's ``ru_maxrss``."""

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._peak = 0
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._process.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> PeakRss:
        self._high_water_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        high_water = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        # ru_maxrss is exact but process-lifetime: it only speaks for this window if it moved.
        if high_water > self._high_water_before:
            self._peak = max(self._peak, high_water)

    @property
    def peak(self) -> int:
        return self._peak


def naive_log_probs(hidden, weight, labels, temperature):
    log_softmax = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    log_probs = log_softmax.gather(1, labels.unsqueeze(1)).squeeze(1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def run_worker(args: argparse.Namespace) -> dict:
    """One variant in this (fresh) process: memory of the first run, then the time of each run."""
    from megatron_gspo.engine.logprobs import vocab_parallel_log_probs

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # In-place scaling: no setup temporary the size of the weight raises ru_maxrss.
    hidden = torch.randn(args.tokens, args.hidden).requires_grad_()
    weight = torch.randn(args.vocab, args.hidden).mul_(args.hidden**-0.5).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.tokens,))
    grad_log_probs = torch.randn(args.tokens)
    grad_entropy = torch.randn(args.tokens)

    def step() -> None:
        if args.worker == "naive":
            log_probs, entropy = naive_log_probs(hidden, weight, labels, args.temperature)
        else:
            log_probs, entropy = vocab_parallel_log_probs(
                hidden,
                weight,
                labels,
                tp_group=None,
                temperature=args.temperature,
                chunk_size=args.chunk_size,
                with_entropy=True,
            )
        loss = (log_probs * grad_log_probs).sum() + (entropy * grad_entropy).sum()
        grads = torch.autograd.grad(loss, (hidden, weight))
        # Loss and gradient norms, to check both variants computed the same thing (norms, not
        # sums: a gradient sum cancels to noise). No copy of the weight gradient is made here.
        checks.append([float(loss), *(float(torch.linalg.vector_norm(grad)) for grad in grads)])

    checks: list[list[float]] = []
    baseline = psutil.Process().memory_info().rss
    times, cpu_times = [], []
    for repeat in range(args.repeats):
        # Memory from the first run (nothing cached yet); every run is timed.
        with PeakRss() if repeat == 0 else contextlib.nullcontext() as peak_window:
            start, cpu_start = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
        if repeat == 0:
            peak = peak_window
    return {
        "variant": args.worker,
        "chunk_size": args.chunk_size if args.worker == "ours" else None,
        "extra_mb": (peak.peak - baseline) / MEGABYTE,
        "times_s": times,
        "cpu_times_s": cpu_times,
        "loss_and_grad_norms": checks[0],
    }


def spawn(args: argparse.Namespace, variant: str, chunk_size: int) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        variant,
        "--chunk-size",
        str(chunk_size),
        *("--tokens", str(args.tokens), "--hidden", str(args.hidden)),
        *("--vocab", str(args.vocab), "--temperature", str(args.temperature)),
        *("--repeats", str(args.repeats), "--threads", str(args.threads)),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, check=False)
    if completed.returncode != 0:
        raise SystemExit(f"{variant} worker failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> None:
    from megatron_gspo.engine.logprobs import DEFAULT_CHUNK_SIZE

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048, help="N, tokens (default 2048)")
    parser.add_argument("--hidden", type=int, default=256, help="H, hidden size (default 256)")
    parser.add_argument("--vocab", type=int, default=151936, help="V (default 151936, Qwen3)")
    parser.add_argument("--temperature", type=float, default=0.7, help="T (default 0.7)")
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=DEFAULT_CHUNK_SIZE,
        help=f"our chunk size, the one ours_mb and ratio report (default {DEFAULT_CHUNK_SIZE})",
    )
    parser.add_argument(
        "--sweep", default="", help="extra comma-separated chunk sizes to measure, e.g. 128,512"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per process")
    parser.add_argument(
        "--rounds", type=int, default=1, help="fresh processes per variant, interleaved"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per worker (default: torch's own)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", choices=["ours", "naive"], help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        print(json.dumps(run_worker(args)))
        return

    sweep = [int(size) for size in args.sweep.split(",") if size]
    runs = [("naive", args.chunk_size), ("ours", args.chunk_size)]
    runs += [("ours", size) for size in sweep if size != args.chunk_size]
    rows: dict[tuple[str, int], dict] = {}
    for _ in range(args.rounds):
        # Interleaved so that load from other processes on the box hits every variant alike.
        for variant, chunk_size in runs:
            result = spawn(args, variant, chunk_size)
            print(
                f"{variant} C={chunk_size}: {result['extra_mb']:,.0f} MB, "
                + " ".join(f"{seconds:.2f}" for seconds in result["times_s"])
                + " s",
                file=sys.stderr,
                flush=True,
            )
            row = rows.setdefault(
                (variant, chunk_size), {**result, "times_s": [], "cpu_times_s": []}
            )
            row["extra_mb"] = max(row["extra_mb"], result["extra_mb"])
            row["times_s"] += result["times_s"]
            row["cpu_times_s"] += result["cpu_times_s"]

    naive = rows[("naive", args.chunk_size)]
    ours = rows[("ours", args.chunk_size)]
    for row in rows.values():
        row["min_s"] = min(row["times_s"])
        row["min_cpu_s"] = min(row["cpu_times_s"])
        row["max_relative_difference"] = max(
            abs(value - reference) / abs(reference)
            for value, reference in zip(row["loss_and_grad_norms"], naive["loss_and_grad_norms"])
        )
    logits_mb = args.tokens * args.vocab * 4 / MEGABYTE
    summary = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "temperature": args.temperature,
        "threads": args.threads or torch.get_num_threads(),
        "fp32_logits_mb": logits_mb,
        "chunk_size": args.chunk_size,
        "ours_mb": ours["extra_mb"],
        "naive_mb": naive["extra_mb"],
        "ratio": ours["extra_mb"] / naive["extra_mb"],
        "ours_s": ours["min_s"],
        "naive_s": naive["min_s"],
        "speedup": naive["min_s"] / ours["min_s"],
        "ours_cpu_s": ours["min_cpu_s"],
        "naive_cpu_s": naive["min_cpu_s"],
        "variants": list(rows.values()),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"N={args.tokens} H={args.hidden} V={args.vocab} T={args.temperature} fp32, "
        f"{summary['threads']} threads; fp32 [N, V] logits = {logits_mb:,.0f} MB; "
        "log-probs + entropy, forward + backward"
    )
    header = ["variant", "extra MB", "x naive", "min wall s", "min CPU s", "vs naive", "wall s"]
    print(
        f"{header[0]:<12}{header[1]:>10}{header[2]:>9}{header[3]:>12}{header[4]:>11}"
        f"{header[5]:>10}   {header[6]}"
    )
    for row in rows.values():
        name = "naive" if row["variant"] == "naive" else f"ours C={row['chunk_size']}"
        runs_text = " ".join(f"{seconds:.1f}" for seconds in row["times_s"])
        print(
            f"{name:<12}{row['extra_mb']:>10,.0f}{row['extra_mb'] / naive['extra_mb']:>9.3f}"
            f"{row['min_s']:>12.2f}{row['min_cpu_s']:>11.2f}"
            f"{row['max_relative_difference']:>10.1e}   {runs_text}"
        )
    print(
        f"ratio ours/naive (C={args.chunk_size}) = {summary['ratio']:.3f}; "
        f"naive/ours min wall = {summary['speedup']:.2f}, "
        f"min CPU = {naive['min_cpu_s'] / ours['min_cpu_s']:.2f}"
    )


if __name__ == "__main__":
    main()
