"""Convert checkpoints between Hugging Face and Megatron distributed (torch_dist) formats.

Examples::

    # HF -> Megatron, one process (the checkpoint re-shards on load, so the layout here only
    # decides how much memory each process needs)
    python tools/convert_checkpoint.py hf-to-megatron --hf /models/Qwen3-30B-A3B --out ckpt/

    # HF -> Megatron in a sharded layout: each rank reads only its own tensors
    torchrun --nproc_per_node 4 tools/convert_checkpoint.py hf-to-megatron \\
        --hf /models/Qwen3-30B-A3B --out ckpt/ --tp 2 --ep 2

    # Megatron -> HF, offline: no Megatron model, no process group, memory ~ one tensor
    python tools/convert_checkpoint.py megatron-to-hf --ckpt outputs/run/checkpoints/iter_0000100 \\
        --out exported/ --origin-hf /models/Qwen3-30B-A3B

``--ckpt`` is a torch_dist directory or a run's checkpoint root (``<output_dir>/checkpoints``: its
``latest`` step is used). The architecture comes from ``--config`` (YAML/JSON holding a ``model``
section), else the checkpoint's own ``checkpoint.json``, else ``--origin-hf``'s config.json.
``--key-prefix optimizer.state.fp32_param.`` exports the fp32 main weights of a bf16 run instead
of the bf16 model weights.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path

try:
    import megatron_gspo  # noqa: F401
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.config import ConfigError

logger = logging.getLogger("convert_checkpoint")

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9 bytes; also ``MB``, ``GiB``, plain numbers of bytes."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    value = float(match[1]) * _UNITS[(match[2] or "B").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1 byte")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="convert_checkpoint.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    to_megatron = commands.add_parser(
        "hf-to-megatron",
        help="HF safetensors directory -> Megatron torch_dist checkpoint",
        description="Build the policy in the given layout, load the HF weights (each rank reads "
        "only its tensors) and save a Megatron torch_dist checkpoint (weights only). Runs in one "
        "process or under torchrun with world size = tp * pp * dp.",
    )
    to_megatron.add_argument(
        "--hf", required=True, help="HF model directory (config.json, *.safetensors)"
    )
    to_megatron.add_argument("--out", required=True, help="output checkpoint directory (new)")
    to_megatron.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    to_megatron.add_argument("--pp", type=int, default=1, help="pipeline parallel size")
    to_megatron.add_argument("--ep", type=int, default=1, help="expert parallel size")
    to_megatron.add_argument("--etp", type=int, default=1, help="expert tensor parallel size")
    to_megatron.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="parameter dtype of the checkpoint (default: float32 on CPU, bfloat16 on GPU)",
    )
    to_megatron.add_argument("--overwrite", action="store_true", help="replace --out if it exists")

    to_hf = commands.add_parser(
        "megatron-to-hf",
        help="Megatron torch_dist checkpoint -> HF safetensors directory (offline, streaming)",
        description="Read the torch_dist checkpoint one tensor at a time (no Megatron model, no "
        "process group), map to HF names and write safetensors shards with "
        "model.safetensors.index.json and config.json; tokenizer and generation_config.json "
        "are copied from --origin-hf. The output directory appears atomically.",
    )
    to_hf.add_argument(
        "--ckpt",
        required=True,
        help="torch_dist checkpoint directory, or a run's checkpoint root (its latest step)",
    )
    to_hf.add_argument("--out", required=True, help="output HF directory (new)")
    to_hf.add_argument(
        "--origin-hf",
        default=None,
        help="HF directory training started from: architecture, config.json keys and tokenizer",
    )
    to_hf.add_argument(
        "--config",
        default=None,
        help="YAML/JSON with the model config (default: the checkpoint's checkpoint.json, else "
        "--origin-hf's config.json)",
    )
    to_hf.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=parse_size("5GB"),
        help="largest safetensors file (default 5GB; units B, KB, MB, GB, KiB, MiB, GiB)",
    )
    to_hf.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="output dtype (default: the checkpoint's)",
    )
    to_hf.add_argument(
        "--key-prefix",
        default=None,
        help="prefix of the model's tensor keys in the checkpoint (default: detected)",
    )
    to_hf.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    to_hf.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    return parser


def megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_gspo.convert.export import (
        check_checkpoint_intact,
        convert_torch_dist_to_hf,
        model_config_for_export,
        parse_dtype,
        resolve_checkpoint_dir,
    )

    checkpoint = resolve_checkpoint_dir(args.ckpt)
    check_checkpoint_intact(checkpoint)
    model = model_config_for_export(
        checkpoint_dir=checkpoint, origin_hf=args.origin_hf, config_file=args.config
    )
    summary = convert_torch_dist_to_hf(
        checkpoint,
        args.out,
        model,
        origin_hf=args.origin_hf,
        max_shard_bytes=args.max_shard_size,
        dtype=parse_dtype(args.dtype),
        overwrite=args.overwrite,
        key_prefix=args.key_prefix,
    )
    if args.json:
        print(json.dumps(vars(summary), indent=2))
    else:
        print(
            f"wrote {summary.num_tensors} tensors ({summary.total_bytes / 1e9:.3f} GB) in "
            f"{len(summary.shard_files)} shards to {summary.out_dir}"
        )
    return 0


def hf_to_megatron(args: argparse.Namespace) -> int:
    import shutil

    from megatron_gspo.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_gspo.convert.hf_config import resolve_model_config
    from megatron_gspo.convert.mapping import ConversionError

    rank = int(os.environ.get("RANK", "0"))
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not args.overwrite:
        raise ConversionError(f"{out} already exists; choose a new directory or pass --overwrite")
    dtype = args.dtype
    if dtype is None:
        import torch

        dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    model = resolve_model_config(ModelConfig(hf_path=args.hf, dtype=dtype))
    parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
    cfg = TrainConfig(model=model, parallel=parallel)

    from megatron_gspo.engine.hf_import_export import save_hf_weights_as_torch_dist
    from megatron_gspo.engine.parallel import destroy_parallel

    # Written under a temporary name and renamed by rank 0 once every rank has finished.
    temporary = f"{out}.tmp-convert"
    if rank == 0 and os.path.exists(temporary):
        shutil.rmtree(temporary)
    try:
        save_hf_weights_as_torch_dist(cfg, args.hf, temporary)
        if rank == 0:
            if os.path.exists(out):
                shutil.rmtree(out)
            os.rename(temporary, out)
            layout = f"tp {args.tp}, pp {args.pp}, ep {args.ep}, etp {args.etp}"
            print(f"wrote Megatron torch_dist checkpoint {out} ({layout})")
    except BaseException:
        if rank == 0:
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    finally:
        destroy_parallel()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from megatron_gspo.convert.mapping import ConversionError

    try:
        if args.command == "megatron-to-hf":
            return megatron_to_hf(args)
        return hf_to_megatron(args)
    except (ConfigError, ConversionError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
