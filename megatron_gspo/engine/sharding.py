"""Local Megatron parameters <-> FULL one-process tensors, and seed-determined initialisation.

Every parameter of a :class:`~megatron_gspo.engine.model.PolicyModel` chunk has a *global name*:
its name in a one-process, non-virtual model of the same architecture and layer spec. The
layer index carries the pipeline / virtual-pipeline offset and the expert index the
expert-parallel offset, e.g. ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``
(Transformer Engine grouped experts: ``decoder.layers.3.mlp.experts.linear_fc1.weight5``).

Split rules (``world`` = size of the tensor-parallel group of the parameter: tp for dense
parameters, expert-tp for routed experts; rank ``r``):

==========================================  =====================================================
parameter                                   local part of the full tensor
==========================================  =====================================================
``embedding.word_embeddings.weight``,       rows ``[r V_p / world, (r + 1) V_p / world)`` of the
``output_layer.weight``                     vocab padded to ``V_p`` (a multiple of tp); the full
                                            tensor has the unpadded ``V`` rows
``linear_qkv.weight`` / ``.bias``           contiguous dim-0 chunk of the group-interleaved
                                            ``[(H/G + 2) d G, h]`` tensor (whole query groups)
SwiGLU ``linear_fc1.weight`` (dense,        ``cat(gate_chunk_r, up_chunk_r)``: the full tensor is
shared and routed experts)                  ``cat(gate [F, h], up [F, h])`` and each half is
                                            chunked separately
``linear_proj.weight``, ``linear_fc2``      dim-1 chunk (row parallel)
norms, router, shared-expert gate           replicated (sequence parallel: same value on every
                                            tp rank, gradients summed by ``finalize_model_grads``)
==========================================  =====================================================

With tied embeddings and pp > 1 the last stage's ``output_layer.weight`` is a copy of the
embedding: it is reported under ``embedding.word_embeddings.weight`` with ``tied_copy=True``.

:func:`initialize_weights_from_seed` draws each FULL tensor from a generator seeded by
``(seed, global_name)`` (per expert, so a rank draws only the experts it holds) and keeps its
shard, so one seed gives the same model in every layout.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

REPLICATED, SPLIT, GATED_SPLIT = "replicated", "split", "gated_split"


@dataclass(frozen=True)
class ShardInfo:
    """How a local parameter relates to its full one-process tensor."""

    global_name: str
    kind: str
    """``replicated``, ``split`` (plain chunk along ``dim``) or ``gated_split`` (SwiGLU fc1)."""
    dim: Optional[int]
    full_shape: tuple[int, ...]
    """Shape of the full tensor (unpadded vocab)."""
    group: Optional[dist.ProcessGroup]
    """Group the tensor is split over (tp, or expert-tp for routed experts); None if replicated."""
    world: int
    rank: int
    padded_rows: int = 0
    """Vocab padding rows appended to the full tensor before splitting (embedding, output)."""
    is_expert: bool = False
    """Routed expert parameter (held by one expert-parallel rank; reduced over expert-dp)."""
    layer: Optional[int] = None
    """Global decoder layer index, or None."""
    expert: Optional[int] = None
    """Global expert index, or None."""
    tied_copy: bool = False
    """The last stage's copy of tied embeddings (skip it when collecting unique tensors)."""


# Suffix rules after ``decoder.layers.N.`` (or at top level): (pattern, kind, dim, expert).
_RULES: list[tuple[re.Pattern, str, Optional[int], bool]] = [
    (re.compile(p), kind, dim, expert)
    for p, kind, dim, expert in [
        (r"^embedding\.word_embeddings\.weight$", SPLIT, 0, False),
        (r"^output_layer\.weight$", SPLIT, 0, False),
        (r"^decoder\.final_layernorm\.(weight|bias)$", REPLICATED, None, False),
        (r"^(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$", REPLICATED, None, False),
        (r"^self_attention\.linear_qkv\.(weight|bias)$", SPLIT, 0, False),
        (r"^self_attention\.linear_qkv\.layer_norm_(weight|bias)$", REPLICATED, None, False),
        (r"^self_attention\.(q_layernorm|k_layernorm)\.(weight|bias)$", REPLICATED, None, False),
        # DeepSeek-V3's multi-head latent attention: every projection but linear_proj is column
        # parallel in the local spec (the down projections' outputs are gathered before the
        # latent norms, which are replicated; TE fuses them into the up projections).
        (
            r"^self_attention\.linear_(q_proj|q_down_proj|q_up_proj|kv_down_proj|kv_up_proj)"
            r"\.weight$",
            SPLIT,
            0,
            False,
        ),
        (r"^self_attention\.kv_layernorm\.(weight|bias)$", REPLICATED, None, False),
        (
            r"^self_attention\.linear_(q_up_proj|kv_up_proj)\.layer_norm_(weight|bias)$",
            REPLICATED,
            None,
            False,
        ),
        (r"^self_attention\.linear_proj\.weight$", SPLIT, 1, False),
        (r"^self_attention\.linear_proj\.bias$", REPLICATED, None, False),
        (r"^mlp\.linear_fc1\.layer_norm_(weight|bias)$", REPLICATED, None, False),
        (r"^mlp\.(shared_experts\.)?linear_fc1\.(weight|bias)$", GATED_SPLIT, 0, False),
        (r"^mlp\.(shared_experts\.)?linear_fc2\.weight$", SPLIT, 1, False),
        (r"^mlp\.(shared_experts\.)?linear_fc2\.bias$", REPLICATED, None, False),
        (r"^mlp\.shared_experts\.gate_weight$", REPLICATED, None, False),
        (r"^mlp\.router\.(weight|bias)$", REPLICATED, None, False),
        # GLM-4.5's score-correction bias: a buffer, converted with the weights (buffers=True).
        (r"^mlp\.router\.expert_bias$", REPLICATED, None, False),
        (r"^mlp\.experts\.local_experts\.\d+\.linear_fc1\.(weight|bias)$", GATED_SPLIT, 0, True),
        (r"^mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight$", SPLIT, 1, True),
        (r"^mlp\.experts\.linear_fc1\.(weight|bias)\d+$", GATED_SPLIT, 0, True),
        (r"^mlp\.experts\.linear_fc2\.weight\d+$", SPLIT, 1, True),
    ]
]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_LOCAL_EXPERT = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT = re.compile(r"^(mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


@functools.lru_cache(maxsize=65536)
def _rule_for(suffix: str) -> Optional[tuple[str, Optional[int], bool]]:
    """``(kind, dim, is_expert)`` of the first rule matching ``suffix`` (remembered: a pure
    function of the name, asked again for every parameter at every weight sync)."""
    for pattern, kind, dim, expert in _RULES:
        if pattern.match(suffix):
            return kind, dim, expert
    return None


def _classify(suffix: str, local_name: str) -> tuple[str, Optional[int], bool]:
    rule = _rule_for(suffix)
    if rule is not None:
        return rule
    raise ValueError(
        f"parameter {local_name!r} has no sharding rule in megatron_gspo.engine.sharding; add one "
        "to _RULES (its tensor-parallel split decides how it is gathered and initialised)"
    )


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _split_group(is_expert: bool) -> tuple[dist.ProcessGroup, int, int]:
    if is_expert:
        return (
            parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )
    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_tensor_model_parallel_rank(),
    )


def _named_tensors(model: torch.nn.Module, buffers: bool) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    if buffers:
        for name, buffer in model.named_buffers():
            if name.endswith("mlp.router.expert_bias"):
                yield name, buffer


def iter_global_parameters(
    model_chunks: Sequence[torch.nn.Module], *, buffers: bool = False
) -> Iterator[tuple[str, torch.nn.Parameter, ShardInfo]]:
    """``(global_name, local_param, ShardInfo)`` for every parameter of this rank's chunks (DDP
    wrappers are unwrapped), in chunk then module order.

    ``buffers=True`` adds the buffers that a Hugging Face checkpoint stores as tensors of their
    own: the routers' ``expert_bias`` (GLM-4.5's ``e_score_correction_bias``), replicated, after
    the parameters. Weight import, export and sync ask for them; the optimizer, gradient and
    initialisation paths do not (a buffer has no gradient)."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    # The groups are the same for every parameter of one kind: looked up once per call.
    split_groups: dict[bool, tuple[dist.ProcessGroup, int, int]] = {}
    for chunk in model_chunks:
        model = _unwrap(chunk)
        vocab = getattr(model, "unpadded_vocab_size", None)
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        decoder = getattr(model, "decoder", None)
        # A list, not the ModuleList: its indexing walks the modules on every access.
        layers = list(decoder.layers) if decoder is not None else []
        for local_name, param in _named_tensors(model, buffers):
            layer = None
            suffix = local_name
            match = _LAYER.match(local_name)
            if match:
                layer_module = layers[int(match.group(1))]
                layer = layer_module.layer_number - 1
                suffix = match.group(2)
            kind, dim, is_expert = _classify(suffix, local_name)
            expert = None
            if is_expert:
                num_local = layer_module.mlp.experts.num_local_experts
                local_match = _LOCAL_EXPERT.match(suffix) or _GROUPED_EXPERT.match(suffix)
                expert = ep_rank * num_local + int(local_match.group(2))
                if _LOCAL_EXPERT.match(suffix):
                    suffix = f"{local_match.group(1)}{expert}{local_match.group(3)}"
                else:
                    suffix = f"{local_match.group(1)}{expert}"
            global_name = suffix if layer is None else f"decoder.layers.{layer}.{suffix}"
            tied_copy = tied and global_name == "output_layer.weight"
            if tied_copy:
                global_name = "embedding.word_embeddings.weight"
            if kind == REPLICATED:
                group, world, rank = None, 1, 0
            else:
                if is_expert not in split_groups:
                    split_groups[is_expert] = _split_group(is_expert)
                group, world, rank = split_groups[is_expert]
            full_shape = list(param.shape)
            if kind != REPLICATED:
                full_shape[dim] *= world
            padded_rows = 0
            if global_name == "embedding.word_embeddings.weight" or suffix == "output_layer.weight":
                padded_rows = full_shape[0] - vocab
                full_shape[0] = vocab
            yield (
                global_name,
                param,
                ShardInfo(
                    global_name=global_name,
                    kind=kind,
                    dim=dim,
                    full_shape=tuple(full_shape),
                    group=group if world > 1 else None,
                    world=world,
                    rank=rank,
                    padded_rows=padded_rows,
                    is_expert=is_expert,
                    layer=layer,
                    expert=expert,
                    tied_copy=tied_copy,
                ),
            )


def annotate_tensor_parallel_attributes(model_chunks: Sequence[torch.nn.Module]) -> None:
    """Set Megatron's ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` on
    split parameters where Megatron left them unset, and ``allreduce=False`` (expert parallel)
    on every routed-expert parameter. Call before wrapping in DDP.

    Megatron sets them only inside its own weight initialisation, which we skip
    (``perform_initialization=False``); without them the grad-norm would count each split
    parameter on one tp rank only (``param_is_not_tensor_parallel_duplicate``).
    """
    for _, param, info in iter_global_parameters(model_chunks):
        if info.is_expert:
            # Megatron marks routed experts as expert-parallel (reduced over expert-dp) only when
            # ep > 1. With ep = 1 and expert-tp < tp, each tensor rank trains the same expert on
            # its own sequence-parallel tokens, and only the expert-dp reduction sums them.
            param.allreduce = False
        if info.kind == REPLICATED or hasattr(param, "tensor_model_parallel"):
            continue
        param.tensor_model_parallel = True
        param.partition_dim = info.dim
        param.partition_stride = 1


# ---------------------------------------------------------------------------------------------
# Full <-> local
# ---------------------------------------------------------------------------------------------


def shard_full_tensor(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's part of the full one-process tensor (a new tensor, same dtype/device)."""
    if tuple(full.shape) != info.full_shape:
        raise ValueError(
            f"{info.global_name}: full tensor has shape {tuple(full.shape)}, expected "
            f"{info.full_shape}"
        )
    if info.padded_rows:
        full = torch.cat([full, full.new_zeros((info.padded_rows, *full.shape[1:]))])
    if info.kind == REPLICATED:
        return full.clone()
    if info.kind == SPLIT:
        return full.chunk(info.world, dim=info.dim)[info.rank].clone()
    gate, up = full.chunk(2, dim=0)
    return torch.cat(
        [gate.chunk(info.world, dim=0)[info.rank], up.chunk(info.world, dim=0)[info.rank]]
    )


def gather_full_tensor(local: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The full one-process tensor from every rank's part (a collective over ``info.group``;
    every rank of the group must call it). Also works for gradients (``param.main_grad``)."""
    if info.kind == REPLICATED or info.world == 1:
        full = local.detach().clone()
    else:
        parts = [torch.empty_like(local) for _ in range(info.world)]
        dist.all_gather(parts, local.detach().contiguous(), group=info.group)
        if info.kind == SPLIT:
            full = torch.cat(parts, dim=info.dim)
        else:
            halves = [part.chunk(2, dim=0) for part in parts]
            full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if info.padded_rows:
        full = full[: full.shape[0] - info.padded_rows]
    return full


# ---------------------------------------------------------------------------------------------
# Seed-determined initialisation
# ---------------------------------------------------------------------------------------------


def _generator(seed: int, global_name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{global_name}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def full_initial_tensor(
    global_name: str, full_shape: Sequence[int], seed: int, init_std: float, num_layers: int
) -> torch.Tensor:
    """The fp32 full tensor of ``global_name`` for ``seed``:

    * norm weights: 1 (norm biases 0);
    * ``linear_proj`` / ``linear_fc2`` weights: ``N(0, init_std / sqrt(2 num_layers))``
      (Megatron's scaled output-layer init);
    * every other weight and bias: ``N(0, init_std)`` (biases random so sharding is tested).
    """
    last = global_name.rsplit(".", 1)[-1]
    if "norm" in global_name:
        value = 1.0 if last.endswith("weight") else 0.0
        return torch.full(tuple(full_shape), value, dtype=torch.float32)
    std = init_std
    if re.search(r"(linear_proj|linear_fc2)\.weight\d*$", global_name):
        std = init_std / math.sqrt(2.0 * num_layers)
    out = torch.empty(tuple(full_shape), dtype=torch.float32)
    return out.normal_(0.0, std, generator=_generator(seed, global_name))


@torch.no_grad()
def initialize_weights_from_seed(
    model_chunks: Sequence[torch.nn.Module], seed: int, init_std: float
) -> None:
    """Set every parameter to its shard of :func:`full_initial_tensor` (no communication)."""
    num_layers = _unwrap(model_chunks[0]).config.num_layers
    for _, param, info in iter_global_parameters(model_chunks):
        full = full_initial_tensor(info.global_name, info.full_shape, seed, init_std, num_layers)
        param.copy_(shard_full_tensor(full, info).to(dtype=param.dtype, device=param.device))


def gather_full_state(
    model_chunks: Sequence[torch.nn.Module], *, grads: bool = False
) -> dict[str, torch.Tensor]:
    """``{global_name: full tensor}`` of this rank's parameters (or their ``main_grad``); a
    collective over tp and expert-tp. Tied copies are skipped. With the distributed optimizer
    ``main_grad`` is only valid in this rank's reduce-scattered shard after a backward."""
    out = {}
    for name, param, info in iter_global_parameters(model_chunks):
        if info.tied_copy:
            continue
        local = param.main_grad if grads else param
        out[name] = gather_full_tensor(local, info)
    return out
