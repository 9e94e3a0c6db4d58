"""Generation speed of the embedded rollout engine in bfloat16 against float32 (``rollout.dtype``).

Both engines hold the same weights (the bf16 one gets them cast at a sync, as in training) and
generate the same job: ``--batch`` prompts of ``--prompt`` tokens, exactly ``--new`` tokens each
(stop tokens held back with ``min_new_tokens``), temperature 1, one seed per request. They run
interleaved in ONE process (fp32, bf16, fp32, bf16, ...; ``--repeats`` each) with the same
thread count, so that load from other jobs on a shared machine hits both alike; the reported
figures are the ratios of the median wall and process CPU times (on a shared machine read the CPU
time with ``--threads 1``).

The model is a Qwen3-MoE sized so that the matrix products dominate a decode step (``--hidden``
1024, 2 layers, 8 experts of intermediate 1024, top-2, 16 query / 4 KV heads of 64, vocab 8192):
on a CPU with AVX-512 BF16 a bf16 GEMM of 32+ rows runs ~2-2.5x faster than fp32, but a tiny
model (the CPU demo's hidden 64) is bound by per-op overhead, where bf16 only adds casts. Decoding
32 rows at a time gives the experts ~8 rows each, enough for the bf16 kernels.

Usage (from the repository root)::

    python benchmarks/rollout_dtype.py                  # the table (fp32, bf16, bf16 before)
    python benchmarks/rollout_dtype.py --json           # one JSON object
    python benchmarks/rollout_dtype.py --hidden 64 --ffn 48 --heads 4 --kv-heads 2 --vocab 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=1024, help="expert intermediate size")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=32, help="requests generated together")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per dtype")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16,bfloat16-before",
        help="bfloat16-before: the bf16 engine through transformers' *ForCausalLM forward, whose "
        "output layer on a prefill's strided last-position slice copies the weight once per row "
        "in bf16 (the path before EmbeddedEngine._reduced_precision_logits)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    return parser.parse_args(argv)


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=args.kv_heads,
        head_dim=args.hidden // args.heads,
        ffn_hidden_size=args.ffn,
        num_experts=args.experts,
        moe_ffn_hidden_size=args.ffn,
        moe_router_topk=2,
    )


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    # As the trainer does (loop.run): subnormal activations of random weights slow x86 down.
    torch.set_flush_denormal(True)
    config = model_config(args)
    dtypes = args.dtypes.split(",")
    engines = {}
    for name in dtypes:
        engine = EmbeddedEngine(config, seed=0, dtype=getattr(torch, name.split("-")[0]))
        if name.endswith("-before"):
            engine.reduced_precision = False  # the transformers forward, as before the fix
        engines[name] = engine
    weights = [(name, tensor.clone()) for name, tensor in engines[dtypes[0]].hf_state()]
    for engine in engines.values():
        engine.sync_weights(iter(weights), version=1)
    eos = args.vocab - 1
    requests = [
        GenerateRequest(
            input_ids=[(7 * i + j) % (args.vocab - 1) for j in range(args.prompt)],
            max_new_tokens=args.new,
            min_new_tokens=args.new,
            stop_token_ids=[eos],
            temperature=1.0,
            seed=i,
            return_logprob=True,
        )
        for i in range(args.batch)
    ]
    for engine in engines.values():  # warm-up: one-time allocation and kernel selection
        engine.generate(requests[:4])
    seconds: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    # Process CPU time (all threads) as well: on a machine shared with other jobs the wall time
    # mostly measures the wait for a core; with --threads 1 the CPU time is the work itself.
    cpu_seconds: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    tokens = args.batch * args.new
    for _ in range(args.repeats):
        for dtype, engine in engines.items():
            start, cpu_start = time.perf_counter(), time.process_time()
            results = engine.generate(requests)
            seconds[dtype].append(time.perf_counter() - start)
            cpu_seconds[dtype].append(time.process_time() - cpu_start)
            assert sum(len(r.output_ids) for r in results) == tokens
    medians = {dtype: statistics.median(values) for dtype, values in seconds.items()}
    cpu_medians = {dtype: statistics.median(values) for dtype, values in cpu_seconds.items()}
    base = dtypes[0]
    return {
        "model": {
            "hidden": args.hidden,
            "ffn": args.ffn,
            "layers": args.layers,
            "experts": args.experts,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
        },
        "job": {"batch": args.batch, "prompt": args.prompt, "new": args.new},
        "threads": args.threads,
        "repeats": args.repeats,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_s": {dtype: tokens / medians[dtype] for dtype in dtypes},
        "speedup_vs_" + base: {dtype: medians[base] / medians[dtype] for dtype in dtypes},
        "cpu_speedup_vs_" + base: {
            dtype: cpu_medians[base] / cpu_medians[dtype] for dtype in dtypes
        },
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    base = args.dtypes.split(",")[0]
    print(
        f"Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts x "
        f"{args.ffn}, vocab {args.vocab}; {args.batch} x {args.new} new tokens; "
        f"{args.threads} threads, {args.repeats} interleaved runs each"
    )
    print(f"| dtype | median s | min s | tokens/s | vs {base} | median CPU s | vs {base} (CPU) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype, values in result["seconds"].items():
        print(
            f"| {dtype} | {statistics.median(values):.2f} | {min(values):.2f} | "
            f"{result['tokens_per_s'][dtype]:.0f} | "
            f"{result['speedup_vs_' + base][dtype]:.2f}x | "
            f"{statistics.median(result['cpu_seconds'][dtype]):.2f} | "
            f"{result['cpu_speedup_vs_' + base][dtype]:.2f}x |"
        )


if __name__ == "__main__":
    main()
