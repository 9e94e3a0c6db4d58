"""Hugging Face checkpoint directories: lazy reading, streaming sharded writing, atomic output.

Reading goes through ``safetensors.safe_open``, which memory-maps each file, so fetching one tensor
reads only that tensor. Writing is streaming: the shard layout (names, shapes, dtypes, byte
offsets) is planned before any data exists, each file's header is written first, and each tensor
is written at its planned offset as it arrives, in any order. Peak memory is one tensor, not one
shard. The files follow the safetensors format (8-byte little-endian header length, JSON header,
contiguous little-endian data) and the ``model.safetensors.index.json`` that ``save_pretrained``
writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from safetensors import safe_open

from megatron_gspo.convert.mapping import ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

SIDE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
)
"""Files of an HF model directory that an export copies unchanged from the original."""

_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def damaged_safetensors(hf_dir: str) -> list[str]:
    """What is wrong with the safetensors files of an HF model directory, one line each (empty
    when nothing is): a shard that the index names but the directory lacks, a file whose header
    cannot be read, a file shorter than its header says (a truncated copy or download). Reads
    headers only, never the tensors, so it runs before anything is built."""
    index_path = os.path.join(hf_dir, INDEX_FILE)
    problems = []
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as file:
                named = sorted(set(json.load(file)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as error:
            return [f"{index_path} cannot be read ({type(error).__name__}: {error})"]
        for file_name in named:
            if not os.path.isfile(os.path.join(hf_dir, file_name)):
                problems.append(
                    f"{os.path.join(hf_dir, file_name)} is missing ({INDEX_FILE} names it)"
                )
    else:
        named = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    for file_name in named:
        path = os.path.join(hf_dir, file_name)
        if os.path.isfile(path):
            problem = _safetensors_file_problem(path)
            if problem is not None:
                problems.append(f"{path} {problem}")
    return problems


def _safetensors_file_problem(path: str) -> Optional[str]:
    """Why the safetensors file ``path`` is damaged, or None. The format: an 8-byte little-endian
    header length, a JSON header whose ``data_offsets`` locate each tensor, then the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        if len(prefix) < 8:
            return f"is truncated ({size} bytes: not even a header)"
        header_length = int.from_bytes(prefix, "little")
        if 8 + header_length > size:
            return f"is truncated ({size} bytes; its header alone needs {8 + header_length})"
        try:
            header = json.loads(file.read(header_length))
        except ValueError as error:
            return f"has an unreadable header ({error})"
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry
    ]
    needed = 8 + header_length + max(ends, default=0)
    if needed > size:
        return f"is truncated ({size} bytes; its header describes {needed})"
    return None


class HFCheckpointReader:
    """Lazy access to the tensors of an HF model directory by on-disk name.

    Understands ``model.safetensors.index.json`` (sharded), a single ``model.safetensors``, or a
    directory of ``*.safetensors`` files without an index. Files are opened on first use.
    """

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        damaged = damaged_safetensors(hf_dir) if os.path.isdir(hf_dir) else []
        if damaged:
            raise ConversionError(
                f"damaged model directory {hf_dir}: " + "; ".join(damaged) + ". Copy or "
                "download the model again (or re-export it with tools/convert_checkpoint.py)"
            )
        self.weight_map = self._weight_map(hf_dir)
        self._files: dict[str, object] = {}

    @staticmethod
    def _weight_map(hf_dir: str) -> dict[str, str]:
        index_path = os.path.join(hf_dir, INDEX_FILE)
        if os.path.isfile(index_path):
            with open(index_path, encoding="utf-8") as file:
                return dict(json.load(file)["weight_map"])
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
        if not files:
            extra = ""
            if any(f.endswith(".bin") for f in os.listdir(hf_dir)):
                extra = (
                    " It holds PyTorch .bin weights: convert them with transformers "
                    "(from_pretrained, then save_pretrained(safe_serialization=True))."
                )
            raise ConversionError(
                f"{hf_dir} has no safetensors weights ({INDEX_FILE} or *.safetensors).{extra}"
            )
        weight_map = {}
        for file_name in files:
            with safe_open(os.path.join(hf_dir, file_name), framework="pt") as handle:
                weight_map.update(dict.fromkeys(handle.keys(), file_name))
        return weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        file_name = self.weight_map.get(name)
        if file_name is None:
            raise ConversionError(
                f"{self.hf_dir} has no tensor {name!r}; the checkpoint does not match "
                "model.architecture / its config.json (or is incomplete)"
            )
        handle = self._files.get(file_name)
        if handle is None:
            handle = safe_open(os.path.join(self.hf_dir, file_name), framework="pt")
            self._files[file_name] = handle
        return handle

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a fresh CPU tensor; only its bytes are read)."""
        return self._handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def close(self) -> None:
        self._files.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Cut ``tensors`` (in order) into shards of at most ``max_shard_bytes`` of data.

    A tensor larger than the limit gets a shard of its own (as ``save_pretrained`` does).
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[list[PlannedTensor]] = []
    current: list[PlannedTensor] = []
    size = 0
    for tensor in tensors:
        if current and size + tensor.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.nbytes
    if current:
        shards.append(current)
    return shards


class ShardedSafetensorsWriter:
    """Writes planned tensors into safetensors shards, one tensor at a time, in any order.

    Usage::

        with ShardedSafetensorsWriter(out_dir, planned, max_shard_bytes) as writer:
            for name, tensor in produce():
                writer.write(name, tensor)
        # index written; raises if a planned tensor never came
    """

    def __init__(self, out_dir: str, planned: list[PlannedTensor], max_shard_bytes: int):
        names = [tensor.name for tensor in planned]
        if len(set(names)) != len(names):
            raise ConversionError("duplicate tensor names in the export plan")
        self.out_dir = out_dir
        self.shards = plan_shards(planned, max_shard_bytes)
        count = len(self.shards)
        self.file_names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self._where: dict[str, tuple[int, int, PlannedTensor]] = {}
        self._files = []
        self._written: set[str] = set()
        for shard_index, (file_name, shard) in enumerate(zip(self.file_names, self.shards)):
            header, offsets = _header(shard)
            file = open(os.path.join(out_dir, file_name), "wb")  # noqa: SIM115 - closed in close()
            self._files.append(file)
            file.write(struct.pack("<Q", len(header)))
            file.write(header)
            data_start = 8 + len(header)
            data_end = data_start + (offsets[-1][1] if offsets else 0)
            # Reserve the full size now so that writes may come in any order.
            file.truncate(data_end)
            for tensor, (begin, _) in zip(shard, offsets):
                self._where[tensor.name] = (shard_index, data_start + begin, tensor)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self._where:
            raise ConversionError(f"tensor {name!r} is not in the export plan")
        if name in self._written:
            raise ConversionError(f"tensor {name!r} was produced twice")
        shard_index, offset, planned = self._where[name]
        if tuple(tensor.shape) != planned.shape or tensor.dtype != planned.dtype:
            raise ConversionError(
                f"tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, planned "
                f"{planned.shape} {planned.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        file = self._files[shard_index]
        file.seek(offset)
        file.write(memoryview(data))
        self._written.add(name)

    def missing(self) -> list[str]:
        return [name for name in self._where if name not in self._written]

    def close(self, *, complete: bool = True) -> None:
        for file in self._files:
            file.close()
        self._files = []
        if not complete:
            return
        missing = self.missing()
        if missing:
            raise ConversionError(
                f"{len(missing)} planned tensors were never produced, e.g. {missing[:3]}"
            )
        weight_map = {
            tensor.name: file_name
            for file_name, shard in zip(self.file_names, self.shards)
            for tensor in shard
        }
        total = sum(tensor.nbytes for shard in self.shards for tensor in shard)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(self.out_dir, INDEX_FILE), "w", encoding="utf-8") as file:
            json.dump(index, file, indent=2)
            file.write("\n")

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        self.close(complete=exc_type is None)


def _header(shard: list[PlannedTensor]) -> tuple[bytes, list[tuple[int, int]]]:
    """safetensors JSON header of ``shard`` (padded to 8 bytes) and each tensor's data range."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets = []
    position = 0
    for tensor in shard:
        if tensor.dtype not in _DTYPE_NAMES:
            raise ConversionError(f"{tensor.name}: dtype {tensor.dtype} has no safetensors code")
        offsets.append((position, position + tensor.nbytes))
        entries[tensor.name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [position, position + tensor.nbytes],
        }
        position += tensor.nbytes
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    # The data section must start 8-byte aligned (safetensors pads the header with spaces).
    header += b" " * (-len(header) % 8)
    return header, offsets


# ---------------------------------------------------------------------------------------------
# Output directories
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_directory(out_dir: str, *, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary sibling of ``out_dir``; on success it becomes ``out_dir`` by rename.

    On failure the temporary directory is removed and ``out_dir`` is untouched. An existing
    ``out_dir`` is an error unless ``overwrite`` (then it is replaced only after the new one is
    complete).
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise ConversionError(
            f"{out_dir} already exists; choose a new output directory or pass --overwrite"
        )
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    old: Optional[str] = None
    if os.path.exists(out_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(out_dir, old)
    os.chmod(temporary, 0o755)
    os.rename(temporary, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def copy_side_files(origin_dir: str, out_dir: str) -> list[str]:
    """Copy tokenizer and generation-config files of ``origin_dir`` into ``out_dir``."""
    copied = []
    for name in SIDE_FILES:
        source = os.path.join(origin_dir, name)
        if os.path.isfile(source):
            shutil.copy2(source, os.path.join(out_dir, name))
            copied.append(name)
    return copied
