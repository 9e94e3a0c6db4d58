"""``min_new_tokens`` (``rollout.min_new_tokens``): fixed-length responses for the TRL benchmark.

The embedded engine must never sample a stop token before a response has ``min_new_tokens``
tokens, and must still report the log-probs of the FULL distribution (what the trainer
recomputes), checked against one float64 forward of the whole sequence. The SGLang payload and
the loopback server carry the field.
"""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_gspo.config import ConfigError, RolloutConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.server import parse_generate_body
from megatron_gspo.rollout.sglang_protocol import sampling_params_json
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config

PROMPT = [5, 17, 33, 2]


@pytest.fixture(scope="module")
def engine() -> EmbeddedEngine:
    return EmbeddedEngine(tiny_model_config(), seed=3)


def _full_log_probs(engine: EmbeddedEngine, output_ids: list[int]) -> torch.Tensor:
    """``[R, V]`` float64 log-softmax at each generated position (temperature 1)."""
    model64 = copy.deepcopy(engine.hf_model).double()
    model64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    with torch.no_grad():
        logits = model64(input_ids=torch.tensor([PROMPT + output_ids])).logits[0]
    start = len(PROMPT) - 1
    return torch.log_softmax(logits[start : start + len(output_ids)], dim=-1)


def test_greedy_stop_token_is_held_back_until_min_new_tokens(engine):
    greedy = GenerateRequest(input_ids=PROMPT, max_new_tokens=12, temperature=0.0)
    free = engine.generate([greedy])[0]
    # Make the greedy choice of position 0 the stop token: unconstrained, the sample stops at once.
    stop = free.output_ids[0]
    stopped = engine.generate([GenerateRequest(**{**greedy.__dict__, "stop_token_ids": [stop]})])
    assert stopped[0].output_ids == [stop] and stopped[0].finish_reason == "stop"

    held = GenerateRequest(**{**greedy.__dict__, "stop_token_ids": [stop], "min_new_tokens": 6})
    result = engine.generate([held])[0]
    assert len(result.output_ids) >= 6
    assert stop not in result.output_ids[:6]
    full = _full_log_probs(engine, result.output_ids)
    for position, token in enumerate(result.output_ids[:6]):
        # Greedy among the allowed tokens, i.e. the best token other than the stop token...
        allowed = full[position].clone()
        allowed[stop] = float("-inf")
        assert token == int(allowed.argmax())
    # ... and the reported log-probs are those of the unmasked distribution.
    expected = full[torch.arange(len(result.output_ids)), torch.tensor(result.output_ids)]
    assert torch.allclose(
        torch.as_tensor(result.output_log_probs, dtype=torch.float64), expected, atol=1e-5
    )


def test_sampled_responses_have_exactly_the_fixed_length(engine):
    stops = list(range(0, 96, 3))  # a third of the vocabulary stops a response
    request = GenerateRequest(
        input_ids=PROMPT,
        max_new_tokens=10,
        temperature=1.0,
        stop_token_ids=stops,
        min_new_tokens=10,
        seed=11,
    )
    results = engine.generate([request], n=16)
    assert all(len(r.output_ids) == 10 and r.finish_reason == "length" for r in results)
    assert not any(token in stops for r in results for token in r.output_ids)
    # Without the floor, about a third of the tokens would be stop tokens.
    free = engine.generate([GenerateRequest(**{**request.__dict__, "min_new_tokens": 0})], n=16)
    assert any(r.finish_reason == "stop" for r in free)


def test_min_new_tokens_travels_to_sglang_and_through_the_loopback_server():
    request = GenerateRequest(input_ids=PROMPT, max_new_tokens=8, min_new_tokens=8)
    params = sampling_params_json(request)
    assert params["min_new_tokens"] == 8
    assert "min_new_tokens" not in sampling_params_json(
        GenerateRequest(input_ids=PROMPT, max_new_tokens=8)
    )
    parsed, _, _, _ = parse_generate_body({"input_ids": PROMPT, "sampling_params": params})
    assert parsed[0].min_new_tokens == 8


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match="min_new_tokens"):
        GenerateRequest(input_ids=PROMPT, max_new_tokens=4, min_new_tokens=-1)
    with pytest.raises(ConfigError, match="rollout.min_new_tokens"):
        RolloutConfig(min_new_tokens=-2)
