"""Streaming export of HF checkpoints: from a ``torch_dist`` directory (offline, no Megatron) or
from any iterator of full Megatron tensors.

Both paths plan the safetensors layout from shapes alone (the mapping runs on ``meta`` tensors),
then write each HF tensor at its planned place as soon as its Megatron parameter is read, so peak
memory is about one parameter (the largest: the embedding or one expert's fc1), independent of
the number of layers and experts. Output directories appear atomically (written under a temporary
name, then renamed).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from megatron_gspo.config import ModelConfig, from_dict
from megatron_gspo.convert.hf_config import hf_config_dict, model_config_from_hf, read_hf_config
from megatron_gspo.convert.mapping import (
    ConversionError,
    hf_parameter_shapes,
    hf_storage_dtype,
    megatron_parameter_shapes,
    megatron_to_hf,
    parse_megatron_name,
)
from megatron_gspo.convert.safetensors_io import (
    PlannedTensor,
    ShardedSafetensorsWriter,
    atomic_directory,
    copy_side_files,
)
from megatron_gspo.convert.torch_dist import StoredParameter, TorchDistCheckpoint
from megatron_gspo.runtime.checkpoint_files import (
    MARKER,
    complete_checkpoints,
    damaged_files,
    latest_checkpoint,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""5 GB, the shard size of ``save_pretrained`` and of the published Qwen checkpoints."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportSummary:
    """What an export wrote."""

    out_dir: str
    num_tensors: int = 0
    total_bytes: int = 0
    shard_files: list[str] = field(default_factory=list)
    copied_files: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    """Checkpoint tensors that are not model weights (optimizer state, ...)."""


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    if name not in _DTYPES:
        raise ConversionError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return {value: key for key, value in _DTYPES.items()}.get(dtype, "float32")


def check_parameter_set(names: Iterable[str], model: ModelConfig, source: str) -> None:
    """Fail unless ``names`` are exactly the parameters of ``model`` (in any Megatron spelling)."""
    expected = {parse_megatron_name(name) for name in megatron_parameter_shapes(model)}
    found = {}
    for name in names:
        key = parse_megatron_name(name)
        if key in found:
            raise ConversionError(f"{source}: {name!r} and {found[key]!r} are the same parameter")
        found[key] = name
    if model.tie_word_embeddings:
        # With pipeline parallel the last stage keeps its own copy of the tied output layer.
        found.pop(parse_megatron_name("output_layer.weight"), None)
    missing = sorted(str(key) for key in expected - found.keys())
    extra = sorted(found[key] for key in found.keys() - expected)
    if missing or extra:
        raise ConversionError(
            f"{source} does not match the model config ({model.architecture}, "
            f"{model.num_layers} layers, {model.num_experts if model.is_moe else 0} experts): "
            f"{len(missing)} parameters missing (e.g. {missing[:3]}), {len(extra)} unexpected "
            f"(e.g. {extra[:3]}). Pass the config the checkpoint was trained with."
        )


def write_config_files(
    out_dir: str, model: ModelConfig, *, origin_hf: Optional[str], dtype: torch.dtype
) -> list[str]:
    """config.json (both transformers 4 and 5 spellings) and, from ``origin_hf``, the tokenizer
    and generation-config files."""
    base = read_hf_config(origin_hf) if origin_hf else None
    config = hf_config_dict(model, base=base, dtype=_dtype_name(dtype))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    return copy_side_files(origin_hf, out_dir) if origin_hf else []


def convert_torch_dist_to_hf(
    checkpoint_dir: str,
    out_dir: str,
    model: ModelConfig,
    *,
    origin_hf: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
    key_prefix: Optional[str] = None,
) -> ExportSummary:
    """Write the HF checkpoint of a Megatron ``torch_dist`` checkpoint, streaming.

    ``model`` is the architecture the checkpoint was trained with (vocabulary unpadded);
    ``dtype`` (default: the stored dtype) is the output dtype. Reads one parameter at a time; no
    Megatron import, no process group.
    """
    checkpoint = TorchDistCheckpoint(checkpoint_dir, key_prefix=key_prefix)
    parameters, skipped = checkpoint.parameters()
    check_parameter_set([p.name for p in parameters], model, checkpoint_dir)
    if model.tie_word_embeddings:
        parameters = [p for p in parameters if p.name != "output_layer.weight"]

    def out_dtype(stored: Optional[torch.dtype], name: Optional[str] = None) -> torch.dtype:
        if name is not None and parse_megatron_name(name).kind == "router_bias":
            return torch.float32  # GLM-4.5's correction bias (mapping.hf_storage_dtype)
        return dtype or stored or torch.float32

    planned = []
    for parameter in parameters:
        meta = torch.empty(
            parameter.shape, dtype=out_dtype(parameter.dtype, parameter.name), device="meta"
        )
        for name, tensor in megatron_to_hf(parameter.name, meta, model):
            planned.append(PlannedTensor(name, tuple(tensor.shape), tensor.dtype))
    summary = ExportSummary(out_dir=os.path.abspath(out_dir), skipped_keys=skipped)
    with atomic_directory(out_dir, overwrite=overwrite) as temporary:
        with ShardedSafetensorsWriter(temporary, planned, max_shard_bytes) as writer:
            for parameter in parameters:
                _write_parameter(
                    writer, checkpoint, parameter, model, out_dtype(parameter.dtype, parameter.name)
                )
        summary.shard_files = list(writer.file_names)
        stored_dtype = next((p.dtype for p in parameters if p.dtype is not None), torch.float32)
        summary.copied_files = write_config_files(
            temporary, model, origin_hf=origin_hf, dtype=out_dtype(stored_dtype)
        )
    summary.num_tensors = len(planned)
    summary.total_bytes = sum(tensor.nbytes for tensor in planned)
    logger.info(
        "wrote %d tensors (%.2f GB) in %d shards to %s; skipped %d non-model keys",
        summary.num_tensors,
        summary.total_bytes / 1e9,
        len(summary.shard_files),
        out_dir,
        len(skipped),
    )
    return summary


def _write_parameter(
    writer: ShardedSafetensorsWriter,
    checkpoint: TorchDistCheckpoint,
    parameter: StoredParameter,
    model: ModelConfig,
    dtype: torch.dtype,
) -> None:
    # A function of its own so that the parameter and its HF views are freed on return, before
    # the next one is read: peak memory stays at one parameter (plus its stored chunk).
    full = checkpoint.read_parameter(parameter).to(dtype)
    for name, tensor in megatron_to_hf(parameter.name, full, model):
        writer.write(name, tensor)


def save_hf_checkpoint(
    named_hf_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str,
    model: ModelConfig,
    *,
    origin_hf: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: Optional[torch.dtype] = None,
    overwrite: bool = False,
) -> ExportSummary:
    """Write an HF checkpoint from a stream of ``(hf_name, tensor)`` pairs in any order.

    The layout is planned from ``model`` (:func:`hf_parameter_shapes`), so the stream is consumed
    one tensor at a time; a missing, unexpected or misshaped tensor fails the export and leaves no
    output directory.
    """
    dtype = dtype or _DTYPES[model.dtype]
    planned = [
        PlannedTensor(name, shape, hf_storage_dtype(name, dtype))
        for name, shape in hf_parameter_shapes(model).items()
    ]
    summary = ExportSummary(out_dir=os.path.abspath(out_dir))
    with atomic_directory(out_dir, overwrite=overwrite) as temporary:
        with ShardedSafetensorsWriter(temporary, planned, max_shard_bytes) as writer:
            for name, tensor in named_hf_tensors:
                writer.write(name, tensor.to(hf_storage_dtype(name, dtype)))
        summary.shard_files = list(writer.file_names)
        summary.copied_files = write_config_files(
            temporary, model, origin_hf=origin_hf, dtype=dtype
        )
    summary.num_tensors = len(planned)
    summary.total_bytes = sum(tensor.nbytes for tensor in planned)
    return summary


def resolve_checkpoint_dir(path: str) -> str:
    """A torch_dist directory from ``path``: the directory itself (it holds ``.metadata``), or a
    run's checkpoint root (the checkpoint a resume would take: see
    :func:`megatron_gspo.runtime.checkpoint_files.latest_checkpoint`)."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    return latest_checkpoint(path) or path  # read_dcp_metadata explains what is missing


def check_checkpoint_intact(checkpoint_dir: str) -> None:
    """Raise a :class:`ConversionError` naming the damaged files of ``checkpoint_dir`` (a
    truncated shard or index: :func:`~megatron_gspo.runtime.checkpoint_files.damaged_files`)
    and the newest intact checkpoint beside it, as the trainer's resume does, instead of the bare
    ``EOFError`` of PyTorch's reader. A directory without ``.metadata`` is left to the reader,
    whose message says what is missing."""
    if not os.path.isfile(os.path.join(checkpoint_dir, ".metadata")):
        return
    problems = damaged_files(checkpoint_dir)
    if not os.path.isfile(os.path.join(checkpoint_dir, MARKER)):
        # Written by the converter (hf-to-megatron), not published by the trainer: no marker
        # or metadata.json to read, only tensors.
        problems = [problem for problem in problems if "FileNotFoundError" not in problem]
    if not problems:
        return
    root = os.path.dirname(os.path.abspath(checkpoint_dir))
    intact = [
        older
        for _, older in reversed(complete_checkpoints(root))
        if older != checkpoint_dir and not damaged_files(older)
    ]
    fix = (
        f"convert the newest intact checkpoint instead: --ckpt {intact[0]}"
        if intact
        else "restore the files from a copy; no other checkpoint beside it is intact"
    )
    raise ConversionError(f"checkpoint {checkpoint_dir} is damaged: {'; '.join(problems)}. {fix}")


def model_config_for_export(
    *,
    checkpoint_dir: Optional[str] = None,
    origin_hf: Optional[str] = None,
    config_file: Optional[str] = None,
) -> ModelConfig:
    """The model config a checkpoint was trained with, from the first source available:

    1. ``config_file``: YAML/JSON of a ``TrainConfig`` (the run's config) or of its ``model``
       section;
    2. ``checkpoint_dir/checkpoint.json`` (written by this project's ``save_checkpoint``);
    3. ``origin_hf/config.json`` (the HF model training started from).
    """
    section: Any = None
    if config_file:
        data = _load_structured(config_file)
        section = data.get("model", data) if isinstance(data, dict) else data
    elif checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, MARKER)):
        with open(os.path.join(checkpoint_dir, MARKER), encoding="utf-8") as file:
            section = json.load(file).get("model")
    if section is not None:
        model = from_dict(ModelConfig, section, prefix="model.")
        if model.hf_path and os.path.isfile(os.path.join(model.hf_path, "config.json")):
            # Sizes left at their defaults in a config file come from the HF directory.
            return model_config_from_hf(read_hf_config(model.hf_path), model)
        return model
    if origin_hf:
        return model_config_from_hf(read_hf_config(origin_hf))
    raise ConversionError(
        "the model architecture is unknown: the checkpoint has no checkpoint.json; pass "
        "--origin-hf DIR (the HF model training started from) or --config FILE (the run's "
        "config.yaml)"
    )


def _load_structured(path: str) -> Any:
    with open(path, encoding="utf-8") as file:
        text = file.read()
    if path.endswith(".json"):
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)
