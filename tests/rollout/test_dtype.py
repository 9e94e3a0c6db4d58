"""``rollout.dtype``: a reduced-precision embedded engine is a real, SGLang-like mismatch, and the
float32 default stays the trainer's exact twin."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.config import ConfigError, RolloutConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.types import GenerateRequest, sync_weights_paused
from tests.rollout.conftest import tiny_model_config


def _requests(count: int = 6, **fields) -> list[GenerateRequest]:
    defaults = dict(max_new_tokens=12, temperature=1.0, return_logprob=True)
    defaults.update(fields)
    return [
        GenerateRequest(
            input_ids=[(5 * i + j) % 90 + 1 for j in range(i + 3)], seed=7 + i, **defaults
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def engines():
    """The same weights in a float32 engine and in bfloat16 / float16 engines (cast at sync)."""
    config = tiny_model_config()
    reference = EmbeddedEngine(config, seed=4)
    weights = [(name, tensor.clone()) for name, tensor in reference.hf_state()]
    engines = {"float32": reference}
    for dtype in ("bfloat16", "float16"):
        engine = EmbeddedEngine.from_config(config, RolloutConfig(dtype=dtype), seed=99)
        engine.sync_weights(iter(weights), version=1)
        engines[dtype] = engine
    yield engines
    for engine in engines.values():
        engine.close()


def test_float32_default_is_the_unchanged_engine(model_config):
    """``rollout.dtype=float32`` (the default) builds exactly today's engine: same tokens,
    log-probs and routes bit for bit."""
    requests = _requests(return_routed_experts=True)
    default = EmbeddedEngine.from_config(model_config, RolloutConfig(), seed=1).generate(requests)
    today = EmbeddedEngine(model_config, seed=1).generate(requests)
    for ours, theirs in zip(default, today):
        assert ours.output_ids == theirs.output_ids
        np.testing.assert_array_equal(ours.output_log_probs, theirs.output_log_probs)
        np.testing.assert_array_equal(ours.routed_experts, theirs.routed_experts)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_weights_are_cast_at_sync_and_every_layer_computes_in_the_dtype(engines, dtype):
    engine, reference = engines[dtype], engines["float32"]
    torch_dtype = getattr(torch, dtype)
    assert engine.info()["dtype"] == dtype
    for (name, ours), (_, theirs) in zip(engine.hf_state(), reference.hf_state()):
        assert ours.dtype == torch_dtype, name
        torch.testing.assert_close(ours, theirs.to(torch_dtype), rtol=0, atol=0, msg=name)
    seen: dict[str, torch.dtype] = {}

    def record(name):
        def hook(module, inputs, output):
            first = output[0] if isinstance(output, tuple) else output
            seen.setdefault(name, first.dtype)  # returns None: the output stays as it is

        return hook

    hooks = [
        module.register_forward_hook(record(name))
        for name, module in engine.hf_model.named_modules()
        if name.endswith(("mlp.gate", "self_attn", "lm_head", "mlp"))
    ]
    try:
        engine.generate(_requests(1, max_new_tokens=2))
    finally:
        for hook in hooks:
            hook.remove()
    assert any(name.endswith("mlp.gate") for name in seen)  # the MoE router ran
    assert set(seen.values()) == {torch_dtype}, seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_log_probs_are_float32_log_softmax_of_the_low_precision_logits(engines, dtype):
    """What SGLang reports: the output layer's logits in the engine's dtype, upcast, then the
    log-softmax in float32 -- checked against a full (no KV cache) forward of the same model."""
    engine = engines[dtype]
    requests = _requests(3)
    for request, result in zip(requests, engine.generate(requests)):
        tokens = list(request.input_ids) + result.output_ids
        with torch.no_grad():
            logits = engine.hf_model(input_ids=torch.tensor([tokens])).logits[0]
        assert logits.dtype == getattr(torch, dtype)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        start = result.prompt_length - 1
        positions = torch.arange(start, start + result.response_length)
        expected = log_probs[positions, torch.tensor(result.output_ids)].numpy()
        # The KV-cache decode and the full forward round differently in low precision.
        tolerance = 0.05 if dtype == "bfloat16" else 0.01
        np.testing.assert_allclose(result.output_log_probs, expected, atol=tolerance, rtol=0)


def test_bfloat16_log_probs_and_routes_really_differ_from_float32(engines):
    """On the bf16 engine's own samples, teacher-forced through both models: log-probs differ
    by bf16 rounding (not 0, not a different model) and some routes flip."""
    bf16, fp32 = engines["bfloat16"], engines["float32"]
    requests = _requests(8, max_new_tokens=24)
    gaps, flipped, total = [], 0, 0
    for request, result in zip(requests, bf16.generate(requests)):
        tokens = torch.tensor([list(request.input_ids) + result.output_ids])
        start = result.prompt_length - 1
        positions = torch.arange(start, start + result.response_length)
        routes = {}
        for name, engine in (("bf16", bf16), ("fp32", fp32)):
            logits, routes[name] = forward_with_routes(engine.hf_model, tokens[0].tolist())
            if name == "fp32":
                exact = torch.log_softmax(logits, -1)[positions, tokens[0, start + 1 :]]
        gaps.append((torch.as_tensor(result.output_log_probs) - exact).abs())
        ordered = {k: v.sort(dim=-1).values for k, v in routes.items()}
        flipped += int((ordered["bf16"] != ordered["fp32"]).any(-1).sum())
        total += ordered["bf16"].shape[0] * ordered["bf16"].shape[1]
    gap = float(torch.cat(gaps).mean())
    assert 1e-4 < gap < 0.05, gap  # fp32 engines agree with each other to ~1e-7
    assert 0 < flipped < total / 2, (flipped, total)


def test_config_and_factory(model_config, tmp_path):
    with pytest.raises(ConfigError, match="rollout.dtype"):
        RolloutConfig(dtype="float8")
    with pytest.raises(ConfigError, match="sglang.extra_args"):
        RolloutConfig(engine="sglang", dtype="bfloat16")
    engine = build_rollout_engine(RolloutConfig(dtype="bfloat16"), model_config, seed=1)
    assert next(engine.hf_model.parameters()).dtype == torch.bfloat16
    # The loopback server runs the same bf16 engine: same samples through HTTP.
    client = build_rollout_engine(
        RolloutConfig(engine="embedded_http", dtype="bfloat16"),
        model_config,
        seed=1,
        work_dir=str(tmp_path),
    )
    try:
        donor = EmbeddedEngine(model_config, seed=2)
        weights = [(name, tensor.clone()) for name, tensor in donor.hf_state()]
        sync_weights_paused(client, iter(weights), version=1)
        engine.sync_weights(iter(weights), version=1)
        request = _requests(1)[0]
        served, local = client.generate([request])[0], engine.generate([request])[0]
        assert served.output_ids == local.output_ids
        np.testing.assert_array_equal(served.output_log_probs, local.output_log_probs)
    finally:
        client.close()
        engine.close()
