"""Train-step time with a rollout correction on against off (``algo.rollout_correction``).

One process, one training engine (the CPU demo's tiny Qwen3-MoE by default, or ``--hidden``), one
fixed mini-batch of ``--samples`` responses of ``--response`` tokens whose behaviour log-probs are
the old ones moved by ~0.3 per token. Each variant swaps only the loss settings (what
``megatron_gspo.algo.policy_loss_settings`` would build); the variants run interleaved (off, token
truncate, token mask, sequence truncate, sequence mask, off, ...; ``--repeats`` each) so that
load from other jobs hits them alike. Timed: ``forward_backward`` + ``optimizer_step`` (the
weights move, the work per step does not). Reported: median wall and process CPU seconds per
step and their ratios to "off" (on a shared machine read the CPU time with ``--threads 1``).

Usage (from the repository root)::

    python benchmarks/correction_step_time.py              # the table
    python benchmarks/correction_step_time.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from typing import Optional

import torch

from megatron_gspo.algo import RolloutCorrection
from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.samples import TrainSample

VARIANTS = {
    "off": None,
    "token truncate (TIS)": RolloutCorrection(level="token", mode="truncate", high=2.0),
    "token mask (IcePop)": RolloutCorrection(level="token", mode="mask", low=0.5, high=5.0),
    "sequence truncate": RolloutCorrection(level="sequence", mode="truncate", high=2.0),
    "sequence mask": RolloutCorrection(level="sequence", mode="mask", low=0.999, high=1.001),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def make_samples(args: argparse.Namespace, vocab: int) -> list[TrainSample]:
    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(args.samples):
        tokens = torch.randint(0, vocab, (args.prompt + args.response,), generator=generator)
        old = -math.log(vocab) + 0.02 * torch.randn(args.response, generator=generator)
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=args.prompt,
                group_id=index // 8,
                advantages=torch.randn((), generator=generator),
                old_log_probs=old,
                rollout_log_probs=old - 0.3 * torch.randn(args.response, generator=generator),
            )
        )
    return samples


def run(args: argparse.Namespace) -> dict:
    from megatron_gspo.engine.train_step import TrainEngine

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    model = {"hidden_size": args.hidden, "head_dim": args.hidden // 4}
    cfg = from_dict(
        TrainConfig,
        {
            "model": model,
            "algo": {"num_mini_batches": 1, "response_length": args.response},
            "parallel": {"micro_batch_tokens": 2048},
        },
    )
    engine = TrainEngine(cfg)
    samples = make_samples(args, cfg.model.vocab_size)
    base = engine.loss_settings
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    # Process CPU time (all threads) as well: on a machine shared with other jobs the wall time
    # mostly measures the wait for a core; with --threads 1 the CPU time is the work itself.
    cpu_seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for name, correction in VARIANTS.items():
            engine.loss_settings = dataclasses.replace(base, rollout_correction=correction)
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.train_step(samples)
            if repeat:
                seconds[name].append(time.perf_counter() - start)
                cpu_seconds[name].append(time.process_time() - cpu_start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    cpu_medians = {name: statistics.median(values) for name, values in cpu_seconds.items()}
    return {
        "hidden": args.hidden,
        "samples": args.samples,
        "tokens_per_step": args.samples * (args.prompt + args.response),
        "threads": args.threads,
        "repeats": args.repeats,
        "seconds": seconds,
        "median_s": medians,
        "vs_off": {name: medians[name] / medians["off"] for name in VARIANTS},
        "cpu_seconds": cpu_seconds,
        "cpu_median_s": cpu_medians,
        "cpu_vs_off": {name: cpu_medians[name] / cpu_medians["off"] for name in VARIANTS},
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"hidden {args.hidden}, {args.samples} samples x ({args.prompt} + {args.response}) tokens, "
        f"{args.threads} threads, {args.repeats} interleaved runs each"
    )
    print("| correction | median s / step | min s | vs off | median CPU s | vs off (CPU) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, values in result["seconds"].items():
        print(
            f"| {name} | {result['median_s'][name]:.3f} | {min(values):.3f} | "
            f"{result['vs_off'][name]:.3f}x | {result['cpu_median_s'][name]:.3f} | "
            f"{result['cpu_vs_off'][name]:.3f}x |"
        )


if __name__ == "__main__":
    main()
