"""Teacher-forced scoring (``RolloutEngine.score``) of the embedded engine against a float64
transformers forward, and the engines of the extra models (``models.<role>``,
``rollout/roles.py``): built from their HF directories, released by the exit stack, checked
before start."""

from __future__ import annotations

import copy
from contextlib import ExitStack

import numpy as np
import pytest
import torch

from megatron_gspo.config import ExtraModelConfig, TrainConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.data.tokenizer import build_byte_tokenizer, build_synthetic_tokenizer
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.roles import build_role_engines, role_start_problems
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError
from megatron_gspo.weight_sync import write_hf_checkpoint
from tests.rollout.conftest import tiny_model_config

PROMPTS = [[1, 5, 7, 3], [9, 2], [4, 4, 4, 4, 4, 4, 8], [6]]
RESPONSES = [[2, 8, 1], [7, 7, 7, 7, 7], [], [3, 90, 11, 5]]


def float64_log_probs(hf_model, prompt, response, temperature: float) -> np.ndarray:
    """``log_softmax(logits / T)`` of ``response`` given ``prompt``: one float64 eager forward
    of the whole sequence (no padding, no batch)."""
    model64 = copy.deepcopy(hf_model).double()
    model64.set_attn_implementation("eager")
    model64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    with torch.no_grad():
        logits = model64(input_ids=torch.tensor([list(prompt) + list(response)])).logits[0]
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
    return log_probs[positions, torch.tensor(response, dtype=torch.long)].numpy()


@pytest.fixture(scope="module")
def engine():
    with EmbeddedEngine(tiny_model_config(), seed=3) as engine:
        yield engine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_embedded_score_matches_a_float64_forward(engine, temperature):
    scores = engine.score(PROMPTS, RESPONSES, temperature=temperature)
    assert [len(s) for s in scores] == [len(r) for r in RESPONSES]
    for prompt, response, score in zip(PROMPTS, RESPONSES, scores):
        assert score.dtype == np.float32
        if response:
            reference = float64_log_probs(engine.hf_model, prompt, response, temperature)
            np.testing.assert_allclose(score, reference, rtol=0, atol=1e-5)


def test_embedded_score_is_independent_of_the_batch(engine):
    """One batch, batches of one, and the generation log-probs of the same tokens agree."""
    together = engine.score(PROMPTS, RESPONSES)
    engine.max_batch_size, batch_size = 1, engine.max_batch_size
    try:
        alone = engine.score(PROMPTS, RESPONSES)
    finally:
        engine.max_batch_size = batch_size
    for first, second in zip(together, alone):
        np.testing.assert_allclose(first, second, rtol=0, atol=1e-5)
    request = GenerateRequest(input_ids=PROMPTS[0], max_new_tokens=6, temperature=0.8, seed=11)
    (result,) = engine.generate([request])
    (scored,) = engine.score([PROMPTS[0]], [result.output_ids], temperature=0.8)
    np.testing.assert_allclose(scored, result.output_log_probs, rtol=0, atol=1e-5)


def test_score_refuses_what_it_cannot_score(engine):
    with pytest.raises(ValueError, match="prompts for"):
        engine.score([[1]], [[2], [3]])
    with pytest.raises(ValueError, match="empty"):
        engine.score([[]], [[2]])
    with pytest.raises(ValueError, match="temperature"):
        engine.score([[1]], [[2]], temperature=0.0)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.score([[1]], [[500]])


def export(model_config, directory, *, seed: int, tokenizer=None) -> EmbeddedEngine:
    """An HF directory of a random model (and ``tokenizer``); returns the engine it came from."""
    source = EmbeddedEngine(model_config, seed=seed)
    write_hf_checkpoint(
        source.hf_state(),
        str(directory),
        config_json=hf_config_from_model_config(model_config).to_json_string(),
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return source


def test_role_engines_load_their_weights_and_close_with_the_stack(tmp_path):
    model = tiny_model_config()
    teacher_source = export(model, tmp_path / "teacher", seed=5)
    judge_source = export(model, tmp_path / "judge", seed=6)
    cfg = TrainConfig(
        output_dir=str(tmp_path / "out"),
        models={
            "teacher": ExtraModelConfig(hf_path=str(tmp_path / "teacher")),
            "judge": ExtraModelConfig(hf_path=str(tmp_path / "judge"), dtype="bfloat16"),
        },
    )
    with ExitStack() as stack:
        engines = build_role_engines(cfg, stack)
        assert sorted(engines) == ["judge", "teacher"]
        assert engines["judge"].info()["dtype"] == "bfloat16"
        # The teacher computes what the model it was exported from computes, bit for bit.
        expected = teacher_source.score(PROMPTS, RESPONSES)
        for got, want in zip(engines["teacher"].score(PROMPTS, RESPONSES), expected):
            np.testing.assert_array_equal(got, want)
        other = judge_source.score(PROMPTS[:1], RESPONSES[:1])[0]
        assert not np.allclose(engines["teacher"].score(PROMPTS[:1], RESPONSES[:1])[0], other)
    for engine in engines.values():
        with pytest.raises(RolloutEngineError, match="after close"):
            engine.score(PROMPTS[:1], RESPONSES[:1])
    teacher_source.close()
    judge_source.close()


def test_start_up_checks_report_every_model_at_once(tmp_path):
    model = tiny_model_config(vocab_size=16)
    export(model, tmp_path / "good", seed=0, tokenizer=build_synthetic_tokenizer()).close()
    export(model, tmp_path / "other", seed=0, tokenizer=build_byte_tokenizer()).close()
    (tmp_path / "empty").mkdir()
    export(model, tmp_path / "no_weights", seed=0).close()
    for path in (tmp_path / "no_weights").glob("*.safetensors"):
        path.unlink()
    cfg = TrainConfig(
        models={
            "teacher": ExtraModelConfig(hf_path=str(tmp_path / "other")),
            "judge": ExtraModelConfig(hf_path=str(tmp_path / "missing")),
            "critic": ExtraModelConfig(hf_path=str(tmp_path / "empty")),
            "helper": ExtraModelConfig(hf_path=str(tmp_path / "no_weights")),
            "fine": ExtraModelConfig(hf_path=str(tmp_path / "good")),
        }
    )
    errors = role_start_problems(cfg, build_synthetic_tokenizer())
    messages = {error.key: str(error) for error in errors}
    assert sorted(messages) == [
        "models.critic.hf_path",
        "models.helper.hf_path",
        "models.judge.hf_path",
        "models.teacher.hf_path",
    ]
    assert "tokenizer differs from the policy's" in messages["models.teacher.hf_path"]
    assert "cross-tokenizer distillation is not supported" in messages["models.teacher.hf_path"]
    assert "not a readable directory" in messages["models.judge.hf_path"]
    assert "config.json does not exist" in messages["models.critic.hf_path"]
    assert "no *.safetensors" in messages["models.helper.hf_path"]
    # The judge role may use another tokenizer; the teacher with the same one passes.
    same = TrainConfig(models={"teacher": ExtraModelConfig(hf_path=str(tmp_path / "good"))})
    assert role_start_problems(same, build_synthetic_tokenizer()) == []
    other = TrainConfig(models={"judge": ExtraModelConfig(hf_path=str(tmp_path / "other"))})
    assert role_start_problems(other, build_synthetic_tokenizer()) == []
