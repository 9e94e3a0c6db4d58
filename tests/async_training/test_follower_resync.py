"""The other ranks' side of a resync (docs/async.md, "A rollout engine that dies"): rank 0
broadcasts ``WEIGHTS_WANTED`` instead of a batch when a restarted server waits for the trainer's
weights; every follower then streams the weights (a collective gather in a real run) and goes
on waiting for the batch. Two real processes over gloo."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.driver.follower import DriverFollower
from megatron_gspo.driver.interface import WEIGHTS_WANTED, broadcast_samples


def worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    streamed: list[str] = []

    def weights():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            streamed.append(name)
            yield name, torch.zeros(2)

    try:
        if rank == 0:  # two resyncs (two servers came back one after the other), then the batch
            broadcast_samples(WEIGHTS_WANTED)
            broadcast_samples(WEIGHTS_WANTED)
            broadcast_samples(["the batch"])
        else:
            batch = DriverFollower(weights).rollout(7)
            with open(os.path.join(out_dir, "follower.json"), "w") as handle:
                json.dump({"samples": batch.samples, "streamed": streamed}, handle)
    finally:
        dist.destroy_process_group()


def test_follower_streams_the_weights_when_rank_0_asks_then_takes_the_batch():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(free_port(), out_dir), nprocs=2, join=True)
        with open(os.path.join(out_dir, "follower.json")) as handle:
            result = json.load(handle)
    assert result["samples"] == ["the batch"]
    assert result["streamed"] == ["model.embed_tokens.weight", "lm_head.weight"] * 2
