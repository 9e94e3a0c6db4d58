"""The embedded engine against full transformers forwards (no KV cache, no padding, float64)."""

from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
import torch

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError, derive_seed
from tests.rollout.conftest import tiny_model_config

ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3", "glm4_moe", "deepseek_v3")


def _requests(count: int = 4, **fields) -> list[GenerateRequest]:
    """Prompts of different lengths (2..count+1 tokens) so that batches are left-padded."""
    defaults = dict(max_new_tokens=6, temperature=0.7)
    defaults.update(fields)
    return [
        GenerateRequest(
            input_ids=[(7 * i + j) % 90 + 1 for j in range(i + 2)], seed=100 + i, **defaults
        )
        for i in range(count)
    ]


def _wait_until_running(engine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.num_running == 0:
        assert time.monotonic() < deadline, "generate() never started"
        time.sleep(0.005)


def _tokens(request, result) -> list[int]:
    return list(request.input_ids) + result.output_ids


def _reference_log_probs(hf_model, request, result, temperature: float) -> np.ndarray:
    """``log_softmax(logits / T)`` of the generated tokens from one float64 forward."""
    model64 = copy.deepcopy(hf_model).double()
    # Eager attention: the reference implementation, a code path independent of the engine's
    # SDPA kernel.
    model64.set_attn_implementation("eager")
    if hasattr(model64.model.layers[-1].mlp, "experts"):
        # torch's grouped_mm has no float64 kernel; the per-expert loop is also an independent
        # code path from the engine's grouped_mm.
        model64.set_experts_implementation("eager")
    tokens = torch.tensor([_tokens(request, result)])
    with torch.no_grad():
        logits = model64(input_ids=tokens).logits[0]
    scale = temperature if temperature > 0 else 1.0
    log_probs = torch.log_softmax(logits / scale, dim=-1)
    start = result.prompt_length - 1
    positions = torch.arange(start, start + result.response_length)
    return log_probs[positions, torch.tensor(result.output_ids)].numpy()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_log_probs_match_full_forward(architecture):
    engine = EmbeddedEngine(tiny_model_config(architecture), seed=3)
    requests = _requests(top_p=0.9, top_k=20)
    for request, result in zip(requests, engine.generate(requests)):
        assert result.output_log_probs.dtype == np.float32
        reference = _reference_log_probs(engine.hf_model, request, result, temperature=0.7)
        np.testing.assert_allclose(result.output_log_probs, reference, atol=1e-5, rtol=0)


def test_generation_is_bit_reproducible(model_config):
    """Same seeds, same weights: identical tokens, log-probs and routes, bit for bit, from the
    same engine twice and from a fresh one (SDPA attention, padded batch, truncation,
    held-back stops and n > 1)."""
    requests = _requests(
        5, temperature=1.0, top_p=0.95, return_routed_experts=True, max_new_tokens=8
    )
    requests = [
        GenerateRequest(**{**request.__dict__, "stop_token_ids": [3, 4], "min_new_tokens": 3})
        for request in requests
    ]
    engine = EmbeddedEngine(model_config, seed=1)
    first = engine.generate(requests, n=2)
    again = engine.generate(requests, n=2)
    fresh = EmbeddedEngine(model_config, seed=1).generate(requests, n=2)
    for one, two, three in zip(first, again, fresh):
        assert one.output_ids == two.output_ids == three.output_ids
        assert one.output_log_probs.tobytes() == two.output_log_probs.tobytes()
        assert one.output_log_probs.tobytes() == three.output_log_probs.tobytes()
        assert np.array_equal(one.routed_experts, two.routed_experts)
        assert np.array_equal(one.routed_experts, three.routed_experts)
    assert len({tuple(r.output_ids) for r in first}) > 1


def test_large_vocabulary_samples_and_log_probs():
    """A vocabulary of 2,500 (two-level inverse-CDF search with a tail block) under
    ``min_new_tokens``: held-back stops are never sampled, and the log-probs are the full
    distribution's, within 1e-5 of a float64 eager forward."""
    engine = EmbeddedEngine(tiny_model_config(vocab_size=2500), seed=4)
    stops = list(range(2000, 2500))  # a fifth of the vocabulary stops a response
    requests = _requests(3, temperature=1.0, stop_token_ids=stops, min_new_tokens=6)
    results = engine.generate(requests, n=2)
    for position, result in enumerate(results):
        request = requests[position // 2]
        assert len(result.output_ids) == 6 and result.finish_reason == "length"
        assert not set(result.output_ids) & set(stops)
        reference = _reference_log_probs(engine.hf_model, request, result, temperature=1.0)
        np.testing.assert_allclose(result.output_log_probs, reference, atol=1e-5, rtol=0)
    free = engine.generate([GenerateRequest(**{**requests[0].__dict__, "min_new_tokens": 0})], n=8)
    assert any(r.finish_reason == "stop" for r in free)


def test_greedy_is_argmax_and_reports_temperature_one_log_probs(engine):
    requests = _requests(temperature=0.0)
    for request, result in zip(requests, engine.generate(requests)):
        tokens = _tokens(request, result)
        with torch.no_grad():
            logits = engine.hf_model(input_ids=torch.tensor([tokens])).logits[0].double()
        positions = torch.arange(result.prompt_length - 1, len(tokens) - 1)
        assert result.output_ids == logits[positions].argmax(-1).tolist()
        reference = _reference_log_probs(engine.hf_model, request, result, temperature=0.0)
        np.testing.assert_allclose(result.output_log_probs, reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_routes_are_top_k_of_recomputed_router_logits(architecture):
    config = tiny_model_config(architecture)
    engine = EmbeddedEngine(config, seed=5)
    requests = _requests(return_routed_experts=True)
    num_moe_layers = len(config.moe_layer_indices)
    for request, result in zip(requests, engine.generate(requests)):
        tokens = _tokens(request, result)
        assert result.routed_experts.shape == (len(tokens) - 1, num_moe_layers, 2)
        assert result.routed_experts.dtype == np.uint8
        with torch.no_grad():
            # The last generated token is never run forward by the engine.
            output = engine.hf_model(
                input_ids=torch.tensor([tokens[:-1]]), output_router_logits=True
            )
        assert len(output.router_logits) == num_moe_layers
        for layer, router_logits in enumerate(output.router_logits):
            expected = router_logits.softmax(-1).topk(2, dim=-1).indices.numpy()
            np.testing.assert_array_equal(result.routed_experts[:, layer, :], expected)


@pytest.mark.parametrize(
    "architecture", ["qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3"]
)
def test_route_weights_are_the_routers_weights_at_the_reported_ids(architecture):
    """``return_routed_expert_weights``: float32 ``[L - 1, M, K]`` beside the ids, each the
    weight the router returned for that expert (its second output: what its MoE block multiplies
    the expert's output by), as one forward over the whole sequence gives them; read here from
    hooks of this test's own on every router, every router class (softmax with and without
    renormalisation, Mixtral's, sigmoid with a correction bias, groups and scaling)."""
    from megatron_gspo.rollout.hf_model import decoder_layers, moe_layer_indices

    engine = EmbeddedEngine(tiny_model_config(architecture), seed=5)
    requests = _requests(return_routed_experts=True, return_routed_expert_weights=True)
    gates = [
        decoder_layers(engine.hf_model)[i].mlp.gate for i in moe_layer_indices(engine.hf_model)
    ]
    for request, result in zip(requests, engine.generate(requests)):
        ids, weights = result.routed_experts.astype(np.int64), result.routed_expert_weights
        assert weights.dtype == np.float32 and weights.shape == ids.shape
        outputs = []
        handles = [
            g.register_forward_hook(lambda m, i, o, outputs=outputs: outputs.append(o))
            for g in gates
        ]
        try:
            with torch.no_grad():
                engine.hf_model(input_ids=torch.tensor([_tokens(request, result)[:-1]]))
        finally:
            for handle in handles:
                handle.remove()
        for layer, (_, expected_weights, expected_ids) in enumerate(outputs):
            match = torch.from_numpy(ids[:, layer, :, None]) == expected_ids[:, None, :]
            same_set = match.any(-1).all(-1)
            assert float(same_set.float().mean()) > 0.95, architecture
            at_ids = (match.float() * expected_weights.float()[:, None, :]).sum(-1)
            gap = (at_ids - torch.from_numpy(weights[:, layer]))[same_set].abs().max()
            assert float(gap) < 1e-5, (architecture, layer, float(gap))


def test_stop_token_and_length(engine):
    request = _requests(1, max_new_tokens=40, temperature=1.0)[0]
    free_run = engine.generate([request])[0]
    assert free_run.finish_reason == "length" and free_run.response_length == 40
    stop = free_run.output_ids[5]
    first = free_run.output_ids.index(stop)
    stopped = engine.generate([GenerateRequest(**{**request.__dict__, "stop_token_ids": [stop]})])[
        0
    ]
    assert stopped.finish_reason == "stop" and stopped.matched_stop_token == stop
    assert stopped.output_ids == free_run.output_ids[: first + 1]


def test_seeded_samples_do_not_depend_on_the_batch(engine):
    requests = _requests(6, temperature=1.0, top_k=30)
    batched = engine.generate(requests)
    alone = [engine.generate([request])[0] for request in requests]
    reversed_batch = engine.generate(requests[::-1])[::-1]
    for one, together, backwards in zip(alone, batched, reversed_batch):
        assert one.output_ids == together.output_ids == backwards.output_ids
        # Padding changes reduction lengths: equal up to float32 rounding.
        np.testing.assert_allclose(one.output_log_probs, together.output_log_probs, atol=1e-5)
    other_seed = engine.generate([GenerateRequest(**{**requests[0].__dict__, "seed": 999})])[0]
    assert other_seed.output_ids != alone[0].output_ids


def test_n_samples_are_prompt_major_with_derived_seeds(engine):
    requests = _requests(2, temperature=1.0)
    results = engine.generate(requests, n=3)
    assert [r.request_id for r in results] == [
        f"{request.request_id}/{index}" for request in requests for index in range(3)
    ]
    for position, result in enumerate(results):
        request = requests[position // 3]
        seed = derive_seed(request.seed, position % 3)
        single = engine.generate([GenerateRequest(**{**request.__dict__, "seed": seed})])[0]
        assert single.output_ids == result.output_ids
    assert len({tuple(r.output_ids) for r in results[:3]}) > 1


def test_abort_returns_partial_tokens(engine):
    request = GenerateRequest(input_ids=[1, 2, 3], max_new_tokens=200, return_routed_experts=True)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=engine.generate([request])[0]))
    worker.start()
    _wait_until_running(engine)
    time.sleep(0.05)
    engine.abort([request.request_id])
    worker.join(timeout=30)
    result = outcome["result"]
    assert result.finish_reason == "abort" and result.abort_message
    assert 0 < result.response_length < 200
    assert result.routed_experts.shape[0] == 3 + result.response_length - 1
    assert len(result.output_log_probs) == result.response_length


def test_pause_abort_then_generate_waits_for_resume(engine):
    engine.pause("abort")
    engine.flush_cache()
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=engine.generate(_requests(1))))
    worker.start()
    time.sleep(0.1)
    assert "result" not in outcome, "generate must wait while paused"
    engine.resume()
    worker.join(timeout=30)
    assert outcome["result"][0].finish_reason == "length"


def test_in_place_pause_freezes_generation_and_sync_lands_between_steps(model_config):
    engine = EmbeddedEngine(model_config, seed=1)
    donor = EmbeddedEngine(model_config, seed=2)
    request = GenerateRequest(input_ids=[1, 2], max_new_tokens=250)
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=engine.generate([request])[0]))
    worker.start()
    _wait_until_running(engine)
    time.sleep(0.02)
    engine.pause("in_place")
    time.sleep(0.2)
    assert "result" not in outcome and engine.num_running == 1, "generation must be frozen"
    engine.flush_cache()  # frozen requests do not block a flush
    engine.sync_weights(donor.hf_state(), version=3)
    engine.resume()
    worker.join(timeout=30)
    result = outcome["result"]
    assert result.finish_reason == "length" and result.response_length == 250
    # Tokens came from both policies: each token says which one, the result names the oldest.
    assert result.weight_version == 0 and engine.weight_version == 3
    versions = result.output_weight_versions
    assert versions[0] == 0 and versions[-1] == 3 and set(versions.tolist()) == {0, 3}
    assert (np.diff(versions) >= 0).all()


def test_partial_sample_keeps_the_routes_of_the_forward_that_processed_each_token(model_config):
    """R3 with a weight sync mid-sample: every route row comes from the forward that processed
    its token (the old weights' rows are kept, not replaced by the new weights' choice); so does
    every row's combine weights, beside its ids."""
    engine = EmbeddedEngine(model_config, seed=1)
    reference = EmbeddedEngine(model_config, seed=1)  # the old weights throughout
    donor = EmbeddedEngine(model_config, seed=2)
    request = GenerateRequest(
        input_ids=[1, 2, 3],
        max_new_tokens=250,
        seed=7,
        return_routed_experts=True,
        return_routed_expert_weights=True,
    )
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(result=engine.generate([request])[0]))
    worker.start()
    _wait_until_running(engine)
    time.sleep(0.05)
    engine.pause("in_place")
    engine.sync_weights(donor.hf_state(), version=1)
    engine.resume()
    worker.join(timeout=60)
    result, old = outcome["result"], reference.generate([request])[0]
    switch = int(np.argmax(result.output_weight_versions == 1))  # first token of version 1
    assert 0 < switch < result.response_length
    assert result.output_ids[:switch] == old.output_ids[:switch]
    # Rows are input positions: the prompt and output tokens before the last old-version token
    # were processed by the old weights' forwards; later rows by the new weights'.
    old_rows = result.prompt_length + switch - 1
    np.testing.assert_array_equal(result.routed_experts[:old_rows], old.routed_experts[:old_rows])
    new_rows = result.routed_experts[old_rows:]
    assert new_rows.shape[0] == result.response_length - switch
    assert (new_rows != old.routed_experts[old_rows : old_rows + len(new_rows)]).any()
    weights, old_weights = result.routed_expert_weights, old.routed_expert_weights
    assert weights.shape == result.routed_experts.shape
    np.testing.assert_array_equal(weights[:old_rows], old_weights[:old_rows])
    new_weights = weights[old_rows:]
    assert (new_weights != old_weights[old_rows : old_rows + len(new_weights)]).any()


def test_flush_refused_while_generating(engine):
    worker = threading.Thread(
        target=lambda: engine.generate([GenerateRequest(input_ids=[1], max_new_tokens=200)])
    )
    worker.start()
    _wait_until_running(engine)
    with pytest.raises(RolloutEngineError, match="pause"):
        engine.flush_cache()
    engine.abort()
    worker.join(timeout=30)
    engine.flush_cache()


def test_sync_weights_changes_outputs_and_version(model_config):
    engine = EmbeddedEngine(model_config, seed=1)
    donor = EmbeddedEngine(model_config, seed=2)
    requests = _requests()
    before = engine.generate(requests)
    stats = engine.sync_weights(donor.hf_state(), version=1)
    assert stats.weight_version == 1 and stats.num_tensors == len(list(donor.hf_state()))
    after = engine.generate(requests)
    expected = donor.generate(requests)
    assert [r.output_ids for r in after] == [r.output_ids for r in expected]
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert {r.weight_version for r in after} == {1}
    with pytest.raises(ValueError, match="older"):
        engine.sync_weights(donor.hf_state(), version=0)


def test_invalid_requests_are_refused_before_any_work(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([GenerateRequest(input_ids=[1, 500], max_new_tokens=2)])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine.generate([GenerateRequest(input_ids=[1] * 256, max_new_tokens=2)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerateRequest(input_ids=[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        GenerateRequest(input_ids=[1], max_new_tokens=1, top_p=0.0)
    with pytest.raises(ValueError, match="every token of the vocabulary is a stop token"):
        engine.generate(
            [
                GenerateRequest(
                    input_ids=[1], max_new_tokens=2, stop_token_ids=range(96), min_new_tokens=1
                )
            ]
        )
    dense = EmbeddedEngine(tiny_model_config("qwen3"), seed=0)
    with pytest.raises(ValueError, match="dense"):
        dense.generate(
            [GenerateRequest(input_ids=[1], max_new_tokens=1, return_routed_experts=True)]
        )


def test_generation_stops_at_max_position_embeddings():
    engine = EmbeddedEngine(tiny_model_config(max_position_embeddings=12), seed=0)
    result = engine.generate([GenerateRequest(input_ids=[1] * 10, max_new_tokens=50)])[0]
    assert result.finish_reason == "length" and result.response_length == 2


def test_health_and_info(engine):
    assert engine.health()
    info = engine.info()
    assert info["engine"] == "embedded" and info["moe_layer_indices"] == [1]
    engine.close()
    assert not engine.health()
    with pytest.raises(RolloutEngineError, match="close"):
        engine.generate(_requests(1))
