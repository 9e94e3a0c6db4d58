"""Weight transports: disk checkpoints for real; tensor/distributed payloads (their transfer
needs CUDA IPC or NCCL, so only the request bodies are checked here)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import stat

import pytest
import torch
import torch.multiprocessing
import transformers

from megatron_gspo.config import RolloutConfig, SGLangConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.weight_loader import iter_safetensors_directory
from megatron_gspo.weight_sync import (
    DiskTransport,
    DistributedTransport,
    iter_buckets,
    local_address_towards,
    transport_from_config,
    write_hf_checkpoint,
)
from megatron_gspo.weight_sync.distributed import distributed_update_payload, init_group_payloads
from megatron_gspo.weight_sync.tensor import serialize_flattened_bucket, tensor_update_payload
from tests.rollout.conftest import tiny_model_config


def test_buckets_keep_order_and_size():
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 20, 5, 100, 1])]
    buckets = list(iter_buckets(tensors, bucket_bytes=25 * 4))
    assert [[name for name, _ in bucket] for bucket in buckets] == [
        ["t0"],
        ["t1", "t2"],
        ["t3"],
        ["t4"],
    ]


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
def test_written_checkpoint_loads_in_transformers(architecture, tmp_path):
    config = tiny_model_config(architecture)
    engine = EmbeddedEngine(config, seed=3)
    count, size = write_hf_checkpoint(
        engine.hf_state(),
        str(tmp_path),
        shard_bytes=20_000,  # several shards
        config_json=hf_config_from_model_config(config).to_json_string(),
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert count == len(index["weight_map"]) and size == index["metadata"]["total_size"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
    for name, param in engine.hf_model.named_parameters():
        assert torch.equal(param, dict(loaded.named_parameters())[name]), name
    names = sorted(name for name, _ in iter_safetensors_directory(str(tmp_path)))
    assert names == engine._layout.disk_names


def test_checkpoint_files_follow_the_umask(tmp_path):
    """safetensors creates 0600 files; the shards of a checkpoint other users read get the
    mode of any file this process creates."""
    previous = os.umask(0o027)
    try:
        write_hf_checkpoint([("a", torch.zeros(2))], str(tmp_path), config_json="{}")
    finally:
        os.umask(previous)
    shard = tmp_path / "model-00001-of-00001.safetensors"
    assert stat.S_IMODE(shard.stat().st_mode) == 0o640


def test_checkpoint_refuses_repeated_names(tmp_path):
    with pytest.raises(ValueError, match="given twice"):
        write_hf_checkpoint([("a", torch.zeros(2)), ("a", torch.zeros(2))], str(tmp_path))


def test_disk_transport_from_config_writes_the_model_config(tmp_path):
    model = tiny_model_config()
    transport = transport_from_config(
        RolloutConfig(weight_transport="disk"), model, disk_dir=str(tmp_path)
    )
    assert isinstance(transport, DiskTransport)
    assert json.loads(transport.config_json)["architectures"] == ["Qwen3MoeForCausalLM"]


def test_tensor_payload():
    payload = tensor_update_payload("QUJD", 4, flush_cache=True, weight_version="7")
    assert payload["serialized_named_tensors"] == ["QUJD"] * 4
    assert payload["load_format"] == "flattened_bucket" and payload["weight_version"] == "7"


def test_cpu_bucket_travels_as_shared_memory_without_sglang():
    """A CPU bucket is one uint8 buffer shared by /dev/shm file name, with SimpleNamespace
    metadata: unpickled, it rebuilds every tensor bit for bit (SGLang does the same; tested
    against a real server in tests/real_sglang)."""
    bucket = [
        ("a.weight", torch.arange(6.0).reshape(2, 3)),
        ("b", torch.ones(5, dtype=torch.bfloat16)),
        ("c", torch.arange(4, dtype=torch.int64)),
    ]
    serialized, keep_alive = serialize_flattened_bucket(bucket)
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    assert len(serialized) < 2000  # a handle, not the data
    data = pickle.loads(base64.b64decode(serialized))
    flat = data["flattened_tensor"]
    # b's 10 bytes end at 34: c starts at 40, aligned for int64.
    assert flat.dtype == torch.uint8 and flat.numel() == keep_alive.numel() == 24 + 10 + 6 + 32
    for (name, tensor), meta in zip(bucket, data["metadata"]):
        assert (meta.name, meta.shape, meta.dtype) == (name, tensor.shape, tensor.dtype)
        rebuilt = flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        assert torch.equal(rebuilt, tensor) and meta.numel == meta.end_idx - meta.start_idx


def test_distributed_payloads():
    payloads = init_group_payloads("10.0.0.1", 29600, [4, 4, 2], "g")
    assert [p["rank_offset"] for p in payloads] == [1, 5, 9]
    assert {p["world_size"] for p in payloads} == {11}
    bucket = [("a.weight", torch.zeros(3, 2, dtype=torch.bfloat16)), ("b", torch.zeros(5))]
    body = distributed_update_payload(bucket, "g", flush_cache=False, weight_version=None)
    assert body["names"] == ["a.weight", "b"]
    assert body["dtypes"] == ["bfloat16", "float32"] and body["shapes"] == [[3, 2], [5]]
    with pytest.raises(ValueError, match="weight_sync_address"):
        transport_from_config(RolloutConfig(weight_transport="distributed"), tiny_model_config())
    transport = transport_from_config(
        RolloutConfig(weight_transport="distributed", sglang=SGLangConfig(tp=2)),
        tiny_model_config(),
        num_engines=3,
        master_address="10.0.0.1",
        master_port=29600,
    )
    assert isinstance(transport, DistributedTransport) and transport.engine_world_sizes == [2, 2, 2]
    assert transport.backend == "gloo"  # no GPU in this process


def test_distributed_rendezvous_is_derived_from_the_server_urls():
    """Without rollout.weight_sync_address the group listens on this machine's address towards
    the first server (loopback for local servers), on a free port picked at the first sync;
    the group name is unique per transport (a server outlives a crashed trainer's group)."""
    rollout = RolloutConfig(weight_transport="distributed")
    first = transport_from_config(
        rollout, tiny_model_config(), urls=["http://localhost:30000", "http://127.0.0.1:30001"]
    )
    second = transport_from_config(rollout, tiny_model_config(), urls=["http://127.0.0.1:1"])
    assert (first.master_address, first.master_port) == ("127.0.0.1", 0)
    assert first.group_name != second.group_name
    assert local_address_towards("127.0.0.2:8000") == "127.0.0.1"
    configured = transport_from_config(
        RolloutConfig(
            weight_transport="distributed", weight_sync_address="10.1.2.3", weight_sync_port=29700
        ),
        tiny_model_config(),
        urls=["http://127.0.0.1:1"],
    )
    assert (configured.master_address, configured.master_port) == ("10.1.2.3", 29700)


def test_flattened_bucket_serialisation_with_sglang():
    """Runs only where sglang imports (the GPU image); the CPU CI has no sglang."""
    pytest.importorskip("sglang.srt.weight_sync.tensor_bucket")
    from sglang.srt.utils import MultiprocessingSerializer

    bucket = [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    serialized, _ = serialize_flattened_bucket(bucket)
    data = MultiprocessingSerializer.deserialize(serialized)
    assert [m.name for m in data["metadata"]] == ["a", "b"]
