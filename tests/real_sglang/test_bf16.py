"""SGLang 0.5.23 in bfloat16 on this CPU: a real reduced-precision engine, and the mismatch suite
of tools/compare_grpo_gspo.py on it (``--rollout-engine sglang``).

SGLang's CPU backend takes its AMX path (packed weights, ``sgl_kernel`` ops) on CPUs with AMX
tiles and plain torch elsewhere (AMD Zen 4 has avx512_bf16 but no AMX); both run bf16, and the
tests hold on either. The model has the CPU demo's shape with expert size 64, which the AMX
kernels pack whole (48 is packed half and gives wrong log-probs after a bracketed update,
docs/sglang-protocol.md section 7); weights move by the disk transport, outside the begin/end
bracket, as the compare tool's mode does.

Numbers measured on an AMD EPYC (plain-torch path; benchmarks/sglang_bf16.py): on tokens whose
experts SGLang and transformers' bf16 forward chose alike, |SGLang - transformers bf16| is at most
0.07 (mean 0.01-0.015); a near-tied router that bf16 flips moves a token by up to 0.5; the
previous weights' log-probs differ by 2 on average; transformers' bf16 and fp32 forwards differ
by 0.015-0.04 on average.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import transformers
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, sync_weights_paused
from megatron_gspo.weight_sync import DiskTransport, write_hf_checkpoint

from .server import SKIP_REASON, export_model, server_model_config, sglang_python, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3], [7, 7, 1, 0, 5], [4], [9, 8, 7, 6, 5, 4, 3], [3, 3], [0, 1, 2, 3, 4, 5]]
EXPERT_SIZE = 64


def cpu_has_amx_tiles() -> bool:
    """What /proc/cpuinfo says, independently of SGLang's own probe."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(scope="module")
def venv_python() -> str:
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    return python


@pytest.fixture(scope="module")
def bf16_server(venv_python, tmp_path_factory):
    """A second server, bfloat16 with SGLang's CPU-path choice. Module scope: stopped after this
    file's tests rather than idling beside the float32 server through the package."""
    python = venv_python
    directory = tmp_path_factory.mktemp("real_sglang_bf16")
    model = server_model_config(moe_ffn_hidden_size=EXPERT_SIZE)
    export_model(model, directory / "model")
    server = start_server(
        python,
        model,
        directory / "model",
        directory / "server.log",
        free_port("127.0.0.1"),
        dtype="bfloat16",
    )
    try:
        yield server
    finally:
        left = server.stop()
        assert not left, f"processes of the bf16 SGLang server outlived it: {left}"


def reference_log_probs(model, prompt, output):
    """transformers' log-probs of ``output`` (log-softmax in float32) and the forward's routes
    ``[prompt + output - 1, layers, top-k]`` (SGLang's R3 layout)."""
    tokens = list(prompt) + list(output)
    logits, routes = forward_with_routes(model, tokens[:-1])
    table = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(tokens) - 1)
    return table[rows, torch.tensor(output)].double(), routes


def test_bf16_log_probs_after_a_disk_sync(bf16_server, tmp_path):
    """New weights by the disk transport (the compare tool's): SGLang's log-probs are
    transformers' bf16 forward of those weights to bf16 rounding, wherever the two chose the
    same experts; they are clearly not fp32 ones, and clearly not the previous weights'."""
    model = bf16_server.model
    config_json = hf_config_from_model_config(model).to_json_string()
    engine = EmbeddedEngine(model, seed=5)
    weights = [(name, tensor.detach().clone()) for name, tensor in engine.hf_state()]
    engine.close()
    write_hf_checkpoint(weights, str(tmp_path / "new"), config_json=config_json)
    client = SGLangEngine(
        [bf16_server.url],
        RouteLayout.from_model_config(model),
        weight_transport=DiskTransport(str(tmp_path / "disk"), config_json=config_json),
        api_key=bf16_server.api_key,
        request_timeout_s=120,
    )
    try:
        stats = sync_weights_paused(client, iter(weights), 7)
        results = client.generate(
            [
                GenerateRequest(p, max_new_tokens=12, seed=i, return_routed_experts=True)
                for i, p in enumerate(PROMPTS)
            ]
        )
    finally:
        client.close()
    assert stats.num_tensors == len(weights)
    assert {r.weight_version for r in results} == {7}
    load = transformers.AutoModelForCausalLM.from_pretrained
    bf16 = load(str(tmp_path / "new"), dtype=torch.bfloat16).eval()
    fp32 = load(str(tmp_path / "new"), dtype=torch.float32).eval()
    old = load(str(bf16_server.model_dir), dtype=torch.bfloat16).eval()
    same_routes, vs_fp32, vs_old = [], [], []
    for prompt, result in zip(PROMPTS, results):
        got = torch.from_numpy(result.output_log_probs).double()
        expected, routes = reference_log_probs(bf16, prompt, result.output_ids)
        engine_routes = torch.from_numpy(result.routed_experts.astype("int64"))
        # A log-prob depends on the experts of every position up to the one predicting it.
        differ = (engine_routes.sort(-1).values != routes.sort(-1).values).flatten(1).any(-1)
        agreed = ~torch.cummax(differ.int(), 0).values.bool()[len(prompt) - 1 :]
        same_routes.append((got - expected)[agreed])
        vs_fp32.append(got - reference_log_probs(fp32, prompt, result.output_ids)[0])
        vs_old.append(got - reference_log_probs(old, prompt, result.output_ids)[0])
    same_routes, vs_fp32, vs_old = (torch.cat(d).abs() for d in (same_routes, vs_fp32, vs_old))
    tokens = 12 * len(PROMPTS)
    print(
        f"bf16 SGLang after a disk sync: {len(same_routes)}/{tokens} tokens with transformers' "
        f"routes, |d| max {same_routes.max():.3g} mean {same_routes.mean():.3g}; vs fp32 mean "
        f"{vs_fp32.mean():.3g}; vs the old weights mean {vs_old.mean():.3g}"
    )
    # bf16 flips near-tied routers of this random model on some tokens, not on most.
    assert len(same_routes) >= tokens // 2, len(same_routes)
    assert same_routes.max() < 0.2 and same_routes.mean() < 0.03, same_routes
    # An fp32 engine would be 1e-6 from fp32 (the float32 server's tests); bf16 is 1e-2.
    assert vs_fp32.mean() > 2e-3, vs_fp32.mean()
    assert vs_old.mean() > 0.5, vs_old.mean()


@pytest.mark.slow
def test_compare_tool_mismatch_suite_on_sglang(venv_python, tmp_path, record_property):
    """tools/compare_grpo_gspo.py --suite mismatch --rollout-engine sglang, one GRPO + R3 step
    after the 10-step cold start: the run launches its own bf16 server from the SGLang venv,
    syncs by disk, and the trainer (fp32) differs from the engine by bf16, not fp32 rounding
    (1e-7 with the float32 server) nor by stale weights (the cold start alone moves the NLL by
    0.27 nats per token); R3 replays the engine's experts on every (token, layer). The summary
    names SGLang's CPU kernel path, which must be the CPU's: AMX exactly where /proc/cpuinfo
    has AMX tiles."""
    out = tmp_path / "compare"
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        str(REPO_ROOT / "tools" / "compare_grpo_gspo.py"),
        "--suite",
        "mismatch",
        "--quick",
        "--steps",
        "1",
        "--variants",
        "grpo_r3",
        "--rollout-engine",
        "sglang",
        "--sglang-python",
        venv_python,
        "--sglang-device",
        "cpu",
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    record_property("rollout_engine", summary["rollout_engine"])
    print(summary["rollout_engine"])
    path = "amx" if cpu_has_amx_tiles() else "plain-torch"
    assert f"CPU, {path} (" in summary["rollout_engine"], summary["rollout_engine"]
    r3 = summary["variants"]["grpo_r3"]
    assert r3["steps"] == 1 and r3["exit_code"] == 0
    assert 2e-5 < r3["mean_rollout_log_prob_abs_diff"] < 1e-2, r3
    assert r3["mean_routing_mismatch_vs_rollout"] == 0.0, r3
    log = (out / "grpo_r3" / "rollout" / "sglang_server_0.log").read_text()
    assert "'dtype': 'bfloat16'" in log, log[-2000:]  # SGLang logs its server_args
    # The run stopped the server it launched.
    launched = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if str(out / "initial_model") in " ".join(p.info["cmdline"] or [])
    ]
    assert not launched, launched
