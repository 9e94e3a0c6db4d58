"""The environment rollout through the loopback HTTP engine (the SGLang client speaking
SGLang's ``/generate`` with ``input_ids`` to the embedded engine's server): the same
trajectories, log-probs and per-turn routes as the in-process engine."""

from __future__ import annotations

import torch

from megatron_gspo.config import RolloutConfig
from megatron_gspo.production.task import Task
from megatron_gspo.rollout.factory import build_rollout_engine

from .conftest import EOS, OBS, environment_producer, prompts, tiny_moe, train_config
from .scripted import ScriptedEnvironment


def test_http_engine_gives_the_in_process_trajectories(embedded, tokenizer):
    cfg = train_config(
        env={"options": {"turns": 3, "observation": [OBS, 10], "stop_token_ids": [2, 3, 4]}},
        algo={"response_length": 40},
    )
    task = Task(tokenizer, None, [], EOS)
    batch = prompts(2)
    http = build_rollout_engine(
        RolloutConfig(engine="embedded_http"), tiny_moe(), seed=5, enable_routed_experts=True
    )
    try:
        over_http = environment_producer(http, task, None, cfg, ScriptedEnvironment)
        remote = over_http.produce(batch, 3).samples
    finally:
        http.close()
    local = environment_producer(embedded, task, None, cfg, ScriptedEnvironment)
    expected = local.produce(batch, 3).samples
    assert max(int(s.turns.max()) for s in expected) >= 1, "one turn only: nothing to compare"
    for want, got in zip(expected, remote):
        assert torch.equal(want.tokens, got.tokens)
        assert torch.equal(want.loss_mask, got.loss_mask)
        assert torch.equal(want.turns, got.turns)
        assert torch.equal(want.rollout_log_probs, got.rollout_log_probs)
        assert torch.equal(want.rollout_routes, got.rollout_routes)
        assert (want.reward, want.finish_reason) == (got.reward, got.finish_reason)
