"""The ``distributed`` weight transport (disaggregated servers): the trainer is rank 0 of a
process group with every server's ranks and broadcasts each tensor (NCCL on GPUs, gloo on CPU),
while ``/update_weights_from_distributed`` calls issued concurrently tell the servers what arrives
(``docs/sglang-protocol.md`` section 4), in the same order. Also the rendezvous helpers: a free
port, and this machine's address towards a server.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Optional
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_gspo.weight_sync.transport import (
    SyncStats,
    WeightTransport,
    WeightUpdateClient,
    iter_buckets,
    tensor_bytes,
    with_last_flag,
)

logger = logging.getLogger(__name__)


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
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        raise ValueError("the trainer is rank 0 of the weight-update group")
    # Waits until every server has connected (they were asked to join before this call).
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
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
        self._client: Optional[WeightUpdateClient] = None

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

    def _ensure_group(self, client: WeightUpdateClient) -> None:
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
        self, client: WeightUpdateClient, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        self._ensure_group(client)
        start = time.perf_counter()
        num_tensors = num_bytes = num_buckets = 0
        for bucket, is_last in with_last_flag(iter_buckets(named_tensors, self.bucket_bytes)):
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
        for url in self._client.urls:
            try:
                self._client.post_json(
                    url, "/destroy_weights_update_group", {"group_name": self.group_name}
                )
            except Exception as error:  # a stopped server has no group left to destroy
                logger.warning("%s: destroying weight-update group failed: %s", url, error)
        dist.destroy_process_group(self._group)
        self._group = self._client = None


def _post_once(
    client: WeightUpdateClient, url: str, path: str, payload: Any, timeout_s: float
) -> Any:
    """POST that is never repeated after a time-out: the server may be inside the collective.
    The client judges the answer (non-200 or ``success: false`` raise its engine error)."""
    return client.post_json(url, path, payload, timeout=timeout_s, retry_timeouts=False)
