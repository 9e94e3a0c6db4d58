"""The ``tensor`` weight transport (colocated servers): each bucket is one flattened buffer whose
*handle* travels in ``/update_weights_from_tensor`` (``load_format="flattened_bucket"``): CUDA-IPC
on GPUs, a shared-memory file on CPU. The buffer must stay alive until the call returns (reusing
it earlier corrupted weights in slime#929).

The one ``sglang`` import of the trainer is here, for CUDA tensors only (SGLang's device-UUID
patch of torch's CUDA-IPC handles).
"""

from __future__ import annotations

import base64
import io
import logging
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

from megatron_gspo.weight_sync.transport import (
    SyncStats,
    WeightTransport,
    WeightUpdateClient,
    iter_buckets,
    tensor_bytes,
    with_last_flag,
)

logger = logging.getLogger(__name__)


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
        # Lazy: sglang is installed only in the GPU image, and only CUDA buffers need its patch.
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
        self, client: WeightUpdateClient, named_tensors: Iterator[tuple[str, Any]], version: int
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
