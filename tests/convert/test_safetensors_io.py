"""Streaming safetensors writer, lazy reader and atomic output directories."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_gspo.convert.mapping import ConversionError
from megatron_gspo.convert.safetensors_io import (
    HFCheckpointReader,
    PlannedTensor,
    ShardedSafetensorsWriter,
    atomic_directory,
    plan_shards,
)


def sample_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=generator),
        "b.weight": torch.randn(3, generator=generator).to(torch.bfloat16),
        "c.scalar": torch.tensor(2.5, dtype=torch.float64),
        "d.ids": torch.arange(11, dtype=torch.int64),
        "e.half": torch.randn(2, 2, 3, generator=generator).to(torch.float16),
        "f.mask": torch.tensor([True, False, True]),
    }


def plan_of(tensors: dict[str, torch.Tensor]) -> list[PlannedTensor]:
    return [PlannedTensor(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]


def test_out_of_order_writes_give_valid_shards(tmp_path):
    tensors = sample_tensors()
    with ShardedSafetensorsWriter(str(tmp_path), plan_of(tensors), max_shard_bytes=64) as writer:
        for name in reversed(list(tensors)):
            writer.write(name, tensors[name])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    loaded = {}
    for file_name in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(tmp_path / file_name))  # safetensors validates the format
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype
        assert torch.equal(loaded[name], tensor), name
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )


def test_plan_respects_the_limit_and_keeps_order():
    planned = [
        PlannedTensor(f"t{i}", (size,), torch.float32) for i, size in enumerate([4, 4, 10, 1, 1])
    ]
    shards = plan_shards(planned, max_shard_bytes=32)
    assert [[t.name for t in shard] for shard in shards] == [["t0", "t1"], ["t2"], ["t3", "t4"]]


def test_writer_rejects_what_was_not_planned(tmp_path):
    tensors = sample_tensors()
    writer = ShardedSafetensorsWriter(str(tmp_path), plan_of(tensors), max_shard_bytes=10**6)
    with pytest.raises(ConversionError, match="not in the export plan"):
        writer.write("z", torch.zeros(1))
    with pytest.raises(ConversionError, match="planned"):
        writer.write("a.weight", torch.zeros(5, 7))
    with pytest.raises(ConversionError, match="planned"):
        writer.write("a.weight", tensors["a.weight"].double())
    writer.write("a.weight", tensors["a.weight"])
    with pytest.raises(ConversionError, match="twice"):
        writer.write("a.weight", tensors["a.weight"])
    with pytest.raises(ConversionError, match="never produced"):
        writer.close()


def test_failed_export_leaves_no_directory(tmp_path):
    tensors = sample_tensors()
    out = tmp_path / "out"
    with (
        pytest.raises(ConversionError, match="never produced"),
        atomic_directory(str(out)) as temporary,
        ShardedSafetensorsWriter(temporary, plan_of(tensors), 10**6) as writer,
    ):
        writer.write("a.weight", tensors["a.weight"])
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_reader_handles_single_file_unindexed_shards_and_bin_only(tmp_path):
    tensors = sample_tensors()
    single = tmp_path / "single"
    single.mkdir()
    save_file(tensors, single / "model.safetensors")
    several = tmp_path / "several"
    several.mkdir()
    names = list(tensors)
    save_file({n: tensors[n] for n in names[:3]}, several / "part-1.safetensors")
    save_file({n: tensors[n] for n in names[3:]}, several / "part-2.safetensors")
    for directory in (single, several):
        with HFCheckpointReader(str(directory)) as reader:
            assert sorted(reader.names()) == sorted(tensors)
            for name, tensor in tensors.items():
                assert reader.shape(name) == tuple(tensor.shape)
                assert torch.equal(reader.get(name), tensor)
            with pytest.raises(ConversionError, match="no tensor 'missing'"):
                reader.get("missing")
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    torch.save(tensors, bin_only / "pytorch_model.bin")
    with pytest.raises(ConversionError, match="safe_serialization"):
        HFCheckpointReader(str(bin_only))
