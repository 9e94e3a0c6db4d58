"""Contract tests: recorded SGLang 0.5.x /generate bodies and answers (tests/rollout/fixtures/)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_gspo.rollout.sglang_protocol import (
    RouteLayout,
    build_generate_payload,
    decode_routed_experts,
    encode_routed_experts,
    parse_generate_response,
    parse_weight_version,
    parse_weight_version_spans,
    weight_version_spans,
)
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError

FIXTURES = Path(__file__).parent / "fixtures"
LAYOUT = RouteLayout(num_hidden_layers=2, moe_layer_indices=(1,), top_k=2, num_experts=4)
URL = "http://10.0.0.7:30000"


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _requests_of(recorded: dict) -> tuple[list[GenerateRequest], int]:
    """Our requests that must produce the recorded body."""
    body = recorded["request"]
    single = not isinstance(body["input_ids"][0], list)
    prompts = [body["input_ids"]] if single else body["input_ids"]
    rids = [body["rid"]] if single else body["rid"]
    params = [body["sampling_params"]] if single else body["sampling_params"]
    requests = [
        GenerateRequest(
            input_ids=prompt,
            max_new_tokens=p["max_new_tokens"],
            temperature=p["temperature"],
            top_p=p["top_p"],
            top_k=p["top_k"],
            stop_token_ids=p.get("stop_token_ids", ()),
            seed=p.get("sampling_seed"),
            return_logprob=body["return_logprob"],
            return_routed_experts=body.get("return_routed_experts", False),
            request_id=rid,
        )
        for prompt, rid, p in zip(prompts, rids, params)
    ]
    return requests, params[0]["n"]


@pytest.mark.parametrize(
    "name",
    ["generate_single_stop_r3.json", "generate_batch_n2.json", "generate_abort_partial_r3.json"],
)
def test_payload_matches_recorded_request(name):
    recorded = _fixture(name)
    requests, n = _requests_of(recorded)
    assert build_generate_payload(requests, n) == recorded["request"]


def test_single_prompt_stop_with_routes():
    recorded = _fixture("generate_single_stop_r3.json")
    requests, n = _requests_of(recorded)
    (result,) = parse_generate_response(recorded["response"], requests, n, LAYOUT, URL)
    assert result.request_id == "g17-s3"
    assert result.output_ids == [21, 22, 5]
    assert result.finish_reason == "stop" and result.matched_stop_token == 5
    np.testing.assert_array_equal(result.output_log_probs, np.float32([-0.41, -1.2, -0.01]))
    assert result.weight_version == 12 and result.prompt_length == 3
    assert result.routed_experts.dtype == np.uint8
    np.testing.assert_array_equal(result.routed_experts, recorded["expected_routed_experts"])


def test_batch_with_n_is_prompt_major():
    recorded = _fixture("generate_batch_n2.json")
    requests, n = _requests_of(recorded)
    results = parse_generate_response(recorded["response"], requests, n, None, URL)
    assert [r.request_id for r in results] == ["p0/0", "p0/1", "p1/0", "p1/1"]
    assert [r.prompt_length for r in results] == [2, 2, 3, 3]
    assert [r.finish_reason for r in results] == ["length", "stop", "length", "stop"]
    assert results[1].output_ids == [43, 9] and results[3].output_ids == [9]
    assert [r.weight_version for r in results] == [3, 3, 3, 3]
    assert all(r.routed_experts is None for r in results)


def test_abort_keeps_partial_tokens_and_routes():
    recorded = _fixture("generate_abort_partial_r3.json")
    requests, n = _requests_of(recorded)
    aborted, finished = parse_generate_response(recorded["response"], requests, n, LAYOUT, URL)
    assert aborted.finish_reason == "abort" and aborted.abort_message == "Abort in running batch."
    assert aborted.output_ids == [30, 31] and len(aborted.output_log_probs) == 2
    assert finished.finish_reason == "length" and finished.abort_message is None
    for result, expected in zip((aborted, finished), recorded["expected_routed_experts"]):
        assert result.routed_experts.shape == (
            result.prompt_length + result.response_length - 1,
            1,
            2,
        )
        np.testing.assert_array_equal(result.routed_experts, expected)


def test_routes_round_trip_and_dense_layers_are_zero_filled():
    routes = np.random.default_rng(0).integers(0, 300, size=(7, 3, 4)).astype(np.int16)
    layout = RouteLayout(num_hidden_layers=5, moe_layer_indices=(1, 2, 4), top_k=4, num_experts=300)
    encoded = encode_routed_experts(routes, layout)
    import base64

    full = np.frombuffer(base64.b64decode(encoded), np.int32).reshape(7, 5, 4)
    assert not full[:, [0, 3], :].any()
    decoded = decode_routed_experts(encoded, 7, layout)
    assert decoded.dtype == np.int16
    np.testing.assert_array_equal(decoded, routes)


def test_weight_version_strings():
    assert parse_weight_version("12") == 12
    assert parse_weight_version("default") == 0
    with pytest.raises(ValueError, match="--weight-version 0"):
        parse_weight_version("v1-abc")


def _malformed(mutate, name="generate_single_stop_r3.json", replace=False):
    """The error for the recorded answer after ``mutate`` (in place, or returning a replacement
    when ``replace``)."""
    recorded = _fixture(name)
    requests, n = _requests_of(recorded)
    response = copy.deepcopy(recorded["response"])
    if replace:
        response = mutate(response)
    else:
        mutate(response)
    with pytest.raises(RolloutEngineError) as caught:
        parse_generate_response(response, requests, n, LAYOUT, URL)
    message = str(caught.value)
    assert f"{URL}/generate" in message
    return message


def test_weight_version_spans_give_each_tokens_version():
    spans = [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 2, "end": 5}]
    versions = parse_weight_version_spans(spans, 5)
    np.testing.assert_array_equal(versions, [4, 4, 5, 5, 5])
    assert weight_version_spans(versions) == spans
    assert parse_weight_version_spans(None, 3) is None
    assert parse_weight_version_spans([{"version": "1", "start": 0, "end": 0}], 0).size == 0
    for broken, message in (
        ([{"version": "4", "start": 0, "end": 2}], "do not cover output token 2"),
        ([{"version": "4", "start": 0, "end": 4}], "outside the 3 tokens"),
        (
            [{"version": "4", "start": 0, "end": 2}, {"version": "5", "start": 1, "end": 3}],
            "overlap",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            parse_weight_version_spans(broken, 3)


def test_partial_rollout_answer_is_attributed_per_token():
    """An answer whose tokens span an in-place weight update (SGLang 0.5.23's spans; its
    ``weight_version`` names the newest)."""
    recorded = _fixture("generate_single_stop_r3.json")
    requests, n = _requests_of(recorded)
    answer = copy.deepcopy(recorded["response"])
    answer["meta_info"]["weight_version"] = "13"
    answer["meta_info"]["weight_versions"] = [
        {"version": "12", "start": 0, "end": 1},
        {"version": "13", "start": 1, "end": 3},
    ]
    (result,) = parse_generate_response(answer, requests, n, LAYOUT)
    np.testing.assert_array_equal(result.output_weight_versions, [12, 13, 13])
    assert result.weight_version == 12


def test_malformed_answers_give_clear_errors():
    meta = "meta_info"
    assert "expected 1 results" in _malformed(lambda r: [r, r], replace=True)
    assert "expected 4 results" in _malformed(
        lambda r: r[:3], "generate_batch_n2.json", replace=True
    )
    assert "meta_info is missing" in _malformed(lambda r: r.pop(meta))
    assert "output_ids" in _malformed(lambda r: r.update(output_ids="21 22 5"))
    assert "finish_reason" in _malformed(lambda r: r[meta].update(finish_reason={"type": "eos"}))
    assert "does not match output token" in _malformed(
        lambda r: r[meta]["output_token_logprobs"][1].__setitem__(1, 99)
    )
    assert "2 entries for 3" in _malformed(lambda r: r[meta]["output_token_logprobs"].pop())
    assert "prompt_tokens=4" in _malformed(lambda r: r[meta].update(prompt_tokens=4))
    assert "--weight-version 0" in _malformed(
        lambda r: r[meta].update(weight_version="abc", weight_versions=None)
    )
    assert "enable-return-routed-experts" in _malformed(lambda r: r[meta].pop("routed_experts"))
    assert "not valid base64" in _malformed(lambda r: r[meta].update(routed_experts="***"))
    short = encode_routed_experts(np.zeros((4, 1, 2), np.int32), LAYOUT)
    assert "expected 20" in _malformed(lambda r: r[meta].update(routed_experts=short))
    out_of_range = encode_routed_experts(np.full((5, 1, 2), 4, np.int32), LAYOUT)
    assert "outside [0, 4)" in _malformed(lambda r: r[meta].update(routed_experts=out_of_range))
    assert "item is str" in _malformed(lambda r: ["Internal Server Error"], replace=True)


def test_payload_refuses_mixed_flags():
    requests = [
        GenerateRequest(input_ids=[1], max_new_tokens=1, return_logprob=True),
        GenerateRequest(input_ids=[2], max_new_tokens=1, return_logprob=False),
    ]
    with pytest.raises(ValueError, match="share return_logprob"):
        build_generate_payload(requests)
