"""Weight sync: moving the trainer's full Hugging Face-named tensors to the rollout servers.

* :mod:`~megatron_gspo.weight_sync.transport`: the :class:`WeightTransport` interface, the client
  it talks through, buckets, :class:`SyncStats` and :class:`StableTensorStream`;
* :mod:`~megatron_gspo.weight_sync.disk`: ``disk`` (safetensors + ``/update_weights_from_disk``);
* :mod:`~megatron_gspo.weight_sync.tensor`: ``tensor`` (colocated: CUDA-IPC or shared-memory
  handles in ``/update_weights_from_tensor``);
* :mod:`~megatron_gspo.weight_sync.distributed`: ``distributed`` (a broadcast group with the
  servers' ranks and ``/update_weights_from_distributed``);
* :mod:`~megatron_gspo.weight_sync.build`: the transport ``rollout.weight_transport`` names.

The server calls are ``docs/sglang-protocol.md`` section 4; the embedded engine's loopback server
(``rollout/server.py``) answers the disk one. ``SGLangEngine.sync_weights`` wraps every sync in
the weight-update bracket, and the caller pauses and flushes first
(``rollout.types.sync_weights_paused``). All three transports are tested end to end against a real
SGLang 0.5.23 server on CPU (``tests/real_sglang``). Nothing here imports ``megatron_gspo.rollout``.
"""

from megatron_gspo.weight_sync.build import transport_from_config
from megatron_gspo.weight_sync.disk import DiskTransport, write_hf_checkpoint
from megatron_gspo.weight_sync.distributed import (
    DistributedTransport,
    free_port,
    local_address_towards,
)
from megatron_gspo.weight_sync.tensor import TensorTransport
from megatron_gspo.weight_sync.transport import (
    StableTensorStream,
    SyncStats,
    WeightTransport,
    WeightUpdateClient,
    iter_buckets,
    tensor_bytes,
)

__all__ = [
    "DiskTransport",
    "DistributedTransport",
    "StableTensorStream",
    "SyncStats",
    "TensorTransport",
    "WeightTransport",
    "WeightUpdateClient",
    "free_port",
    "iter_buckets",
    "local_address_towards",
    "tensor_bytes",
    "transport_from_config",
    "write_hf_checkpoint",
]
