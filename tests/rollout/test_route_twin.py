"""``rollout.embedded_route_source=float32_twin``: a float32 copy of the policy chooses the
experts of a lower-precision embedded engine (route_twin.py, route_forcing.py), so a bf16 engine
reports, and computes with, the fp32 trainer's routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.config import ConfigError, RolloutConfig
from megatron_gspo.config.loader import load_config
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import RouteRecorder, build_hf_model, forward_with_routes
from megatron_gspo.rollout.route_forcing import RouteForcer
from megatron_gspo.rollout.server_process import EmbeddedServerProcess
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "glm4_moe", "deepseek_v3")


def _requests(count: int = 8) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            input_ids=[(5 * i + j) % 90 + 1 for j in range(i + 3)],
            seed=7 + i,
            max_new_tokens=16,
            temperature=1.0,
            return_logprob=True,
            return_routed_experts=True,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize("architecture", MOE_ARCHITECTURES)
def test_forcing_a_routers_own_choice_is_exact_and_another_choice_is_followed(architecture):
    """Every weight rule reproduces its router bit for bit (bf16: the routers' dtype handling
    included), and forced ids are what the experts and the recorder see."""
    model = build_hf_model(tiny_model_config(architecture), dtype=torch.bfloat16, seed=3)
    forcer = RouteForcer(model)
    tokens = torch.tensor([[(7 * j + 3) % 90 + 1 for j in range(12)], list(range(1, 13))])
    with RouteRecorder(model) as recorder, torch.no_grad():
        chosen = model(tokens).logits
        own = recorder.pop(2, 12)
        with forcer.forcing(own):
            replayed = model(tokens).logits
            assert all(torch.equal(a, b) for a, b in zip(recorder.pop(2, 12), own))
        other = [route.roll(1, dims=1) for route in own]  # each token gets its neighbour's
        with forcer.forcing(other):
            moved = model(tokens).logits
            assert all(torch.equal(a, b) for a, b in zip(recorder.pop(2, 12), other))
    assert torch.equal(replayed, chosen)
    assert (moved - chosen).abs().max() > 0.1


def test_float32_twin_in_float32_changes_nothing(model_config):
    """In float32 the twin and the engine choose alike: tokens, log-probs, routes and scores as
    the default engine's, bit for bit (the forcing machinery is the identity), whether the twin
    starts from the engine's seed or from the model the engine was given."""
    requests = _requests(5)
    default = EmbeddedEngine.from_config(model_config, RolloutConfig(), seed=1)
    twinned = {
        "seed": EmbeddedEngine.from_config(
            model_config, RolloutConfig(embedded_route_source="float32_twin"), seed=1
        ),
        "given model": EmbeddedEngine(
            model_config,
            hf_model=build_hf_model(model_config, seed=1),
            route_source="float32_twin",
        ),
    }
    expected = default.generate(requests)
    prompts = [request.input_ids for request in requests]
    responses = [result.output_ids for result in expected]
    expected_scores = default.score(prompts, responses)
    for engine in twinned.values():
        assert engine.info()["route_source"] == "float32_twin"
        for ours, theirs in zip(engine.generate(requests), expected):
            assert ours.output_ids == theirs.output_ids
            assert ours.output_log_probs.tobytes() == theirs.output_log_probs.tobytes()
            np.testing.assert_array_equal(ours.routed_experts, theirs.routed_experts)
        for ours, theirs in zip(engine.score(prompts, responses), expected_scores):
            assert ours.tobytes() == theirs.tobytes()


def _route_flips(requests, results, reference_model) -> tuple[int, float]:
    """``(flips, gap)`` of an engine's ``results`` against a float32 teacher-forced forward of
    the same tokens: (token, MoE layer) pairs whose experts differ from the ones the engine
    reports, and the mean absolute log-prob gap."""
    flips, gaps = 0, []
    for request, result in zip(requests, results):
        tokens = list(request.input_ids) + result.output_ids
        logits, routes = forward_with_routes(reference_model, tokens)
        # The engine reports the routes of every token but the last (never run forward).
        reported = torch.from_numpy(result.routed_experts.astype(np.int64)).sort(-1).values
        flips += int((reported != routes[:-1].sort(-1).values).any(-1).sum())
        start = result.prompt_length - 1
        exact = torch.log_softmax(logits, -1)[
            torch.arange(start, len(tokens) - 1), torch.tensor(result.output_ids)
        ]
        gaps.append((torch.as_tensor(result.output_log_probs) - exact).abs())
    return flips, float(torch.cat(gaps).mean())


def test_bf16_engine_reports_the_float32_routes_of_the_synced_weights():
    """A bf16 engine with the twin, built with other weights and then synced: every route it
    reports is the float32 forward's of the synced weights (so the sync reached the twin: the
    initial weights route otherwise), while its log-probs keep bf16's gap; the same bf16
    engine without the twin flips some routes."""
    config = tiny_model_config()
    policy = EmbeddedEngine(config, seed=4)  # float32: the trainer's twin
    initial = EmbeddedEngine(config, seed=11)
    weights = [(name, tensor.clone()) for name, tensor in policy.hf_state()]
    requests = _requests(4)
    results = {}
    for source in ("float32_twin", "own"):
        rollout = RolloutConfig(dtype="bfloat16", embedded_route_source=source)
        engine = EmbeddedEngine.from_config(config, rollout, seed=11)
        engine.sync_weights(iter(weights), version=1)
        results[source] = engine.generate(requests)
    flips, gap = _route_flips(requests, results["float32_twin"], policy.hf_model)
    assert flips == 0
    assert 1e-4 < gap < 0.05, gap  # still bf16's log-probs (fp32 engines: ~1e-7)
    stale, _ = _route_flips(requests, results["float32_twin"], initial.hf_model)
    assert stale > 0  # a twin left at the initial weights would route otherwise
    own_flips, _ = _route_flips(requests, results["own"], policy.hf_model)
    assert own_flips > 0  # this model and these seeds have bf16 routing flips to remove


def test_invalid_combinations_are_refused(model_config, tmp_path):
    with pytest.raises(ConfigError, match="rollout.embedded_route_source"):
        RolloutConfig(embedded_route_source="bf16")
    with pytest.raises(ConfigError, match="SGLang's routers choose"):
        RolloutConfig(engine="sglang", embedded_route_source="float32_twin")
    with pytest.raises(ConfigError, match="a dense model has none"):
        load_config(
            None, ["model.architecture=qwen3", "rollout.embedded_route_source=float32_twin"]
        )
    with pytest.raises(ValueError, match="no MoE layer"):
        EmbeddedEngine(tiny_model_config("qwen3"), route_source="float32_twin")
    # The server process of embedded_http gets the option too.
    process = EmbeddedServerProcess(
        model_config, api_key="k", log_path=str(tmp_path / "log"), route_source="float32_twin"
    )
    command = process.process.command
    assert command[command.index("--route-source") + 1] == "float32_twin"
