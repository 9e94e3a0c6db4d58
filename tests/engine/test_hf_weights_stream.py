"""The trainer's weight stream moves each byte once: ``iter_hf_weights`` yields views of the live
parameters at tp = 1 (no clones), a receiver may stage them by reference, and nothing it keeps
aliases the trainer (``hf_weights_stream_worker.py``, one process, untied MoE and tied dense)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from worker_launch import run_worker, worker_command

WORKER = Path(__file__).with_name("hf_weights_stream_worker.py")


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(run_worker(worker_command(WORKER, 1), timeout=300).splitlines()[-1])


@pytest.mark.parametrize("case", ["moe", "dense"])
def test_stream_is_views_and_the_synced_engine_owns_its_weights(report, case):
    result = report[case]
    assert result["stable_stream"]
    assert result["tensors"] > 0
    # No clone on the trainer side (only q/k/v, regrouped from the interleaved qkv, are new);
    # the default iter_full_megatron_weights still clones.
    assert all(
        name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
        for name in result["not_views_of_parameters"]
    ), result["not_views_of_parameters"]
    assert "model.embed_tokens.weight" not in result["not_views_of_parameters"]
    assert result["clones_share_no_storage"]
    # Borrowed load: every tensor once, bit for bit, exactly the stream's bytes.
    assert result["synced_names_match"] and result["synced_bit_equal"]
    assert result["sync_counts"] == [result["tensors"], result["stream_bytes"]]
    # The optimizer step changes the trainer but neither the engine nor the clones.
    assert result["step_skipped"] == 0.0
    assert result["trainer_tensors_changed_by_step"] > 0
    assert result["rollout_unchanged_by_step"]
    assert result["clones_unchanged_by_step"]
