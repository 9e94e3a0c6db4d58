"""The RL loop from the command line with ``rollout.engine=sglang`` on the real server.

Each run starts by syncing its own weights into the server (so runs can share it), samples with
SGLang, recomputes the old log-probs with the trainer and logs ``rollout_log_prob_abs_diff``, the
mean |trainer - SGLang| log-prob over response tokens: float32 rounding (about 1e-7) when the
engines hold the same weights, far larger otherwise. The distributed transport's rendezvous is
derived by the entry point (this machine's address towards the server, a free port), also under
torchrun, where the driver's default process group already exists.
"""

from __future__ import annotations

import pytest
from e2e.harness import GRPO, TINY, assert_required_metrics, run_train

from megatron_gspo.rollout.auth import API_KEY_ENV

MODEL_BYTES = 701_952
"""fp32 bytes of the CPU demo model (the server's shape): what every sync must move."""


@pytest.fixture
def sglang_run(fresh_server, monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, fresh_server.api_key)

    def run(name: str, overrides: list[str], nproc: int = 1):
        launch = run_train(
            tmp_path / name,
            [
                "steps=2",
                *TINY,
                "rollout.engine=sglang",
                f"rollout.sglang.urls=[{fresh_server.url}]",
                *overrides,
            ],
            nproc=nproc,
            timeout=300,
        )
        records = launch.metrics()
        assert_required_metrics(records, steps=2)
        for record in records:
            assert record["rollout_log_prob_abs_diff"] < 2e-6, record["rollout_log_prob_abs_diff"]
            assert record["weight_sync_bytes"] == MODEL_BYTES
        # The server holds the weights of the run's last sync (after step 2).
        assert fresh_server.get("/model_info")["weight_version"] == "2"
        return records

    return run


def test_grpo_with_r3_and_tensor_weight_sync(sglang_run):
    """R3: the old log-probs are recomputed replaying SGLang's routes, so the gap to SGLang's
    log-probs stays at rounding (native routing of the CPU demo's near-tied routers would not
    guarantee it)."""
    sglang_run("grpo_r3", [*GRPO, "algo.routing_replay=r3", "rollout.weight_transport=tensor"])


@pytest.mark.slow
@pytest.mark.distributed
def test_gspo_tp2_with_distributed_weight_sync(sglang_run):
    """GSPO (the default loss) under torchrun, two processes (tensor parallel): rank 0 gathers
    the shards and is rank 0 of the update group, whose rendezvous the entry point derives; the
    other rank only takes part in the gathers. The full run's (90 s of CPU on 2 cores): CI
    syncs into the real server's update group in test_trainer_sync.py (``sync_by_distributed``),
    derives the rendezvous in tests/weight_sync/test_transports.py and gathers tp x ep shards
    under torchrun in tests/e2e/test_multinode.py."""
    sglang_run("gspo_tp2", ["parallel.tp=2", "rollout.weight_transport=distributed"], nproc=2)
