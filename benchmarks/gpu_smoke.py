"""GPU smoke run: the RL loop in bf16 with Transformer Engine and NCCL, tokens/s and MFU.

Runs ``torchrun --standalone --nproc_per_node N -m megatron_gspo.train`` on a preset (the tiny
CPU demo by default) with ``model.dtype=bfloat16`` for a few steps, then reads its
``metrics.jsonl`` and prints, per step and averaged over the steps after the warm-up:

* tokens/s of the training stages (old-log-prob forward + policy update), of the rollout
  (generated tokens), and end to end (one RL step);
* model FLOPs utilisation of the training stages: model FLOPs / time / (peak x GPUs).

Model FLOPs (no recomputation counted, as MFU is defined): a forward over ``T`` tokens costs
``2 * N_active * T`` for the matrix multiplications, where ``N_active`` counts the weights one
token multiplies (attention projections, router, the top-k routed experts and any shared
expert, dense MLPs, output layer; not the embedding lookup), plus causal attention
``2 * s^2 * (heads * head_dim)`` per sequence of length ``s`` and layer (``QK^T`` and ``AV``, half
of the square). Backward costs twice the forward. A step runs one forward (recomputed old
log-probs; one more with a reference model) and ``ppo_epochs`` forward+backward passes over all
samples. Sequence lengths enter through their step means (``prompt_len_mean +
response_len_mean``), which slightly undercounts attention for uneven lengths.

Peak: dense bf16 tensor-core TFLOP/s from the device name (H100 SXM / H200: 989), or
``--peak-tflops``. Without a CUDA GPU the script says so and exits 0, so CI can call it.

    python benchmarks/gpu_smoke.py                      # 1 GPU, cpu_demo preset, 6 steps
    python benchmarks/gpu_smoke.py --nproc 4 -- parallel.tp=2 parallel.ep=2
    python benchmarks/gpu_smoke.py --json               # one JSON summary on stdout
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

PEAK_BF16_TFLOPS = (
    # (substring of torch.cuda.get_device_name(), dense bf16 TFLOP/s), first match wins.
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM5 (e.g. "NVIDIA H100 80GB HBM3")
    ("H800", 989.0),
    ("GH200", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_smoke.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes)")
    parser.add_argument("--steps", type=int, default=6, help="RL steps to run")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="first steps left out of the averages"
    )
    parser.add_argument("--preset", default="cpu_demo", help="preset name or YAML path")
    parser.add_argument("--output-dir", default=None, help="default: a new temporary folder")
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="peak bf16 TFLOP/s per GPU (override)"
    )
    parser.add_argument(
        "--allow-without-te",
        action="store_true",
        help="run even if Transformer Engine is not installed (local Megatron layers)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the run")
    parser.add_argument("--json", action="store_true", help="print one JSON summary only")
    parser.add_argument(
        "overrides", nargs="*", help="trainer overrides after --, e.g. -- parallel.ep=2"
    )
    return parser.parse_args(argv)


def peak_tflops(device_name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return tflops
    return None


def active_matmul_parameters(model) -> int:
    """Weights one token multiplies in a forward (``model``: :class:`~megatron_gspo.config.
    ModelConfig`): the ``N_active`` of ``2 * N_active`` FLOPs per token."""
    hidden = model.hidden_size
    query = model.num_attention_heads * model.head_dim
    key_value = model.num_query_groups * model.head_dim
    attention = hidden * query + 2 * hidden * key_value + query * hidden
    moe_layers = model.num_layers - model.first_k_dense_layers if model.num_experts else 0
    dense_layers = model.num_layers - moe_layers
    routed = model.num_experts * hidden + model.moe_router_topk * 3 * hidden * (
        model.moe_ffn_hidden_size
    )
    shared = model.shared_expert_intermediate_size
    shared = 3 * hidden * shared + (hidden if shared else 0)  # + the shared expert's gate
    return (
        model.num_layers * attention
        + dense_layers * 3 * hidden * model.ffn_hidden_size
        + moe_layers * (routed + shared)
        + hidden * model.vocab_size
    )


def step_flops(record: dict, cfg) -> float:
    """Model FLOPs of the training stages of one RL step (see the module docstring)."""
    num_samples = record["num_samples"]
    length = record["prompt_len_mean"] + record["response_len_mean"]
    tokens = num_samples * length
    attention_width = cfg.model.num_attention_heads * cfg.model.head_dim
    forward = (
        2 * active_matmul_parameters(cfg.model) * tokens
        + num_samples * cfg.model.num_layers * 2 * length**2 * attention_width
    )
    forwards_only = int(cfg.algo.old_log_prob_source == "recompute")
    forwards_only += int(cfg.algo.needs_reference_model)
    return forward * (forwards_only + 3 * cfg.algo.ppo_epochs)


def summarise(records: list[dict], cfg, *, world_size: int, peak: float | None) -> dict:
    rows = []
    for record in records:
        tokens = record["num_samples"] * (record["prompt_len_mean"] + record["response_len_mean"])
        train_s = record["time/update_s"] + record["time/old_log_probs_s"]
        flops = step_flops(record, cfg)
        rows.append(
            {
                "step": record["step"],
                "step_time_s": record["step_time_s"],
                "train_tokens_per_s": tokens / train_s,
                "rollout_tokens_per_s": record["num_samples"]
                * record["response_len_mean"]
                / record["time/rollout_s"],
                "step_tokens_per_s": tokens / record["step_time_s"],
                "train_tflops_per_gpu": flops / train_s / world_size / 1e12,
                "mfu": None if peak is None else flops / train_s / world_size / (peak * 1e12),
            }
        )
    return {"steps": rows}


def mean_after_warmup(rows: list[dict], warmup: int, key: str) -> float | None:
    values = [row[key] for row in rows[warmup:] if row[key] is not None]
    return statistics.fmean(values) if values else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    if not torch.cuda.is_available():
        print(
            f"gpu_smoke: no CUDA GPU on this machine (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}); nothing to measure."
        )
        return 0
    if torch.cuda.device_count() < args.nproc:
        print(
            f"gpu_smoke: --nproc {args.nproc} but only {torch.cuda.device_count()} GPU(s)",
            file=sys.stderr,
        )
        return 1
    has_te = importlib.util.find_spec("transformer_engine") is not None
    if not has_te and not args.allow_without_te:
        print(
            "gpu_smoke: Transformer Engine is not installed, so the run would use Megatron's "
            "local layers: use the project's Docker image, or pass --allow-without-te",
            file=sys.stderr,
        )
        return 1
    import torch.distributed as dist

    device_name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or peak_tflops(device_name)
    output_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="gpu_smoke_"))
    overrides = [
        "model.dtype=bfloat16",
        f"steps={args.steps}",
        "logging.progress_bar=false",
        "checkpoint.interval=0",
        "overwrite_output_dir=true",  # a rerun into --output-dir replaces the smoke run
        f"output_dir={output_dir}",
        *args.overrides,
    ]
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.trainer.setup import resolve_model

    cfg = resolve_model(load_config(args.preset, overrides))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        "-m",
        "megatron_gspo.train",
        "--preset",
        args.preset,
        *overrides,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    log_path = output_dir / "gpu_smoke.log"
    output_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=args.timeout,
        )  # fmt: skip
    if result.returncode:
        print(log_path.read_text(errors="replace")[-8000:], file=sys.stderr)
        print(f"gpu_smoke: the run failed ({result.returncode}); log: {log_path}", file=sys.stderr)
        return result.returncode

    from megatron_gspo.metrics.sinks import read_metrics

    records = read_metrics(str(output_dir))
    summary = summarise(records, cfg, world_size=args.nproc, peak=peak)
    rows = summary["steps"]
    summary.update(
        device=device_name,
        gpus=args.nproc,
        transformer_engine=has_te,
        nccl=dist.is_nccl_available(),
        dtype="bfloat16",
        preset=args.preset,
        overrides=args.overrides,
        active_parameters=active_matmul_parameters(cfg.model),
        peak_tflops_per_gpu=peak,
        warmup_steps=args.warmup_steps,
        output_dir=str(output_dir),
        **{
            f"mean_{key}": mean_after_warmup(rows, args.warmup_steps, key)
            for key in ("train_tokens_per_s", "rollout_tokens_per_s", "step_tokens_per_s", "mfu")
        },
    )
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"{device_name} x {args.nproc}, bf16, Transformer Engine: {has_te}, NCCL: "
        f"{summary['nccl']}; preset {args.preset} {' '.join(args.overrides)}; "
        f"{summary['active_parameters']:,} active matmul parameters; peak "
        f"{peak if peak else 'unknown (pass --peak-tflops)'} TFLOP/s per GPU"
    )
    print(f"{'step':>4} {'step s':>8} {'train tok/s':>12} {'rollout tok/s':>14} {'MFU':>8}")
    for row in rows:
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.3f}%"
        print(
            f"{row['step']:>4} {row['step_time_s']:>8.3f} {row['train_tokens_per_s']:>12,.0f} "
            f"{row['rollout_tokens_per_s']:>14,.0f} {mfu:>8}"
        )
    if summary["mean_train_tokens_per_s"] is None:
        print(f"no step after the {args.warmup_steps} warm-up step(s): raise --steps")
        return 0
    mean_mfu = summary["mean_mfu"]
    print(
        f"mean over steps >= {args.warmup_steps}: train {summary['mean_train_tokens_per_s']:,.0f}"
        f" tokens/s, end to end {summary['mean_step_tokens_per_s']:,.0f} tokens/s, MFU "
        + ("n/a" if mean_mfu is None else f"{100 * mean_mfu:.3f}%")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
