"""Structural counts of one RL step (performance anchors C5), from real one-step loop runs.

``counts_worker.py`` runs three one-step loops in a fresh process (the tiny CPU MoE, the
embedded rollout engine) and records forwards (hooks on the engine's own policy and reference
chunks), optimizer steps and every weight sync. Checked here:

* one policy forward per optimizer step (per micro-batch, and each mini-batch is one micro-batch
  here); no old-log-prob forward when the source is ``rollout`` or ``detach``; ``recompute``
  adds exactly one no-grad policy forward and the KL term exactly one reference forward per
  rollout step; no reference model at all without KL;
* a weight sync streams every rollout-model tensor exactly once (no duplicates, nothing
  missing), once per step plus the initial sync, and moves at most 1.05x the model's bytes;
* bucketing of the real stream: the tensor transport's ``iter_buckets`` and the disk
  transport's shards carry each tensor once, in far fewer calls than tensors.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("counts_worker.py")
BYTES_SLACK = 1.05


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, Path]:
    out_dir = tmp_path_factory.mktemp("counts")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    process = subprocess.run(
        [sys.executable, str(WORKER), str(out_dir)],
        cwd=out_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-5000:]
    return json.loads((out_dir / "results.json").read_text()), out_dir


@pytest.mark.parametrize("scenario", ["rollout", "detach"])
def test_one_policy_forward_per_optimizer_step_and_no_old_log_prob_forward(runs, scenario):
    result = runs[0][scenario]
    counts = result["counts"]
    assert result["optimizer_steps"] == (4 if scenario == "rollout" else 1)
    assert result["micro_batches"] == [1.0] * result["optimizer_steps"]
    assert counts.get("policy_grad", 0) == result["optimizer_steps"]
    assert counts.get("policy_no_grad", 0) == 0, "an old-log-prob forward ran"
    assert counts.get("reference", 0) == 0, "a reference forward ran without KL"


def test_recompute_and_kl_add_exactly_their_forwards(runs):
    result = runs[0]["recompute_kl"]
    counts = result["counts"]
    assert result["optimizer_steps"] == 2
    assert result["micro_batches"] == [1.0, 1.0]
    assert counts.get("policy_grad", 0) == 2
    # The whole rollout batch (16 samples) fits one micro-batch: one recompute forward, one
    # reference forward per rollout step.
    assert counts.get("policy_no_grad", 0) == 1
    assert counts.get("reference", 0) == 1


@pytest.mark.parametrize("scenario", ["rollout", "detach", "recompute_kl"])
def test_weight_sync_streams_each_tensor_once_within_model_bytes(runs, scenario):
    result = runs[0][scenario]
    syncs = result["syncs"]
    steps = len(result["records"])
    assert [s["version"] for s in syncs] == list(range(steps + 1))  # initial + one per step
    trainer_bytes = result["model_bytes"]["trainer"]
    rollout_bytes = result["model_bytes"]["rollout"]
    for sync in syncs:
        names = sync["names"]
        assert len(names) == len(set(names)), "a tensor was streamed twice"
        assert set(names) == set(sync["rollout_disk_names"]), "stream != the rollout model"
        assert sync["stats"]["num_tensors"] == len(names)
        assert sync["stats"]["num_bytes"] == sync["bytes"] == rollout_bytes
        assert sync["bytes"] <= BYTES_SLACK * trainer_bytes
        assert sync["stats"]["num_buckets"] == 1  # the embedded engine: one in-process commit


def _stream(runs: tuple[dict, Path], scenario: str) -> list[tuple[str, torch.Tensor]]:
    """The last weight sync of ``scenario``: its tensors, in the order they were streamed."""
    from safetensors.torch import load_file

    results, out_dir = runs
    tensors = load_file(str(out_dir / f"{scenario}_stream.safetensors"))
    return [(name, tensors[name]) for name in results[scenario]["syncs"][-1]["names"]]


@pytest.mark.parametrize("bucket_kib", [32, 128, 1 << 20])
def test_tensor_transport_buckets_carry_each_tensor_once(runs, bucket_kib):
    from megatron_gspo.weight_sync import iter_buckets, tensor_bytes

    stream = _stream(runs, "rollout")
    bucket_bytes = bucket_kib << 10
    total = sum(tensor_bytes(t) for _, t in stream)
    buckets = list(iter_buckets(iter(stream), bucket_bytes))
    names = [name for bucket in buckets for name, _ in bucket]
    assert names == [name for name, _ in stream]  # each once, in stream order
    sizes = [sum(tensor_bytes(t) for _, t in bucket) for bucket in buckets]
    for index, bucket in enumerate(buckets):
        assert sizes[index] <= bucket_bytes or len(bucket) == 1
        if index + 1 < len(buckets):  # next-fit: a bucket closes only when the next tensor
            assert sizes[index] + tensor_bytes(buckets[index + 1][0][1]) > bucket_bytes
    assert len(buckets) <= 2 * math.ceil(total / bucket_bytes)
    assert len(buckets) < len(stream)  # far fewer update calls than tensors
    if bucket_bytes >= total:
        assert len(buckets) == 1


def test_disk_transport_shards_carry_each_tensor_once(runs, tmp_path):
    from safetensors.torch import load_file

    from megatron_gspo.weight_sync import iter_buckets, write_hf_checkpoint

    stream = _stream(runs, "rollout")
    shard_bytes = 64 << 10
    num_tensors, num_bytes = write_hf_checkpoint(
        iter(stream), str(tmp_path), shard_bytes=shard_bytes, config_json="{}"
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert num_tensors == len(stream) == len(index["weight_map"])
    assert num_bytes == index["metadata"]["total_size"]
    assert len(shards) == len(list(iter_buckets(iter(stream), shard_bytes)))
    loaded = {}
    for shard in shards:
        loaded.update(load_file(str(shard)))
    assert sorted(loaded) == sorted(name for name, _ in stream)
    for name, tensor in stream:
        assert torch.equal(loaded[name], tensor)
