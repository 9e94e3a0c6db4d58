"""The weight transport that ``rollout.weight_transport`` names, built from the configuration."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from megatron_gspo.config import ModelConfig, RolloutConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.weight_sync.disk import DiskTransport
from megatron_gspo.weight_sync.distributed import DistributedTransport, local_address_towards
from megatron_gspo.weight_sync.tensor import TensorTransport
from megatron_gspo.weight_sync.transport import WeightTransport


def transport_from_config(
    rollout: RolloutConfig,
    model: ModelConfig,
    *,
    num_engines: int = 1,
    disk_dir: Optional[str] = None,
    master_address: Optional[str] = None,
    master_port: Optional[int] = None,
    urls: Sequence[str] = (),
) -> WeightTransport:
    """The transport ``rollout.weight_transport`` names.

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
            config_json = hf_config_from_model_config(model).to_json_string()
        return DiskTransport(disk_dir, config_source_dir=model.hf_path, config_json=config_json)
    if rollout.weight_transport == "tensor":
        return TensorTransport(bucket_bytes, num_engine_tp_ranks=rollout.sglang.tp)
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
        [rollout.sglang.tp] * num_engines,
        backend="nccl" if torch.cuda.is_available() else "gloo",
        bucket_bytes=bucket_bytes,
    )
