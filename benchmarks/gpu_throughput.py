"""GPU training throughput of a Qwen3-30B-A3B-shaped MoE scaled to one GPU, and weight-sync time.

The model keeps Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 key-value heads of 128,
experts of 768 with top-8 routing, vocab 151,936, QK-norm, renormalised top-k) with fewer layers
and experts (``--layers``, ``--experts``) so that one GPU holds the weights, gradients and Adam
state. It runs GSPO policy updates (``TrainEngine.train_step``) in bf16 with Transformer Engine on
packed random samples and prints training tokens/s and model FLOPs utilisation (FLOPs counted as in
``benchmarks/gpu_smoke.py``: ``6 * N_active`` per token plus causal attention), with the layout
and flags used. Weight sync: the time to gather and stream the model in Hugging Face names
(``engine.hf_import_export.iter_hf_weights``), and, with ``--sglang-url`` (a server started with
``examples/moe/sglang_server.sh`` on an export of this model, ``--export-hf``), the full update
through the SGLang client.

Without a CUDA GPU it prints a message and exits 0.

    python benchmarks/gpu_throughput.py
    python benchmarks/gpu_throughput.py --layers 8 --experts 64 --tokens-per-sample 4096 --json
    torchrun --nproc_per_node 8 benchmarks/gpu_throughput.py --ep 8 --experts 128 --layers 48
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_smoke import active_matmul_parameters, peak_tflops  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/gpu_throughput.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (real model: 48)")
    parser.add_argument("--experts", type=int, default=32, help="routed experts (real: 128)")
    parser.add_argument("--samples", type=int, default=16, help="samples per optimizer step")
    parser.add_argument("--tokens-per-sample", type=int, default=2048, help="prompt+response")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (2 are warm-up)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--recompute", action="store_true", help="full activation recompute")
    parser.add_argument("--sglang-url", default=None, help="time a weight update to this server")
    parser.add_argument("--export-hf", default=None, help="write the model's HF export here")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    return parser.parse_args(argv)


def build_config(args: argparse.Namespace):
    from megatron_gspo.config import (
        AlgoConfig,
        ModelConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )

    model = ModelConfig(
        architecture="qwen3_moe",
        vocab_size=151_936,
        hidden_size=2048,
        num_layers=args.layers,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        num_experts=args.experts,
        moe_ffn_hidden_size=768,
        moe_router_topk=8,
        rope_theta=1_000_000.0,
        max_position_embeddings=max(4096, args.tokens_per_sample),
        dtype="bfloat16",
        recompute_activations=args.recompute,
    )
    response = args.tokens_per_sample // 2
    algo = AlgoConfig(
        rollout_batch_size=args.samples,
        num_return_sequences_in_group=1,
        num_mini_batches=1,
        prompt_length=args.tokens_per_sample - response,
        response_length=response,
        old_log_prob_source="rollout",
    )
    parallel = ParallelConfig(tp=args.tp, ep=args.ep, micro_batch_tokens=args.tokens_per_sample * 2)
    return TrainConfig(
        model=model,
        parallel=parallel,
        algo=algo,
        optim=OptimConfig(lr=1e-5),
        steps=args.steps,
        sft_warmup_steps=0,
    )


def random_samples(cfg, generator):
    import torch

    from megatron_gspo.samples import TrainSample

    prompt = cfg.algo.prompt_length
    total = prompt + cfg.algo.response_length
    samples = []
    for index in range(cfg.algo.rollout_batch_size):
        tokens = torch.randint(0, cfg.model.vocab_size, (total,), generator=generator)
        old = -torch.rand(total - prompt, generator=generator) * 5
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=prompt,
                group_id=index,
                advantages=torch.randn((), generator=generator),
                old_log_probs=old,
                rollout_log_probs=old,
            )
        )
    return samples


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA GPU on this machine; nothing to measure (exit 0).")
        return 0
    from megatron_gspo.engine import TrainEngine
    from megatron_gspo.engine.compat import has_transformer_engine
    from megatron_gspo.engine.hf_import_export import export_hf_checkpoint, iter_hf_weights

    cfg = build_config(args)
    engine = TrainEngine(cfg)
    rank, world = engine.parallel.rank, engine.parallel.world_size
    generator = torch.Generator().manual_seed(0)
    samples = random_samples(cfg, generator)
    tokens = sum(int(s.tokens.numel()) - 1 for s in samples)
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        engine.train_step(samples)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    measured = times[2:] or times
    step_s = statistics.median(measured)
    length = args.tokens_per_sample
    flops = 3 * (
        2 * active_matmul_parameters(cfg.model) * tokens
        + len(samples) * cfg.model.num_layers * 2 * length**2 * 128 * 32
    )
    peak = peak_tflops(torch.cuda.get_device_name())
    tflops = flops / step_s / world / 1e12

    torch.cuda.synchronize()
    started = time.perf_counter()
    streamed = sum(
        t.numel() * t.element_size() for _, t in iter_hf_weights(engine.policy_chunks, cfg)
    )
    torch.cuda.synchronize()
    stream_s = time.perf_counter() - started
    result = {
        "device": torch.cuda.get_device_name(),
        "world_size": world,
        "layout": {"tp": args.tp, "ep": args.ep, "dp": engine.parallel.dp},
        "flags": {
            "dtype": "bfloat16",
            "transformer_engine": has_transformer_engine(),
            "recompute": args.recompute,
            "layers": args.layers,
            "experts": args.experts,
            "samples_per_step": args.samples,
            "tokens_per_sample": args.tokens_per_sample,
        },
        "step_time_s": step_s,
        "train_tokens_per_s": tokens / step_s,
        "train_tflops_per_gpu": tflops,
        "mfu": None if peak is None else tflops / peak,
        "weight_stream_s": stream_s,
        "weight_stream_gb": streamed / 1e9,
    }
    if args.export_hf:
        export_hf_checkpoint(engine.policy_chunks, cfg, args.export_hf, overwrite=True)
    if args.sglang_url:
        from megatron_gspo.rollout import sync_weights_paused
        from megatron_gspo.rollout.sglang_client import SGLangEngine

        client = SGLangEngine.from_config(cfg.rollout, cfg.model, urls=[args.sglang_url])
        torch.cuda.synchronize()
        started = time.perf_counter()
        named = iter_hf_weights(engine.policy_chunks, cfg)
        stats = sync_weights_paused(client, named, version=1) if rank == 0 else None
        if rank != 0:
            for _ in named:
                pass
        result["sglang_weight_sync_s"] = time.perf_counter() - started
        result["sglang_weight_sync_buckets"] = None if stats is None else stats.num_buckets
    if rank == 0:
        if args.json:
            print(json.dumps(result))
        else:
            for key, value in result.items():
                print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    sys.exit(main())
