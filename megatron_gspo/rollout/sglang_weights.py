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

All three are tested end to end against a real SGLang 0.5.23 server on CPU
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
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Optional
from urllib.parse import urlsplit

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's tensor reductions with ForkingPickler

from megatron_gspo.rollout.types import RolloutEngineError, SyncStats

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
        for bucket, is_last in _with_last_flag(iter_buckets(named_tensors, self.bucket_bytes)):
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


def init_update_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 600.0,
) -> Any:
    """A process group of its own (trainer rank 0 plus the servers' ranks) beside the default one.

    The trainer already belongs to its default group (torchrun's world) and an SGLang server to
    its own, so the update group cannot come from ``init_process_group``; like SGLang's
    ``init_custom_process_group`` (which the servers run on their side, the pattern of verl and
    OpenRLHF), it meets through a TCP store at ``master_address:master_port`` and is built with
    torch's ``_new_process_group_helper``. Rank 0 hosts that store itself: under torchrun,
    ``rendezvous("tcp://...")`` would only connect to a store that torchrun's agent hosts, and
    nobody hosts one on this port. Group rank ``r`` is global rank ``r`` for torch's collectives.
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        raise ValueError("the trainer is rank 0 of the weight-update group")
    # Waits until every server has connected (they were asked to join before this call).
    store = torch.distributed.TCPStore(
        master_address, master_port, world_size, is_master=True, timeout=timeout
    )
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        c10d.PrefixStore(group_name, store),
        group_name=group_name,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {index: index for index in range(world_size)}
    return group


def free_port(address: str) -> int:
    """A TCP port that is free on ``address`` now."""
    with socket.socket() as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


def local_address_towards(url: str) -> str:
    """This machine's address on the route to the server at ``url``: the address that server
    can reach the trainer on (no packet is sent; a UDP ``connect`` only selects the route).

    A loopback server gives ``127.0.0.1``; a server on another node gives the address of the
    interface that leads there, which is what the weight-update group must listen on. torchrun's
    ``MASTER_ADDR`` is not used: it names the rendezvous host, which need not be the driver's.
    """
    parsed = urlsplit(url if "://" in url else f"http://{url}")
    if not parsed.hostname:
        raise ValueError(f"no host in server URL {url!r}")
    family, _, _, _, address = socket.getaddrinfo(
        parsed.hostname, parsed.port or 80, type=socket.SOCK_DGRAM
    )[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        return sock.getsockname()[0]


class DistributedTransport(WeightTransport):
    """Disaggregated transport: the trainer process calling ``sync`` is rank 0 of a process group
    with every server's ranks, and broadcasts each tensor (NCCL on GPUs, gloo on CPU).

    Args:
        master_address / master_port: rendezvous of the update group, reachable by the servers;
            port 0 picks a free port on ``master_address`` when the group is formed (first sync).
        engine_world_sizes: ranks of each server (tp x pp), in the client's URL order.
        backend: ``nccl`` (tensors are broadcast from the current CUDA device) or ``gloo``
            (from host memory; SGLang on CPU).
        group_name: default ``megatron_gspo_weight_sync_<random>``: a server outlives a trainer
            that died without destroying its group, and SGLang refuses a second group of the
            same name.
    """

    name = "distributed"

    def __init__(
        self,
        master_address: str,
        master_port: int,
        engine_world_sizes: list[int],
        *,
        group_name: Optional[str] = None,
        backend: str = "nccl",
        bucket_bytes: int = 512 << 20,
        timeout_s: float = 600.0,
    ):
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend {backend!r} is not nccl or gloo")
        self.master_address = master_address
        self.master_port = master_port
        self.engine_world_sizes = list(engine_world_sizes)
        self.group_name = group_name or f"megatron_gspo_weight_sync_{uuid.uuid4().hex[:12]}"
        self._configured_port = master_port
        self.backend = backend
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._group: Any = None
        self._client: Any = None

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
        if len(self.engine_world_sizes) != len(client.urls):
            raise ValueError(
                f"{len(self.engine_world_sizes)} engine world sizes for {len(client.urls)} servers"
            )
        if not self.master_port:
            self.master_port = free_port(self.master_address)
        payloads = init_group_payloads(
            self.master_address,
            self.master_port,
            self.engine_world_sizes,
            self.group_name,
            self.backend,
        )
        # The servers block in the rendezvous until rank 0 joins: post first, then join. A call
        # that times out is not repeated (the server would queue a second rendezvous).
        pending = self._concurrently(
            [
                lambda url=url, body=body: _post_once(
                    client, url, "/init_weights_update_group", body, self.timeout_s
                )
                for url, body in zip(client.urls, payloads)
            ]
        )
        # On failure the HTTP threads are left to time out (daemons): waiting for servers that
        # wait for this process would only turn the error into a hang.
        self._group = init_update_group(
            self.backend,
            self.master_address,
            self.master_port,
            payloads[0]["world_size"],
            0,
            self.group_name,
            self.timeout_s,
        )
        self._join(pending)
        self._client = client

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
                flush_cache=is_last and getattr(client, "flushes_on_update", True),
                weight_version=str(version) if is_last else None,
            )
            pending = self._concurrently(
                [
                    lambda url=url, body=payload: _post_once(
                        client, url, "/update_weights_from_distributed", body, self.timeout_s
                    )
                    for url in client.urls
                ]
            )
            for _, tensor in bucket:
                tensor = tensor.detach()
                tensor = tensor.cuda() if self.backend == "nccl" else tensor.cpu()
                dist.broadcast(tensor.contiguous(), group=self._group, group_src=0)
            self._join(pending)
            num_tensors += len(bucket)
            num_bytes += sum(tensor_bytes(t) for _, t in bucket)
            num_buckets += 1
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start, num_buckets)

    def reset(self) -> None:
        """A restarted server is in no group: destroy the old one (best effort) and form a new
        one, under a new name, with every server at the next sync."""
        self.close()
        self.group_name = f"megatron_gspo_weight_sync_{uuid.uuid4().hex[:12]}"
        self.master_port = self._configured_port  # 0: a free port again

    def close(self) -> None:
        """Destroy the group on the servers (best effort: they may be gone) and here."""
        if self._group is None:
            return
        import torch.distributed as dist

        for url in self._client.urls:
            try:
                self._client.post_json(
                    url, "/destroy_weights_update_group", {"group_name": self.group_name}
                )
            except Exception as error:  # a stopped server has no group left to destroy
                logger.warning("%s: destroying weight-update group failed: %s", url, error)
        dist.destroy_process_group(self._group)
        self._group = self._client = None


def _post_once(client: Any, url: str, path: str, payload: Any, timeout_s: float) -> Any:
    """POST that is never repeated after a time-out: the server may be inside the collective."""
    response = client.request("POST", url, path, payload, timeout=timeout_s, retry_timeouts=False)
    if response.status_code != 200:
        raise RolloutEngineError(f"{url}{path}: HTTP {response.status_code}: {response.text[:500]}")
    body = response.json()
    if isinstance(body, dict) and body.get("success") is False:
        raise RolloutEngineError(f"{url}{path}: refused: {body.get('message', body)}")
    return body


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
