"""Read a Megatron ``torch_dist`` checkpoint tensor by tensor, without Megatron.

A ``torch_dist`` checkpoint is a PyTorch Distributed Checkpoint (DCP) directory: ``.metadata``
(pickled :class:`torch.distributed.checkpoint.metadata.Metadata`: every tensor's global shape and
the chunks each rank wrote) and ``__<rank>_<i>.distcp`` files holding the chunks. Megatron stores
each model tensor once, in its one-process layout (q/k/v grouped, fc1 = [gate; up]); tensor
parallel splits are just chunks, so reading a region reassembles them.

Keys (``docs/hf-mapping.md`` section 4, checked against megatron-core 0.16.1):

* homogeneous layers are stacked on a leading layer axis: ``decoder.layers.<rest>`` ``[L, ...]``;
  with a heterogeneous layout (dense first layers, ``moe_layer_freq`` a list) the layer index
  stays in the key: ``decoder.layers.<l>.<rest>``;
* experts are stacked on an expert axis: ``...mlp.experts.experts.linear_fc1.weight``
  ``[(L,) E, 2F, h]``; with ``singleton_local_shards`` the index stays in the key
  (``...experts.experts.<e>.linear_fc1.weight``) and fc1 is stored as gate and up halves
  ``weight_w`` / ``weight_v``;
* norms use the TE spelling (``self_attention.linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_weight``), which :mod:`megatron_gspo.convert.mapping` accepts.

Only the byte ranges of the chunks that make up one requested ``[layer, expert]`` slice are read,
so memory stays at about one parameter whatever the model size.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_gspo.convert.mapping import ConversionError, parameter_sort_key

MODEL_KEY_ROOTS = ("embedding.", "decoder.", "output_layer.")
"""First components of the keys of a ``GPTModel``'s own tensors (optimizer state, RNG and
``_extra_state`` entries live under other names)."""


@dataclass(frozen=True)
class Region:
    """A box ``[offsets, offsets + sizes)`` of a stored tensor; ``squeeze`` leading axes dropped."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    squeeze: int


@dataclass
class StoredParameter:
    """One one-process Megatron parameter and the stored regions it is read from.

    Several regions (fc1's gate and up halves in the singleton layout) are concatenated on dim 0.
    """

    name: str
    regions: list[Region] = field(default_factory=list)
    dtype: Optional[torch.dtype] = None

    @property
    def shape(self) -> tuple[int, ...]:
        shapes = [region.sizes[region.squeeze :] for region in self.regions]
        rows = sum(shape[0] for shape in shapes)
        return (rows, *shapes[0][1:])


class _AnyClass:
    """Stand-in for classes of packages that are not importable here (e.g. Megatron's)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state


class _TolerantUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_AnyClass,), {"__module__": module})


def read_dcp_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP metadata of ``checkpoint_dir``; classes of missing packages become stand-ins.

    Megatron versions differ in what they pickle next to the tensor index (NVIDIA-NeMo
    Megatron-Bridge#1210: "MCoreMetadata unpickling across mcore versions"); the tensor index
    itself is plain torch.
    """
    path = os.path.join(checkpoint_dir, ".metadata")
    if not os.path.isfile(path):
        hint = ""
        if os.path.isdir(checkpoint_dir):
            subdirs = sorted(
                entry
                for entry in os.listdir(checkpoint_dir)
                if os.path.isfile(os.path.join(checkpoint_dir, entry, ".metadata"))
            )
            if subdirs:
                hint = f" It contains checkpoints: {', '.join(subdirs[-3:])}; pass one of them."
        raise ConversionError(
            f"{checkpoint_dir} is not a torch_dist checkpoint: {path} is missing.{hint}"
        )
    with open(path, "rb") as file:
        return _TolerantUnpickler(file).load()


_STACKED_EXPERTS = re.compile(r"^(?P<head>.*mlp\.experts)\.experts\.(?P<tail>linear_fc[12]\..+)$")
_SINGLETON_EXPERT = re.compile(
    r"^(?P<head>.*mlp\.experts)\.experts\.(?P<expert>\d+)\.(?P<tail>linear_fc[12]\..+)$"
)
_LAYER_INDEX = re.compile(r"^decoder\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
_HALF_SUFFIX = re.compile(r"^(?P<name>.+)_(?P<half>[wv])$")


def _covered(chunks: list[ChunkStorageMetadata], axis: int) -> list[int]:
    """Indices of ``axis`` for which some chunk holds data."""
    indices = set()
    for chunk in chunks:
        indices.update(range(chunk.offsets[axis], chunk.offsets[axis] + chunk.sizes[axis]))
    return sorted(indices)


class TorchDistCheckpoint:
    """Random access to the model tensors of a Megatron ``torch_dist`` checkpoint.

    ``key_prefix`` is what precedes the model keys (``""`` for Megatron-LM and this project);
    None detects it from the embedding or first decoder key.
    """

    def __init__(self, checkpoint_dir: str, key_prefix: Optional[str] = None):
        self.checkpoint_dir = checkpoint_dir
        self.metadata = read_dcp_metadata(checkpoint_dir)
        self.reader = FileSystemReader(checkpoint_dir)
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.tensors: dict[str, TensorStorageMetadata] = {
            key: value
            for key, value in self.metadata.state_dict_metadata.items()
            if isinstance(value, TensorStorageMetadata)
        }
        self.key_prefix = self._detect_prefix() if key_prefix is None else key_prefix

    def _detect_prefix(self) -> str:
        candidates = set()
        for key in self.tensors:
            for root in MODEL_KEY_ROOTS:
                position = key.find(root)
                if position >= 0 and (position == 0 or key[position - 1] in "./"):
                    candidates.add(key[:position])
        # Optimizer state repeats the model keys under a longer prefix ("optimizer.state....").
        plain = sorted(c for c in candidates if not c.startswith("optimizer"))
        if not plain:
            raise ConversionError(
                f"{self.checkpoint_dir} holds no GPT model tensors (no key contains "
                f"{' or '.join(MODEL_KEY_ROOTS)}); is it a model checkpoint?"
            )
        return min(plain, key=len)

    def read(self, region: Region) -> torch.Tensor:
        """The stored data of ``region`` as one tensor (leading ``squeeze`` axes dropped)."""
        metadata = self.tensors[region.key]
        chunk = ChunkStorageMetadata(
            offsets=torch.Size(region.offsets), sizes=torch.Size(region.sizes)
        )
        items = create_read_items_for_chunk_list(region.key, metadata, [chunk])
        covered = sum(_numel(item.lengths) for item in items)
        if covered != _numel(region.sizes):
            raise ConversionError(
                f"{self.checkpoint_dir}: {region.key} at offset {region.offsets} size "
                f"{region.sizes} is only partly stored ({covered} of {_numel(region.sizes)} "
                "elements); the checkpoint is incomplete (an interrupted save?)"
            )
        out = torch.empty(region.sizes, dtype=metadata.properties.dtype)
        self.reader.read_data(LoadPlan(items), _RegionPlanner(out)).wait()
        for _ in range(region.squeeze):
            out = out.squeeze(0)
        return out

    def read_parameter(self, parameter: StoredParameter) -> torch.Tensor:
        """The full one-process tensor of ``parameter``."""
        parts = [self.read(region) for region in parameter.regions]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def parameters(self) -> tuple[list[StoredParameter], list[str]]:
        """Every stored model parameter in one-process naming, and the tensor keys skipped.

        Order: embedding, layers by index (each layer's tensors in stored order, experts by
        index), final norm, output layer. Optimizer state, RNG state and ``_extra_state`` are
        skipped.
        """
        by_name: dict[str, StoredParameter] = {}
        skipped: list[str] = []
        for key, metadata in self.tensors.items():
            if not key.startswith(self.key_prefix):
                skipped.append(key)
                continue
            local = key[len(self.key_prefix) :]
            if not local.startswith(MODEL_KEY_ROOTS):
                skipped.append(key)
                continue
            for name, region, half in self._expand(key, local, metadata):
                parameter = by_name.setdefault(name, StoredParameter(name))
                parameter.dtype = metadata.properties.dtype
                # gate (``_w``) before up (``_v``): fc1 = [gate; up].
                if half == "w":
                    parameter.regions.insert(0, region)
                else:
                    parameter.regions.append(region)
        return sorted(by_name.values(), key=lambda p: parameter_sort_key(p.name)), skipped

    def _expand(
        self, key: str, local: str, metadata: TensorStorageMetadata
    ) -> list[tuple[str, Region, Optional[str]]]:
        shape = tuple(metadata.size)
        half = None
        match = _HALF_SUFFIX.match(local)
        if match and match["name"].endswith(("linear_fc1.weight", "linear_fc1.bias")):
            local, half = match["name"], match["half"]
        layer_match = _LAYER_INDEX.match(local)
        if layer_match:
            layers = [(int(layer_match["layer"]), None)]
            rest = layer_match["rest"]
        elif local.startswith("decoder.layers."):
            rest = local[len("decoder.layers.") :]
            layers = [(layer, 0) for layer in _covered(metadata.chunks, 0)]
        else:
            whole = Region(key, (0,) * len(shape), shape, 0)
            return [(local, whole, half)]
        results = []
        for layer, layer_axis in layers:
            axis = 0 if layer_axis is None else 1
            stacked = _STACKED_EXPERTS.match(rest)
            singleton = _SINGLETON_EXPERT.match(rest)
            if singleton:
                experts = [(int(singleton["expert"]), None)]
                head, tail = singleton["head"], singleton["tail"]
            elif stacked:
                chunks = metadata.chunks
                if layer_axis is not None:
                    chunks = [
                        c for c in chunks if c.offsets[0] <= layer < c.offsets[0] + c.sizes[0]
                    ]
                experts = [(expert, axis) for expert in _covered(chunks, axis)]
                head, tail = stacked["head"], stacked["tail"]
            else:
                experts = [(None, None)]
                head = tail = None
            for expert, expert_axis in experts:
                offsets, sizes = [0] * len(shape), list(shape)
                squeeze = 0
                if layer_axis is not None:
                    offsets[0], sizes[0] = layer, 1
                    squeeze += 1
                if expert_axis is not None:
                    offsets[expert_axis], sizes[expert_axis] = expert, 1
                    squeeze += 1
                if expert is None:
                    name = f"decoder.layers.{layer}.{rest}"
                else:
                    name = f"decoder.layers.{layer}.{head}.local_experts.{expert}.{tail}"
                results.append((name, Region(key, tuple(offsets), tuple(sizes), squeeze), half))
        return results


def _numel(sizes: Any) -> int:
    count = 1
    for size in sizes:
        count *= int(size)
    return count


class _RegionPlanner:
    """The part of :class:`~torch.distributed.checkpoint.LoadPlanner` that
    :meth:`FileSystemReader.read_data` calls: where each read lands in the output tensor."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        # dest_offsets are relative to the requested region (the single local chunk).
        view = self.out
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ConversionError(f"unexpected bytes entry {read_item.dest_index.fqn} in a tensor read")
