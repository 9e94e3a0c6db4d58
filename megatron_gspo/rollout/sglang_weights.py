"""Weight transports from the trainer to SGLang servers: disk, tensor (CUDA IPC), distributed.

Each transport takes full (unsharded) tensors under their on-disk Hugging Face names (Megatron ->
HF conversion and the TP/EP gather happen before, trainer-side) and issues the SGLang calls of
``docs/sglang-protocol.md`` section 4. :class:`SGLangEngine` wraps every sync in the
``/begin_weight_update`` bracket; the caller pauses and flushes first
(:func:`megatron_gspo.rollout.types.sync_weights_paused`).

* ``disk``: safetensors shards + ``config.json`` in a fresh directory, then
  ``/update_weights_from_disk``. Works with any server the trainer shares a filesystem with,
  including the embedded loopback server (tested end to end on CPU).
* ``tensor`` (colocated only): each bucket is flattened into sglang's ``FlattenedTensorBucket``
  and serialised with sglang's ``MultiprocessingSerializer``; the payload is pickled CUDA-IPC
  handles, not data, so the tensors must live on a GPU of the same node, and stay alive until the
  call returns (reusing the buffer earlier corrupted weights in slime#929). Needs sglang.
* ``distributed`` (disaggregated): ``/init_weights_update_group`` once, then per bucket a
  ``/update_weights_from_distributed`` call issued CONCURRENTLY with the trainer's
  ``broadcast(src=0)`` of each tensor, in the same order. Needs sglang (its
  ``init_custom_process_group``) and NCCL.

The tensor and distributed transports cannot run on CPU; their payload builders are pure
functions and are tested here, the transfer itself only on a GPU.
"""

from __future__ import annotations

import abc
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from megatron_gspo.rollout.types import RolloutEngineError, SyncStats


class WeightTransport(abc.ABC):
    """How :meth:`SGLangEngine.sync_weights` moves tensors to the servers."""

    name: str = "abstract"

    @abc.abstractmethod
    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, torch.Tensor]], version: int
    ) -> SyncStats:
        """Move every tensor to every server of ``client`` and set their weight version."""

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


def _with_last_flag(items: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
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
        client.post_all(
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": True,
                "abort_all_requests": False,
            },
            timeout=client.request_timeout_s,
        )
        self._written.append(path)
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start)


# ---------------------------------------------------------------------------------- tensor


def serialize_flattened_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[str, Any]:
    """``(base64 payload, keep_alive)`` of one bucket for ``load_format="flattened_bucket"``.

    The payload must be produced by sglang's ``MultiprocessingSerializer`` (ForkingPickler with
    sglang's torch-reduction patch): for CUDA tensors it carries IPC handles, so
    ``keep_alive`` (the flattened buffer) must outlive the HTTP call.
    """
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()
    flat = FlattenedTensorBucket(named_tensors=[(name, t.detach()) for name, t in bucket])
    data = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return MultiprocessingSerializer.serialize(data, output_str=True), flat


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
    """Colocated CUDA-IPC transport (``/update_weights_from_tensor``); needs sglang and a GPU."""

    name = "tensor"

    def __init__(self, bucket_bytes: int = 512 << 20, num_engine_tp_ranks: int = 1):
        self.bucket_bytes = bucket_bytes
        self.num_engine_tp_ranks = num_engine_tp_ranks

    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        for bucket, is_last in _with_last_flag(iter_buckets(named_tensors, self.bucket_bytes)):
            if any(not tensor.is_cuda for _, tensor in bucket):
                raise RolloutEngineError(
                    "tensor weight transport: CPU tensors cannot travel as CUDA-IPC handles; "
                    "use rollout.weight_transport=disk (or distributed) without colocated GPUs"
                )
            serialized, keep_alive = serialize_flattened_bucket(bucket)
            payload = tensor_update_payload(
                serialized,
                self.num_engine_tp_ranks,
                flush_cache=is_last,
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


# ---------------------------------------------------------------------------------- distributed


def init_group_payloads(
    master_address: str,
    master_port: int,
    engine_world_sizes: list[int],
    group_name: str,
    backend: str = "nccl",
) -> list[dict[str, Any]]:
    """``/init_weights_update_group`` body per server: the trainer is rank 0, server i's GPUs
    take ranks ``1 + sum(sizes[:i]) ...``; the group has ``1 + sum(sizes)`` ranks."""
    world_size = 1 + sum(engine_world_sizes)
    payloads = []
    offset = 1
    for size in engine_world_sizes:
        payloads.append(
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
        )
        offset += size
    return payloads


def distributed_update_payload(
    bucket: list[tuple[str, torch.Tensor]],
    group_name: str,
    *,
    flush_cache: bool,
    weight_version: Optional[str],
) -> dict[str, Any]:
    """``/update_weights_from_distributed`` body announcing the tensors broadcast next, in order."""
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [str(tensor.dtype).removeprefix("torch.") for _, tensor in bucket],
        "shapes": [list(tensor.shape) for _, tensor in bucket],
        "group_name": group_name,
        "flush_cache": flush_cache,
        "abort_all_requests": False,
        "weight_version": weight_version,
        "load_format": None,
    }


class DistributedTransport(WeightTransport):
    """Disaggregated NCCL transport; the trainer process calling ``sync`` is rank 0 of the group.

    Args:
        master_address / master_port: rendezvous of the update group, reachable by the servers.
        engine_world_sizes: GPUs of each server (tp x pp), in the client's URL order.
    """

    name = "distributed"

    def __init__(
        self,
        master_address: str,
        master_port: int,
        engine_world_sizes: list[int],
        *,
        group_name: str = "megatron_gspo_weight_sync",
        backend: str = "nccl",
        bucket_bytes: int = 512 << 20,
    ):
        self.master_address = master_address
        self.master_port = master_port
        self.engine_world_sizes = list(engine_world_sizes)
        self.group_name = group_name
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self._group: Any = None

    @staticmethod
    def _concurrently(calls: list[Any]) -> list[Any]:
        """Start HTTP calls in threads; returns ``[threads, outcomes]`` for :meth:`_join`, which
        runs after the collective the servers are waiting on."""
        outcomes: list[Any] = [None] * len(calls)

        def run(index: int, call: Any) -> None:
            try:
                outcomes[index] = call()
            except Exception as error:  # re-raised in the caller's thread by _join
                outcomes[index] = error

        threads = [
            threading.Thread(target=run, args=(i, c), daemon=True) for i, c in enumerate(calls)
        ]
        for thread in threads:
            thread.start()
        return [threads, outcomes]

    @staticmethod
    def _join(pending: list[Any]) -> None:
        threads, outcomes = pending
        for thread in threads:
            thread.join()
        for outcome in outcomes:
            if isinstance(outcome, Exception):
                raise outcome

    def _ensure_group(self, client: Any) -> None:
        if self._group is not None:
            return
        from sglang.srt.utils.common import init_custom_process_group

        payloads = init_group_payloads(
            self.master_address,
            self.master_port,
            self.engine_world_sizes,
            self.group_name,
            self.backend,
        )
        if len(payloads) != len(client.urls):
            raise ValueError(
                f"{len(self.engine_world_sizes)} engine world sizes for {len(client.urls)} servers"
            )
        # The servers block in the rendezvous until rank 0 joins: post first, then join.
        pending = self._concurrently(
            [
                lambda url=url, body=body: client.post_json(url, "/init_weights_update_group", body)
                for url, body in zip(client.urls, payloads)
            ]
        )
        self._group = init_custom_process_group(
            backend=self.backend,
            init_method=f"tcp://{self.master_address}:{self.master_port}",
            world_size=payloads[0]["world_size"],
            rank=0,
            group_name=self.group_name,
        )
        self._join(pending)

    def sync(
        self, client: Any, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        import torch.distributed as dist

        self._ensure_group(client)
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        for bucket, is_last in _with_last_flag(iter_buckets(named_tensors, self.bucket_bytes)):
            payload = distributed_update_payload(
                bucket,
                self.group_name,
                flush_cache=is_last,
                weight_version=str(version) if is_last else None,
            )
            pending = self._concurrently(
                [
                    lambda url=url, body=payload: client.post_json(
                        url,
                        "/update_weights_from_distributed",
                        body,
                        timeout=client.request_timeout_s,
                    )
                    for url in client.urls
                ]
            )
            for _, tensor in bucket:
                dist.broadcast(tensor.detach().cuda().contiguous(), src=0, group=self._group)
            self._join(pending)
            num_tensors += len(bucket)
            num_bytes += sum(tensor_bytes(t) for _, t in bucket)
            num_buckets += 1
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start, num_buckets)

    def close(self) -> None:
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
            self._group = None


# ---------------------------------------------------------------------------------- config


def transport_from_config(
    rollout: Any,
    model: Any,
    *,
    num_engines: int = 1,
    disk_dir: Optional[str] = None,
    master_address: Optional[str] = None,
    master_port: Optional[int] = None,
) -> WeightTransport:
    """The transport ``rollout.weight_transport`` names (a :class:`RolloutConfig`).

    ``disk`` copies ``config.json`` from ``model.hf_path`` when set, else writes the config
    derived from ``model``; ``distributed`` needs ``master_address`` and ``master_port``.
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
    if master_address is None or master_port is None:
        raise ValueError(
            "rollout.weight_transport=distributed needs the trainer's master_address and a free "
            "master_port reachable by the SGLang servers"
        )
    return DistributedTransport(
        master_address, master_port, [rollout.sglang_tp] * num_engines, bucket_bytes=bucket_bytes
    )
