"""The training engine against the real SGLang server (``trainer_worker.py``, a fresh process).

* weight sync by every transport the project offers on CPU (disk, tensor over shared memory,
  distributed over gloo): afterwards the server's log-probs equal the trainer's recomputation
  (R3 replaying the server's routes) to float32 rounding, the server reports the new weight
  version, and the transport reports the model's exact tensor count and bytes;
* R3: the routes SGLang returns are the ones the trainer routes natively with the same weights,
  and replaying them is what reproduces SGLang's log-probs (rolled routes do not).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from megatron_gspo.rollout.auth import API_KEY_ENV

from .server import run_python

WORKER = Path(__file__).with_name("trainer_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
CHECKS = [
    "sync_by_disk",
    "sync_by_tensor",
    "sync_by_distributed",
    "r3_replay_is_what_reproduces_the_log_probs",
]


@pytest.fixture(scope="module")
def results(sglang_server, tmp_path_factory) -> dict:
    sglang_server.reset()
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env[API_KEY_ENV] = sglang_server.api_key
    env["OMP_NUM_THREADS"] = "1"  # the server shares the two cores
    log = tmp_path_factory.mktemp("trainer_worker") / "worker.log"
    output = run_python([sys.executable, str(WORKER), sglang_server.url], env, log, timeout=500)
    return json.loads(output.strip().splitlines()[-1])


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_trainer_against_sglang(results, check):
    assert results[check] == "ok", results[check]
