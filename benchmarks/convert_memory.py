"""Peak memory of the offline ``megatron-to-hf`` conversion against checkpoint size.

Writes synthetic Megatron ``torch_dist`` checkpoints of a scaled Qwen3-MoE shape (random bf16 or
fp32 weights, Megatron-Core 0.16's key layout: per-layer keys, experts stacked on an expert axis
and stored one chunk per expert and gate/up half, norms under their TE names), then runs
``tools/convert_checkpoint.py megatron-to-hf`` in a fresh process per checkpoint and reports the
converter's peak resident memory (``VmHWM`` of the child process, Linux). Streaming means the
peak should be a constant (interpreter + torch + transformers) plus about one parameter,
independent of the checkpoint size.

    python benchmarks/convert_memory.py                      # 0.8 GB and 2.3 GB bf16 checkpoints
    python benchmarks/convert_memory.py --layers 4 24 --json # choose sizes, machine-readable

The checkpoint writer produces exactly the format of ``torch.distributed.checkpoint``'s
``FileSystemWriter`` (each chunk ``torch.save``d at a recorded byte range, a pickled
``Metadata``) but one chunk at a time, so a checkpoint larger than memory can be generated.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_gspo.config import ModelConfig  # noqa: E402
from megatron_gspo.convert.mapping import megatron_parameter_shapes  # noqa: E402


def scaled_qwen3_moe(num_layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's vocabulary, attention and router shapes at half width and 64 experts.

    Qwen3-30B-A3B: hidden 2048, 32 heads / 4 kv heads of 128, 128 experts of 768, vocab 151936.
    """
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=151_936,
        hidden_size=1024,
        num_layers=num_layers,
        num_attention_heads=16,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=3072,
        num_experts=64,
        moe_ffn_hidden_size=512,
        moe_router_topk=8,
    )


def _megatron_keys(model: ModelConfig) -> list[tuple[str, tuple[int, ...], list]]:
    """``(key, global shape, chunks)`` as Megatron-Core 0.16 saves a model with
    ``moe_layer_freq`` given as a list (per-layer keys; experts on a leading expert axis)."""
    entries = []
    te_names = megatron_parameter_shapes(model, style="te")
    experts: dict[str, list] = {}
    for name, shape in te_names.items():
        if ".mlp.experts.linear_fc" in name:
            # decoder.layers.L.mlp.experts.linear_fc1.weightE -> stacked key with expert axis
            head, _, tail = name.rpartition(".weight")
            key = head.replace(".mlp.experts.", ".mlp.experts.experts.") + ".weight"
            experts.setdefault(key, []).append((int(tail), shape))
            continue
        if name.endswith("pre_mlp_layernorm.weight"):
            name = name.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        chunks = [((0,) * len(shape), shape)]
        if name.endswith("linear_fc1.weight"):
            half = shape[0] // 2
            chunks = [((0, 0), (half, shape[1])), ((half, 0), (half, shape[1]))]
        entries.append((name, shape, chunks))
    for key, per_expert in experts.items():
        shape = per_expert[0][1]
        count = len(per_expert)
        chunks = []
        for expert, _ in sorted(per_expert):
            if key.endswith("linear_fc1.weight"):
                half = shape[0] // 2
                chunks += [
                    ((expert, 0, 0), (1, half, shape[1])),
                    ((expert, half, 0), (1, half, shape[1])),
                ]
            else:
                chunks.append(((expert, 0, 0), (1, *shape)))
        entries.append((key, (count, *shape), chunks))
    return entries


def write_synthetic_checkpoint(
    directory: Path, model: ModelConfig, dtype: torch.dtype, *, seed: int = 0, num_files: int = 4
) -> int:
    """Write a random ``torch_dist`` checkpoint of ``model``; return its data bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    state_dict_metadata, storage_data = {}, {}
    files = [open(directory / f"__{i}_0.distcp", "wb") for i in range(num_files)]  # noqa: SIM115
    total = 0
    try:
        for index, (key, shape, chunks) in enumerate(_megatron_keys(model)):
            chunk_metadata = []
            for offsets, sizes in chunks:
                tensor = torch.empty(sizes, dtype=torch.float32).normal_(generator=generator)
                tensor = tensor.mul_(0.02).to(dtype)
                buffer = io.BytesIO()
                torch.save(tensor, buffer)
                file_index = index % num_files
                file = files[file_index]
                offset = file.tell()
                file.write(buffer.getbuffer())
                storage_data[MetadataIndex(key, torch.Size(offsets))] = _StorageInfo(
                    relative_path=f"__{file_index}_0.distcp",
                    offset=offset,
                    length=file.tell() - offset,
                )
                chunk_metadata.append(
                    ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                )
                total += tensor.numel() * tensor.element_size()
            state_dict_metadata[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(shape),
                chunks=chunk_metadata,
            )
    finally:
        for file in files:
            file.close()
    metadata = Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data)
    with open(directory / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    (directory / "metadata.json").write_text(
        json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1})
    )
    return total


# Runs the CLI in-process and reports the high-water mark of its own address space. Not
# getrusage: a child started by vfork/exec inherits the parent's RSS high-water mark in ru_maxrss
# (Linux folds the pre-exec memory into it), which here would report the generator's memory.
_MEASURED_CLI = """
import runpy, sys
cli, report = sys.argv[1], sys.argv[2]
sys.argv = [cli, *sys.argv[3:]]
try:
    runpy.run_path(cli, run_name="__main__")
except SystemExit as exit:
    if exit.code:
        raise
with open("/proc/self/status") as status:
    peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
with open(report, "w") as file:
    file.write(str(peak_kib * 1024))
"""


def run_conversion(checkpoint: Path, config_file: Path, out: Path) -> tuple[float, int]:
    """Run the CLI in a fresh process; return (seconds, peak resident bytes of that process)."""
    report = out.with_suffix(".peak")
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-c",
            _MEASURED_CLI,
            str(REPO_ROOT / "tools" / "convert_checkpoint.py"),
            str(report),
            "megatron-to-hf",
            "--ckpt",
            str(checkpoint),
            "--out",
            str(out),
            "--config",
            str(config_file),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    peak = int(report.read_text())
    report.unlink()
    return seconds, peak


def largest_parameter_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return max(
        element * int(torch.Size(shape).numel())
        for shape in megatron_parameter_shapes(model).values()
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=[1, 8],
        help="decoder layers of each synthetic checkpoint (size grows linearly)",
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints and exports")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="convert_memory_"))
    results = []
    # Layers 0: the tiny CPU-demo model, i.e. the fixed cost (interpreter, torch, transformers).
    try:
        for num_layers in [0, *args.layers]:
            model = scaled_qwen3_moe(num_layers) if num_layers else ModelConfig()
            checkpoint = workdir / f"ckpt_{num_layers}l"
            data_bytes = write_synthetic_checkpoint(checkpoint, model, dtype)
            config_file = workdir / f"model_{num_layers}l.json"
            config_file.write_text(json.dumps({"model": vars(model)}))
            out = workdir / f"hf_{num_layers}l"
            seconds, peak = run_conversion(checkpoint, config_file, out)
            results.append(
                {
                    "model": "tiny demo (fixed cost)" if num_layers == 0 else "scaled Qwen3-MoE",
                    "layers": num_layers,
                    "dtype": args.dtype,
                    "checkpoint_gb": data_bytes / 1e9,
                    "largest_parameter_mb": largest_parameter_bytes(model, dtype) / 1e6,
                    "peak_rss_mb": peak / 1e6,
                    "seconds": seconds,
                    "throughput_gb_s": data_bytes / 1e9 / seconds,
                }
            )
            if not args.keep:
                shutil.rmtree(checkpoint)
                shutil.rmtree(out)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{'model':<24} {'layers':>6} {'ckpt GB':>8} {'largest param MB':>17} {'peak RSS MB':>12} "
        f"{'s':>6} {'GB/s':>6}"
    )
    for row in results:
        print(
            f"{row['model']:<24} {row['layers']:>6} {row['checkpoint_gb']:>8.2f} "
            f"{row['largest_parameter_mb']:>17.0f} {row['peak_rss_mb']:>12.0f} "
            f"{row['seconds']:>6.1f} {row['throughput_gb_s']:>6.2f}"
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
