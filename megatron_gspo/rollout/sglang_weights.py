"""Weight transports from the trainer to SGLang servers: disk, tensor, distributed.

Each transport takes full (unsharded) tensors under their on-disk Hugging Face names (Megatron ->
HF conversion and the TP/EP gather happen before, trainer-side) and issues the SGLang calls of
``docs/sglang-protocol.md`` section 4. :class:`SGLangEngine` wraps every sync in the
``/begin_weight_update`` bracket; the caller pauses and flushes first
(:func:`megatron_gspo.rollout.types.sync_weights_paused`). None of them imports sglang, except
the tensor transport for CUDA tensors (SGLang's device-UUID patch of torch's CUDA-IPC handles).

* ``disk``: safetensors shards + ``config.json`` in a fresh directory, then
  ``/update_weights_from_disk``. Works with any server the trainer shares a filesystem with.
* ``tensor`` (colocated): each bucket is one flattened buffer whose *handle* travels in
  ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``): CUDA-IPC on GPUs, a
  shared-memory file on CPU. The buffer must stay alive until the call returns (reusing it
  earlier corrupted weights in slime#929).
* ``distributed`` (disaggregated): ``/init_weights_update_group`` once, then per bucket a
  ``/update_weights_from_distributed`` call issued CONCURRENTLY with the trainer's broadcast
  of each tensor, in the same order (NCCL on GPUs, gloo on CPU).

The distributed transport lives in :mod:`megatron_gspo.rollout.sglang_broadcast`. All three are
tested end to end against a real SGLang 0.5.23 server on CPU
(``tests/real_sglang``).
"""

from __future__ import annotations

import abc
import base64
import io
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

from megatron_gspo.rollout.types import SyncStats

logger = logging.getLogger(__name__)


class WeightTransport(abc.ABC):
    """How :meth:`SGLangEngine.sync_weights` moves tensors to the servers."""

    name: str = "abstract"
    needs_bracket: bool = True
    """Whether SGLang 0.5.23 needs the ``/begin_weight_update`` ... ``/end_weight_update`` bracket
    around this transport's calls (tensor and distributed: yes, refused outside it)."""

    @abc.abstractmethod
    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> SyncStats:
        """Move every tensor to every server of ``client`` and set their weight version."""

    def resend(self, client: Any) -> Optional[SyncStats]:
        """Send the newest weights again, without the trainer, to servers that lost them (a
        restarted server); None when this transport keeps no copy of them."""
        return None

    @property
    def latest_version(self) -> Optional[int]:
        """Version of the newest weights this transport holds a copy of (written, maybe not
        loaded by every server); None when it keeps none."""
        return None

    def reset(self) -> None:  # noqa: B027 - optional hook
        """Forget per-server state after a server restarted (its update group): the next
        :meth:`sync` starts over with every server."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release process groups or files."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor travels
    alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def with_last_flag(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(item, is_last)``: looks one item ahead so the last bucket can flush and set the version."""
    iterator = iter(items)
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current, False
        current = following
    yield current, True


# ---------------------------------------------------------------------------------- disk


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str,
    *,
    shard_bytes: int = 5 << 30,
    config_source_dir: Optional[str] = None,
    config_json: Optional[str] = None,
) -> tuple[int, int]:
    """Write an HF checkpoint directory: ``model-0000i-of-0000N.safetensors`` shards, the
    ``model.safetensors.index.json`` map and ``config.json``; returns ``(tensors, bytes)``.

    ``config.json`` (and ``generation_config.json``) are copied from ``config_source_dir`` when
    given (keeps every key the original model had), else written from ``config_json``. Shards are
    streamed: one shard of tensors is in host memory at a time.
    """
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    temporary_files: list[str] = []
    num_tensors = num_bytes = 0
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0

    def flush_shard() -> None:
        nonlocal shard, shard_size
        if not shard:
            return
        file_name = f"shard-{len(temporary_files):05d}.tmp"
        save_file(shard, os.path.join(directory, file_name), metadata={"format": "pt"})
        temporary_files.append(file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
        shard, shard_size = {}, 0

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"write_hf_checkpoint: tensor {name!r} given twice")
        # A copy: views of packed parameters share storage, which safetensors refuses.
        host = tensor.detach().to("cpu", copy=True).contiguous()
        if shard and shard_size + tensor_bytes(host) > shard_bytes:
            flush_shard()
        shard[name] = host
        shard_size += tensor_bytes(host)
        num_tensors += 1
        num_bytes += tensor_bytes(host)
    flush_shard()
    if not temporary_files:
        raise ValueError("write_hf_checkpoint: no tensors to write")
    total = len(temporary_files)
    final_names = {
        temp: f"model-{index + 1:05d}-of-{total:05d}.safetensors"
        for index, temp in enumerate(temporary_files)
    }
    for temp, final in final_names.items():
        os.replace(os.path.join(directory, temp), os.path.join(directory, final))
    index = {
        "metadata": {"total_size": num_bytes},
        "weight_map": {name: final_names[temp] for name, temp in sorted(weight_map.items())},
    }
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    if config_source_dir is not None:
        for file_name in ("config.json", "generation_config.json"):
            source = os.path.join(config_source_dir, file_name)
            if os.path.exists(source):
                shutil.copy(source, os.path.join(directory, file_name))
    elif config_json is not None:
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            f.write(config_json)
    return num_tensors, num_bytes


class DiskTransport(WeightTransport):
    """Write safetensors under ``directory/weights_v{version}`` and ``/update_weights_from_disk``.

    The servers must see ``directory`` (same machine or a shared filesystem). Older version
    directories beyond ``keep_last`` are deleted after a successful update.
    """

    name = "disk"
    needs_bracket = False  # /update_weights_from_disk post-processes the weights itself

    def __init__(
        self,
        directory: Optional[str] = None,
        *,
        config_source_dir: Optional[str] = None,
        config_json: Optional[str] = None,
        shard_bytes: int = 5 << 30,
        keep_last: int = 1,
    ):
        self.directory = directory or tempfile.mkdtemp(prefix="megatron_gspo_weights_")
        self.config_source_dir = config_source_dir
        self.config_json = config_json
        self.shard_bytes = shard_bytes
        self.keep_last = keep_last
        self._written: list[str] = []
        self._latest: Optional[tuple[str, int, int, int]] = None
        """``(directory, version, tensors, bytes)`` of the newest weights written, loaded or not
        (what :meth:`resend` sends to a restarted server)."""

    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        path = os.path.join(self.directory, f"weights_v{version:08d}")
        if os.path.exists(path):
            shutil.rmtree(path)
        num_tensors, num_bytes = write_hf_checkpoint(
            named_tensors,
            path,
            shard_bytes=self.shard_bytes,
            config_source_dir=self.config_source_dir,
            config_json=self.config_json,
        )
        self._latest = (path, version, num_tensors, num_bytes)
        return self._load(client, start)

    def resend(self, client: Any) -> Optional[SyncStats]:
        if self._latest is None:
            return None
        return self._load(client, time.perf_counter())

    @property
    def latest_version(self) -> Optional[int]:
        return None if self._latest is None else self._latest[1]

    def _load(self, client: Any, start: float) -> SyncStats:
        path, version, num_tensors, num_bytes = self._latest
        client.post_all(
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": getattr(client, "flushes_on_update", True),
                "abort_all_requests": False,
            },
            timeout=client.request_timeout_s,
        )
        if path not in self._written:
            self._written.append(path)
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------- tensor


def serialize_flattened_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, Any]:
    """``(base64 payload, keep_alive)`` of one bucket for ``load_format="flattened_bucket"``.

    The bucket's tensors are concatenated byte-wise into one ``uint8`` buffer (each aligned to its
    element size); the metadata lists
    each tensor's name, shape, dtype and byte range as ``types.SimpleNamespace`` objects (SGLang
    0.5.23 reads these attributes and rebuilds its own ``FlattenedTensorMetadata``; its
    ``SafeUnpickler`` admits ``SimpleNamespace``), so building the payload needs no sglang. The
    payload is ``multiprocessing``'s ``ForkingPickler`` output in base64, like SGLang's
    ``MultiprocessingSerializer``: it carries a *handle* to the buffer, never its data, so
    ``keep_alive`` (the buffer) must outlive the HTTP call.

    * CUDA tensors travel as CUDA-IPC handles; SGLang's reduction patch
      (``monkey_patch_torch_reductions``, imported lazily) names the device by UUID so that a
      server with other visible devices opens the right one.
    * CPU tensors travel as shared-memory file names, which needs the ``file_system`` sharing
      strategy (:func:`use_file_system_sharing`).
    """
    views, metadata, offset = [], [], 0
    for name, tensor in bucket:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        # Each tensor starts at a multiple of its element size (the receiver views its byte
        # range as the dtype, which torch refuses at a misaligned offset, e.g. an int64 after an
        # odd number of bfloat16): zero padding bytes fill the gap.
        padding = -offset % tensor.element_size()
        if padding:
            views.append(torch.zeros(padding, dtype=torch.uint8, device=flat.device))
            offset += padding
        metadata.append(
            SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + flat.numel(),
                numel=flat.numel(),
            )
        )
        views.append(flat)
        offset += flat.numel()
    buffer = torch.cat(views)
    if buffer.is_cuda:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
    else:
        use_file_system_sharing()
    stream = io.BytesIO()
    ForkingPickler(stream).dump({"flattened_tensor": buffer, "metadata": metadata})
    return base64.b64encode(stream.getvalue()).decode("ascii"), buffer


def use_file_system_sharing() -> None:
    """Share CPU tensors with other processes by ``/dev/shm`` file name (process-wide).

    torch's default ``file_descriptor`` strategy hands a descriptor over a socket that the
    receiver must authenticate to with the *sender's* ``multiprocessing`` key; an SGLang server
    has another key, fails with ``AuthenticationError: digest sent was rejected`` and its
    scheduler dies (measured with SGLang 0.5.23 on CPU). With ``file_system``, torch's
    ``torch_shm_manager`` daemon unlinks each file once the last process holding it lets go.
    """
    import torch.multiprocessing

    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        logger.info("sharing CPU tensors by file name (torch.multiprocessing 'file_system')")
        torch.multiprocessing.set_sharing_strategy("file_system")


def tensor_update_payload(
    serialized: str, num_engine_tp_ranks: int, *, flush_cache: bool, weight_version: Optional[str]
) -> dict[str, Any]:
    """``/update_weights_from_tensor`` body: one payload per engine TP rank (rank r reads item r;
    colocated ranks can all open the same IPC handles)."""
    return {
        "serialized_named_tensors": [serialized] * num_engine_tp_ranks,
        "load_format": "flattened_bucket",
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version,
    }


class TensorTransport(WeightTransport):
    """Colocated transport (``/update_weights_from_tensor``): the servers map the trainer's
    buffers, CUDA-IPC on GPUs, shared memory on CPU (:func:`serialize_flattened_bucket`)."""

    name = "tensor"

    def __init__(self, bucket_bytes: int = 512 << 20, num_engine_tp_ranks: int = 1):
        self.bucket_bytes = bucket_bytes
        self.num_engine_tp_ranks = num_engine_tp_ranks

    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        for bucket, is_last in with_last_flag(iter_buckets(named_tensors, self.bucket_bytes)):
            serialized, keep_alive = serialize_flattened_bucket(bucket)
            payload = tensor_update_payload(
                serialized,
                self.num_engine_tp_ranks,
                flush_cache=is_last and getattr(client, "flushes_on_update", True),
                weight_version=str(version) if is_last else None,
            )
            client.post_all(
                "/update_weights_from_tensor", payload, timeout=client.request_timeout_s
            )
            del keep_alive  # the servers have copied the bucket once the calls returned
            num_tensors += len(bucket)
            num_bytes += sum(tensor_bytes(t) for _, t in bucket)
            num_buckets += 1
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start, num_buckets)


# ---------------------------------------------------------------------------------- config


def transport_from_config(
    rollout: Any,
    model: Any,
    *,
    num_engines: int = 1,
    disk_dir: Optional[str] = None,
    master_address: Optional[str] = None,
    master_port: Optional[int] = None,
    urls: Sequence[str] = (),
) -> WeightTransport:
    """The transport ``rollout.weight_transport`` names (a :class:`RolloutConfig`).

    ``disk`` copies ``config.json`` from ``model.hf_path`` when set, else writes the config
    derived from ``model``. ``distributed``: the group's rendezvous is ``master_address`` (else
    ``rollout.weight_sync_address``, else this machine's address towards ``urls[0]``) and
    ``master_port`` (else ``rollout.weight_sync_port``; 0 picks a free port at the first sync);
    the backend is NCCL when this process has a GPU, else gloo (SGLang on CPU).
    """
    bucket_bytes = rollout.weight_bucket_mb << 20
    if rollout.weight_transport == "disk":
        config_json = None
        if model.hf_path is None:
            from megatron_gspo.convert.hf_config import hf_config_from_model_config

            config_json = hf_config_from_model_config(model).to_json_string()
        return DiskTransport(disk_dir, config_source_dir=model.hf_path, config_json=config_json)
    if rollout.weight_transport == "tensor":
        return TensorTransport(bucket_bytes, num_engine_tp_ranks=rollout.sglang_tp)
    from megatron_gspo.rollout.sglang_broadcast import DistributedTransport, local_address_towards

    master_address = master_address or rollout.weight_sync_address
    if master_address is None:
        if not urls:
            raise ValueError(
                "rollout.weight_transport=distributed needs the address the SGLang servers reach "
                "the trainer on: set rollout.weight_sync_address, or give the server URLs"
            )
        master_address = local_address_towards(urls[0])
    if master_port is None:
        master_port = rollout.weight_sync_port
    return DistributedTransport(
        master_address,
        master_port,
        [rollout.sglang_tp] * num_engines,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        bucket_bytes=bucket_bytes,
    )
