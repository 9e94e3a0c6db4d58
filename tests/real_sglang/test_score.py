"""Teacher-forced scoring on a real SGLang 0.5.23 server: its prompt log-probs
(``return_logprob`` + ``logprob_start_len``, docs/distillation.md) against a float64
transformers forward of the served weights, through an extra model's engine (``models.<role>``
by URL, ``rollout/roles.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

from megatron_gspo.config import ExtraModelConfig, SGLangConfig
from megatron_gspo.rollout.auth import API_KEY_ENV
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.roles import build_role_engine
from megatron_gspo.rollout.types import RolloutEngineError
from tests.rollout.test_score import float64_log_probs

PROMPTS = [[1, 5, 7, 3, 9, 2], [4], [2, 2, 8]]
RESPONSES = [[4, 6, 8, 2, 3], [9, 1, 1], []]


def test_sglang_score_matches_a_float64_forward(fresh_server, monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, fresh_server.api_key)
    section = ExtraModelConfig(
        hf_path=str(fresh_server.model_dir),
        engine="sglang",
        sglang=SGLangConfig(urls=[fresh_server.url]),
    )
    # The served weights, in a transformers model for the float64 reference.
    reference = EmbeddedEngine(fresh_server.model)
    weights = {}
    for path in fresh_server.model_dir.glob("*.safetensors"):
        weights.update(load_file(str(path)))
    reference.sync_weights(iter(weights.items()), version=0)
    with build_role_engine("teacher", section, work_dir=str(tmp_path)) as engine:
        scores = engine.score(PROMPTS, RESPONSES)
        with pytest.raises(RolloutEngineError, match="temperature 1 only"):
            engine.score(PROMPTS, RESPONSES, temperature=0.7)
    assert [len(s) for s in scores] == [len(r) for r in RESPONSES]
    for prompt, response, score in zip(PROMPTS, RESPONSES, scores):
        if response:
            expected = float64_log_probs(reference.hf_model, prompt, response, 1.0)
            np.testing.assert_allclose(score, expected, rtol=0, atol=1e-5)
    reference.close()
