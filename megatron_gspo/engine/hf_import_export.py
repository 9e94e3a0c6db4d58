"""Hugging Face weights in and out of a sharded Megatron policy.

* :func:`load_hf_weights`: each rank reads, from the safetensors files (lazily, tensor by tensor),
  only the HF tensors of the parameters it holds, builds their full one-process tensors with
  :mod:`megatron_gspo.convert.mapping` and keeps its shard (:func:`~megatron_gspo.engine.sharding.
  shard_full_tensor`). No communication.
* :func:`iter_hf_weights`: streams ``(hf_name, full tensor)`` for the whole model, one parameter at
  a time: the holders of a parameter gather it over tensor / expert-tensor parallel, its owner
  sends it to the destination rank(s). Used for weight sync and export.
* :func:`export_hf_checkpoint`: an HF directory written from a live model (streamed to rank 0).
* :func:`save_hf_weights_as_torch_dist`: the ``hf-to-megatron`` conversion (Megatron distributed
  checkpoint of HF weights, in any layout).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.distributed as dist

from megatron_gspo.config import ModelConfig, TrainConfig
from megatron_gspo.convert.export import DEFAULT_MAX_SHARD_BYTES, save_hf_checkpoint
from megatron_gspo.convert.hf_config import model_config_from_hf, read_hf_config
from megatron_gspo.convert.mapping import (
    ConversionError,
    hf_import_names_for,
    hf_parameter_shapes,
    megatron_from_hf,
    megatron_to_hf,
    parameter_sort_key,
)
from megatron_gspo.convert.safetensors_io import HFCheckpointReader
from megatron_gspo.engine.model import build_policy_model
from megatron_gspo.engine.parallel import initialize_parallel
from megatron_gspo.engine.sharding import (
    REPLICATED,
    ShardInfo,
    gather_full_tensor,
    iter_global_parameters,
    shard_full_tensor,
)
from megatron_gspo.weight_sync import StableTensorStream

if TYPE_CHECKING:
    from megatron_gspo.convert.export import ExportSummary

logger = logging.getLogger(__name__)


def _model_config(config: Union[TrainConfig, ModelConfig]) -> ModelConfig:
    return config.model if isinstance(config, TrainConfig) else config


@dataclass
class HFLoadReport:
    """What :func:`load_hf_weights` did on this rank."""

    hf_dir: str
    num_parameters: int = 0
    hf_tensors_read: int = 0
    unused_hf_tensors: list[str] = field(default_factory=list)
    """Tensors of the HF directory that no parameter of the model maps to (all ranks agree)."""


def check_hf_directory(hf_dir: str, model: ModelConfig, reader: HFCheckpointReader) -> list[str]:
    """Fail if ``hf_dir``'s config.json or tensors do not match ``model``; return the tensors of
    the directory the model does not use (for example ``lm_head.weight`` next to tied
    embeddings)."""
    model_config_from_hf(read_hf_config(hf_dir), model)  # raises ConfigError on disagreement
    expected = hf_parameter_shapes(model)
    missing = [name for name in expected if name not in reader]
    if missing:
        raise ConversionError(
            f"{hf_dir} lacks {len(missing)} tensors of a {model.architecture} model with this "
            f"config, e.g. {missing[:3]}; the directory is incomplete or holds another model"
        )
    for name, shape in expected.items():
        if reader.shape(name) != shape:
            raise ConversionError(
                f"{hf_dir}: {name} has shape {reader.shape(name)}, expected {shape} from "
                "config.json; the weights and config.json disagree"
            )
    return sorted(set(reader.names()) - set(expected))


@torch.no_grad()
def load_hf_weights(
    model_chunks: Sequence[torch.nn.Module],
    hf_dir: str,
    config: Union[TrainConfig, ModelConfig],
) -> HFLoadReport:
    """Set every parameter of this rank's chunks from the HF checkpoint in ``hf_dir``.

    ``config`` is the run's :class:`TrainConfig` (or its ``model`` section), already completed
    from ``hf_dir``'s config.json (:func:`~megatron_gspo.convert.hf_config.resolve_model_config`);
    a disagreement between the two raises :class:`~megatron_gspo.config.ConfigError`. Each rank
    reads only the HF tensors of its own parameters (embedding rows, its layers, its experts), so
    ranks need no communication; a tensor's bytes are read once per rank that holds a part of it.
    """
    model = _model_config(config)
    report = HFLoadReport(hf_dir=hf_dir)
    with HFCheckpointReader(hf_dir) as reader:
        report.unused_hf_tensors = check_hf_directory(hf_dir, model, reader)
        for global_name, param, info in iter_global_parameters(model_chunks, buffers=True):
            full = megatron_from_hf(global_name, reader.get, model, full_shape=info.full_shape)
            local = shard_full_tensor(full, info)
            if local.shape != param.shape:
                raise RuntimeError(
                    f"{global_name}: the shard of the HF tensor has shape {tuple(local.shape)}, "
                    f"the parameter {tuple(param.shape)}"
                )
            param.copy_(local.to(dtype=param.dtype, device=param.device))
            report.num_parameters += 1
            report.hf_tensors_read += len(hf_import_names_for(global_name, model))
    logger.info(
        "loaded %d parameters from %s (%d HF tensors read on this rank)",
        report.num_parameters,
        hf_dir,
        report.hf_tensors_read,
    )
    if report.unused_hf_tensors:
        logger.warning(
            "%d tensors of %s are not used by the model: %s",
            len(report.unused_hf_tensors),
            hf_dir,
            ", ".join(report.unused_hf_tensors[:5]),
        )
    return report


# ---------------------------------------------------------------------------------------------
# Streaming out
# ---------------------------------------------------------------------------------------------


@dataclass
class _Holding:
    name: str
    param: torch.nn.Parameter
    info: ShardInfo


def _param_device(model_chunks: Sequence[torch.nn.Module]) -> torch.device:
    for chunk in model_chunks:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


def _whole_parameter(param: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The full tensor of a parameter this rank holds whole, as a view (vocab padding dropped)."""
    full = param.detach()
    return full[: full.shape[0] - info.padded_rows] if info.padded_rows else full


@torch.no_grad()
def iter_full_megatron_weights(
    model_chunks: Sequence[torch.nn.Module], *, dst: Optional[int] = 0, copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global_name, full tensor)`` for every parameter of the whole model, one at a time
    (with the routers' ``expert_bias`` buffers: GLM-4.5's correction bias, a checkpoint tensor).

    A collective: every rank of the world must call it and exhaust the iterator. For each
    parameter (in layer order, experts by index) the ranks that hold it gather it over tensor or
    expert-tensor parallel (only the group of its lowest-ranked holder), then that owner sends it
    to rank ``dst``, or broadcasts it to every rank when ``dst`` is None. Ranks other than the
    destination yield nothing. Tensors keep the parameters' dtype and device.

    ``copy=False``: a parameter the destination holds whole (replicated, or not split at this
    layout, e.g. everything at tp = 1) comes as a view of the live parameter instead of a clone,
    valid until the parameters next change (an optimizer step, a load): the caller must consume
    it (copy, serialise, write) before then. Gathered or received tensors are fresh either way.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    held: dict[str, _Holding] = {}
    for name, param, info in iter_global_parameters(model_chunks, buffers=True):
        if not info.tied_copy:
            held[name] = _Holding(name, param, info)
    local_table = {h.name: (h.info.full_shape, h.param.dtype) for h in held.values()}
    tables: list = [None] * world
    if world > 1:
        dist.all_gather_object(tables, local_table)
    else:
        tables = [local_table]
    holders: dict[str, list[int]] = {}
    metadata: dict[str, tuple] = {}
    for holder_rank, table in enumerate(tables):
        for name, meta in table.items():
            holders.setdefault(name, []).append(holder_rank)
            metadata[name] = meta
    device = _param_device(model_chunks)
    for name in sorted(holders, key=parameter_sort_key):
        owner = min(holders[name])
        full: Optional[torch.Tensor] = None
        holding = held.get(name)
        if holding is not None:
            info = holding.info
            group_ranks = (
                [rank]
                if info.kind == REPLICATED or info.group is None
                else dist.get_process_group_ranks(info.group)
            )
            if owner in group_ranks:
                whole = info.kind == REPLICATED or info.world == 1
                full = (
                    _whole_parameter(holding.param, info)
                    if whole and not copy
                    else gather_full_tensor(holding.param, info)
                )
        if world > 1 and (dst is None or owner != dst):
            shape, dtype = metadata[name]
            if full is None:
                full = torch.empty(shape, dtype=dtype, device=device)
            if dst is None:
                dist.broadcast(full, src=owner)
            elif rank == owner:
                dist.send(full.contiguous(), dst=dst)
            elif rank == dst:
                dist.recv(full, src=owner)
        if dst is None or rank == dst:
            yield name, full


def iter_hf_weights(
    model_chunks: Sequence[torch.nn.Module],
    config: Union[TrainConfig, ModelConfig],
    *,
    dst: Optional[int] = 0,
) -> StableTensorStream:
    """``(hf_name, tensor)`` of the whole model in HF on-disk naming, streamed one Megatron
    parameter at a time (see :func:`iter_full_megatron_weights` for the collective contract:
    every rank must exhaust it; only ``dst``, or every rank when ``dst`` is None, receives).

    Vocabulary padding is dropped; a tied output layer is not emitted; q/k/v and gate/up are
    split back into HF's separate tensors (views of the full tensor).

    No copies: a parameter the destination holds whole (all of them at tp = 1) is yielded as a
    view of the live parameter (``copy=False`` above), so a weight sync moves each byte once, into
    the receiver, instead of cloning it first (at Qwen3's vocabulary the embedding and output
    layer alone are 2 x 39 MB per fp32 clone). A yielded tensor is valid until the trainer's
    parameters next change: consume it before the next optimizer step or load. Every consumer
    does so within one call, during which nothing updates the parameters: a weight sync
    (``Driver.sync_weights`` -> ``RolloutEngine.sync_weights``: the embedded engine holds the
    tensors until its all-or-nothing commit copies them in, SGLang's transports write or serialise
    them), the HF export
    (:func:`export_hf_checkpoint` writes it). Clone what you keep longer.

    Returned as a :class:`~megatron_gspo.weight_sync.StableTensorStream`: no tensor is
    reused or changed while the stream is drained (gathered ones are fresh per parameter), so a
    receiver may hold references until its load returns instead of staging copies.
    """
    model = _model_config(config)
    full_tensors = iter_full_megatron_weights(model_chunks, dst=dst, copy=False)
    return StableTensorStream(
        pair for name, full in full_tensors for pair in megatron_to_hf(name, full, model)
    )


# ---------------------------------------------------------------------------------------------
# hf-to-megatron
# ---------------------------------------------------------------------------------------------


def save_torch_dist_weights(model_chunks: Sequence[torch.nn.Module], out_dir: str) -> None:
    """Save the weights of ``model_chunks`` as a Megatron ``torch_dist`` checkpoint (a collective).

    Model state only (no optimizer), keyed ``model`` (``model0``, ``model1``, ... per virtual
    stage) like Megatron-LM; the tensor keys are Megatron's sharded keys, so the checkpoint loads
    in any layout and :mod:`megatron_gspo.convert.torch_dist` reads it without Megatron.
    """
    from megatron.core import dist_checkpointing

    sharded = {}
    for index, chunk in enumerate(model_chunks):
        key = "model" if len(model_chunks) == 1 else f"model{index}"
        sharded[key] = _unwrap(chunk).sharded_state_dict()
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(sharded, out_dir)
    if dist.is_initialized():
        dist.barrier()


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def save_hf_weights_as_torch_dist(cfg: TrainConfig, hf_dir: str, out_dir: str) -> HFLoadReport:
    """``hf-to-megatron``: build the policy in ``cfg.parallel``'s layout, load ``hf_dir`` into
    it and save a Megatron ``torch_dist`` checkpoint in ``out_dir`` (a collective; one process or
    torchrun). ``cfg.model`` must already be completed from ``hf_dir`` (``resolve_model_config``).
    """
    state = initialize_parallel(cfg.parallel, cfg.seed)
    chunks = build_policy_model(cfg, state, routing_replay=False)
    report = load_hf_weights(chunks, hf_dir, cfg)
    save_torch_dist_weights(chunks, out_dir)
    return report


def export_hf_checkpoint(
    model_chunks: Sequence[torch.nn.Module],
    config: Union[TrainConfig, ModelConfig],
    out_dir: str,
    *,
    origin_hf: Optional[str] = None,
    max_shard_bytes: Optional[int] = None,
    overwrite: bool = False,
) -> Optional[ExportSummary]:
    """Write the HF checkpoint of a live (sharded) model to ``out_dir`` from rank 0.

    A collective: every rank calls it; the weights stream to rank 0 one parameter at a time
    (:func:`iter_hf_weights`), which writes safetensors shards, ``config.json`` and, from
    ``origin_hf``, the tokenizer files (atomically). Returns the summary on rank 0, None elsewhere.
    """
    model = _model_config(config)
    stream = iter_hf_weights(model_chunks, model, dst=0)
    rank = dist.get_rank() if dist.is_initialized() else 0
    summary = None
    if rank == 0:
        dtype = next(iter(model_chunks[0].parameters())).dtype
        summary = save_hf_checkpoint(
            stream,
            out_dir,
            model,
            origin_hf=origin_hf,
            max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
            dtype=dtype,
            overwrite=overwrite,
        )
    else:
        for _ in stream:
            pass
    return summary
