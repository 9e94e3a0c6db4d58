"""GLM-4.5 (``glm4_moe``) on a real SGLang 0.5.23 server (CPU, float32), and the RL loop against it.

SGLang serves the model with its own GLM-4.5 class (``sglang/srt/models/glm4_moe.py``): sigmoid
router, score-correction bias, expert groups, shared expert, a dense first layer, partial RoPE
and q/k/v bias, on the CPU backend's plain-torch path. The exported checkpoint carries a random,
non-zero correction bias, so a server that ignored it would select other experts. Checked against
transformers' ``Glm4MoeForCausalLM`` loaded from the same directory: greedy tokens, log-probs and
R3 routes, also after a sync of a new correction bias alone (the synced bias steers SGLang's own
routes). Then the trainer (a fresh glm4_moe of the same shape, so other weights and a zero bias)
syncs its weights into the server and trains two GRPO + R3 steps on SGLang's samples: a server
that dropped a synced weight would leave the trainer-vs-SGLang log-prob gap far above float32
rounding (under R3 the bias only chooses experts, which are replayed: the bias is the generation
test's).

Then a GSPO run (no replay: the trainer routes by itself) against the same server. One server
for the module, beside the package's Qwen3-MoE one. The full run (``--full``) runs the module,
as DeepSeek-V3's: CI trains GSPO and GRPO + R3 against the package's Qwen3-MoE server
(test_training.py), GLM-4.5 on the embedded engine (tests/tools/test_compare_families.py) and
checks its conversion against transformers (tests/convert).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from e2e.harness import GRPO, TINY, assert_required_metrics, run_train
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.auth import API_KEY_ENV
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest
from megatron_gspo.weight_sync import TensorTransport, write_hf_checkpoint

from .server import (
    SGLANG_VERSION,
    SKIP_REASON,
    server_model_config,
    sglang_python,
    start_server,
)

pytestmark = pytest.mark.slow  # the full run's (module docstring)

GLM4_FIELDS = {
    "architecture": "glm4_moe",
    "first_k_dense_layers": 1,
    "shared_expert_intermediate_size": 48,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
    "rotary_percent": 0.5,
    "add_qkv_bias": True,
}
"""The CPU demo's shape as GLM-4.5: layer 0 dense, layer 1 routed (8 experts in 2 groups, one
group per token, top-2 scaled by 2.5) with a shared expert, partial RoPE, q/k/v bias (the
overrides of ``tests/e2e/test_glm4_moe.py``)."""
GLM4_OVERRIDES = tuple(
    f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
    for key, value in GLM4_FIELDS.items()
    if key != "architecture"
) + ("model.architecture=glm4_moe",)
PROMPTS = [[1, 2, 3], [7, 7, 1, 0, 5], [4], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def glm_server(tmp_path_factory):
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    directory = tmp_path_factory.mktemp("glm4_sglang")
    model = server_model_config(**GLM4_FIELDS)
    engine = EmbeddedEngine(model, seed=0)
    generator = torch.Generator().manual_seed(5)
    state = []
    for name, tensor in engine.hf_state():
        if name.endswith("e_score_correction_bias"):
            # Large enough to change which experts win (sigmoid scores lie in (0, 1)).
            tensor = 0.3 * torch.randn(tensor.shape, generator=generator)
        state.append((name, tensor))
    assert any(name.endswith("e_score_correction_bias") for name, _ in state)
    write_hf_checkpoint(
        state,
        str(directory / "model"),
        config_json=hf_config_from_model_config(model).to_json_string(),
    )
    engine.close()
    server = start_server(
        python, model, directory / "model", directory / "server.log", free_port("127.0.0.1")
    )
    try:
        assert server.get("/server_info")["version"] == SGLANG_VERSION
        yield server
    finally:
        left = server.stop()
        assert not left, f"processes of the SGLang server outlived it and were killed: {left}"


@pytest.fixture(scope="module")
def reference(glm_server):
    """transformers' GLM-4.5 loaded from the directory the server loaded (bias included)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(glm_server.model_dir), dtype=torch.float32
    ).eval()
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    (bias,) = [b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    assert float(bias.abs().max()) > 0.1
    return model


@pytest.fixture(scope="module")
def client(glm_server):
    engine = SGLangEngine(
        [glm_server.url],
        RouteLayout.from_model_config(glm_server.model),
        api_key=glm_server.api_key,
        request_timeout_s=120,
    )
    yield engine
    engine.close()


def test_sglang_generates_as_transformers_with_the_bias_and_its_routes(
    client, reference, glm_server
):
    """Greedy tokens are transformers' argmax, log-probs within 1e-5, and the R3 routes of the
    routed layer (layer 1; layer 0 is dense) are the HF router's top-k: group-limited, selected
    by sigmoid score + bias."""
    layout = RouteLayout.from_model_config(glm_server.model)
    assert list(layout.moe_layer_indices) == [1] and layout.top_k == 2
    results = client.generate(
        [
            GenerateRequest(p, max_new_tokens=8, temperature=0.0, return_routed_experts=True)
            for p in PROMPTS
        ]
    )
    worst_log_prob = 0.0
    differing = total = 0
    for prompt, result in zip(PROMPTS, results):
        tokens = list(prompt) + result.output_ids
        logits, expected_routes = forward_with_routes(reference, tokens[:-1])
        table = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 :]
        assert result.output_ids == table.argmax(-1).tolist()
        expected = table[torch.arange(len(result.output_ids)), torch.tensor(result.output_ids)]
        got = torch.from_numpy(result.output_log_probs)
        worst_log_prob = max(worst_log_prob, float((got - expected).abs().max()))
        routes = torch.from_numpy(result.routed_experts.astype(np.int64))
        assert routes.shape == expected_routes.shape == (len(tokens) - 1, 1, 2)
        differing += int((routes.sort(-1).values != expected_routes.sort(-1).values).any(-1).sum())
        total += routes.shape[0]
    assert worst_log_prob < 1e-5, worst_log_prob
    # fp32 near-ties between the 2nd and 3rd expert could flip a row; none did when written.
    assert differing <= total // 50, (differing, total)


def test_a_synced_correction_bias_steers_sglang_routes(reference, glm_server):
    """The synced bias itself reaches SGLang: only a new ``e_score_correction_bias`` of the routed
    layer is synced (the tensor transport, under the checkpoint's name, as the trainer sends
    it), then SGLang's own routes (nothing replayed) and greedy tokens are transformers' under the
    NEW bias and its routes differ from those under the exported one. (Under R3 the bias only
    chooses experts, which are replayed, so the training test does not show this.)"""
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    (gate_bias,) = [
        b for n, b in reference.named_buffers() if n.endswith("e_score_correction_bias")
    ]
    exported = gate_bias.clone()
    # Another random bias of the same scale: a different ranking of the biased scores.
    new_bias = 0.3 * torch.randn(exported.shape, generator=torch.Generator().manual_seed(11))
    engine = SGLangEngine(
        [glm_server.url],
        RouteLayout.from_model_config(glm_server.model),
        weight_transport=TensorTransport(),
        api_key=glm_server.api_key,
        request_timeout_s=120,
    )
    try:
        engine.sync_weights(iter([(name, new_bias)]), version=100)
        results = engine.generate(
            [
                GenerateRequest(p, max_new_tokens=8, temperature=0.0, return_routed_experts=True)
                for p in PROMPTS
            ]
        )
        routes_before = []
        with torch.no_grad():
            for prompt, result in zip(PROMPTS, results):
                tokens = list(prompt) + result.output_ids
                routes_before.append(forward_with_routes(reference, tokens[:-1])[1])
            gate_bias.copy_(new_bias)
        differing = changed = total = 0
        worst_log_prob = 0.0
        for prompt, result, before in zip(PROMPTS, results, routes_before):
            tokens = list(prompt) + result.output_ids
            logits, expected = forward_with_routes(reference, tokens[:-1])
            table = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 :]
            assert result.output_ids == table.argmax(-1).tolist()
            picked = table[torch.arange(len(result.output_ids)), torch.tensor(result.output_ids)]
            got = torch.from_numpy(result.output_log_probs)
            worst_log_prob = max(worst_log_prob, float((got - picked).abs().max()))
            routes = torch.from_numpy(result.routed_experts.astype(np.int64)).sort(-1).values
            differing += int((routes != expected.sort(-1).values).any(-1).sum())
            changed += int((routes != before.sort(-1).values).any(-1).sum())
            total += routes.shape[0]
        assert worst_log_prob < 1e-5, worst_log_prob
        # fp32 near-ties could flip a row; the old bias's routes differ on many.
        assert differing <= total // 50, (differing, total)
        assert changed >= total // 5, (changed, total)
    finally:
        gate_bias.copy_(exported)
        engine.close()


def _train_against(glm_server, tmp_path, name: str, overrides: list[str]) -> list[dict]:
    """Two steps of a fresh glm4_moe trainer against the server: the trainer's weights (a zero
    correction bias among them) are synced at start and after each step; the old log-probs are
    recomputed by the trainer and compared with SGLang's (``rollout_log_prob_abs_diff``)."""
    launch = run_train(
        tmp_path / name,
        [
            "steps=2",
            *TINY,
            *GLM4_OVERRIDES,
            "rollout.engine=sglang",
            f"rollout.sglang.urls=[{glm_server.url}]",
            "rollout.weight_transport=tensor",
            *overrides,
        ],
        timeout=300,
    )
    records = launch.metrics()
    assert_required_metrics(records, steps=2)
    for record in records:
        assert record["weight_sync_bytes"] > 0
    assert glm_server.get("/model_info")["weight_version"] == "2"
    return records


def test_gspo_trains_against_sglang(glm_server, monkeypatch, tmp_path):
    """GSPO (the default loss, no replay): the trainer routes by itself, with the synced zero
    bias, as SGLang does; the gap stays at float32 rounding unless a near-tie flips a route, and
    the policy moves."""
    monkeypatch.setenv(API_KEY_ENV, glm_server.api_key)
    records = _train_against(glm_server, tmp_path, "glm4_gspo", [])
    for record in records:
        assert record["rollout_log_prob_abs_diff"] < 1e-5, record["rollout_log_prob_abs_diff"]
    assert records[-1]["grad_norm"] > 0


def test_grpo_with_r3_trains_against_sglang(glm_server, monkeypatch, tmp_path):
    """Two GRPO + R3 steps: the old log-probs, recomputed replaying SGLang's routes, stay within
    float32 rounding of SGLang's and no route differs."""
    monkeypatch.setenv(API_KEY_ENV, glm_server.api_key)
    records = _train_against(glm_server, tmp_path, "glm4_r3", [*GRPO, "algo.routing_replay=r3"])
    for record in records:
        assert record["rollout_log_prob_abs_diff"] < 2e-6, record["rollout_log_prob_abs_diff"]
        assert record["routing_mismatch_vs_rollout"] == 0.0
