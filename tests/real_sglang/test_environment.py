"""Multi-turn rollouts on a real SGLang 0.5.23 server: an environment's episodes, token in and
token out, through the project's SGLang client (``/generate`` with ``input_ids``).

Each trajectory (prompt, model turns, the environment's observations between them) is checked
against transformers' float32 forward over the whole trajectory, on the weights the server
loaded: the log-probs of every model token of every turn, and the R3 routes of every token, the
observations' included (they come from the prefill of the turn after them)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from envs.conftest import (
    EOS,
    OBS,
    environment_producer,
    merging_tokenizer,
    prompts,
    train_config,
)
from envs.scripted import ScriptedEnvironment

from megatron_gspo.production.task import Task
from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout


@pytest.fixture(scope="module")
def episodes(sglang_server):
    """Two prompts x two episodes of three turns each, one SGLang call per turn."""
    sglang_server.reset()
    engine = SGLangEngine(
        [sglang_server.url],
        RouteLayout.from_model_config(sglang_server.model),
        api_key=sglang_server.api_key,
        request_timeout_s=120,
    )
    cfg = train_config(
        env={"options": {"turns": 3, "observation": [OBS, 10], "stop_token_ids": [2, 3, 4]}},
        algo={"response_length": 40},
        model=dataclasses.asdict(sglang_server.model),
    )
    task = Task(merging_tokenizer(), None, [], EOS)
    try:
        producer = environment_producer(engine, task, None, cfg, ScriptedEnvironment)
        yield producer.produce(prompts(2), step=3).samples
    finally:
        engine.close()


@pytest.fixture(scope="module")
def reference(sglang_server):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(sglang_server.model_dir), dtype=torch.float32
    )
    return model.eval()


def test_every_turn_has_the_log_probs_of_the_whole_trajectory(episodes, reference):
    assert max(int(s.turns.max()) for s in episodes) >= 1, "one turn only: nothing to check"
    worst = 0.0
    for sample in episodes:
        tokens = sample.tokens.tolist()
        with torch.no_grad():
            logits = reference(torch.tensor([tokens])).logits[0].float()
        table = torch.log_softmax(logits, dim=-1)
        start = sample.prompt_length
        expected = table[torch.arange(start - 1, len(tokens) - 1), sample.tokens[start:]]
        model_tokens = sample.loss_mask
        assert bool((sample.turns[~model_tokens] == -1).all())
        assert bool((sample.rollout_log_probs[~model_tokens] == 0).all())
        gap = (sample.rollout_log_probs[model_tokens] - expected[model_tokens]).abs().max()
        worst = max(worst, float(gap))
    assert worst < 1e-5, worst


def test_routes_cover_every_token_of_the_trajectory(episodes, reference, sglang_server):
    layout = RouteLayout.from_model_config(sglang_server.model)
    for sample in episodes:
        tokens = sample.tokens.tolist()
        routes = sample.rollout_routes
        assert routes.shape == (len(tokens) - 1, len(layout.moe_layer_indices), layout.top_k)
        _, expected = forward_with_routes(reference, tokens[:-1])
        got = np.sort(routes.numpy().astype(np.int64), axis=-1)
        assert np.array_equal(got, np.sort(expected.numpy(), axis=-1))
