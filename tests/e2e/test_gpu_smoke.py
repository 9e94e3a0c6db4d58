"""``benchmarks/gpu_smoke.py`` on a machine without a GPU, and the FLOP count it reports.

The GPU run itself needs CUDA, Transformer Engine and NCCL; here the script must say that there is
no GPU and exit 0. Its FLOP count is checked against real models and its summary against the
metrics of a real (CPU) run, so a renamed metric cannot break it unnoticed.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import pytest
import torch

from .harness import REPO_ROOT, subprocess_env

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_smoke.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would run")
def test_exits_0_with_a_message_without_gpu():
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout, result.stdout


def test_help():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--peak-tflops" in result.stdout and "MFU" in result.stdout


@pytest.mark.parametrize(
    "architecture, fields",
    [
        ("qwen3_moe", {"first_k_dense_layers": 1}),
        ("mixtral", {"qk_layernorm": False}),
        (
            "qwen2_moe",
            {"shared_expert_intermediate_size": 40, "qk_layernorm": False, "add_qkv_bias": True},
        ),
    ],
)
def test_active_parameters_match_the_model(architecture, fields):
    """Weights a token multiplies: every matrix of the HF model but the embedding, the routed
    experts' (stacked ``[E, ...]``) scaled by top-k / E; biases and norms are not multiplies."""
    from megatron_gspo.config import ModelConfig
    from megatron_gspo.rollout.hf_model import build_hf_model

    model_config = ModelConfig(architecture=architecture, **fields)
    model = build_hf_model(model_config)
    expected = 0.0
    for name, parameter in model.named_parameters():
        if parameter.dim() < 2 or "embed_tokens" in name:
            continue
        share = 1.0
        if parameter.dim() == 3:  # [num_experts, out, in]
            assert parameter.shape[0] == model_config.num_experts, name
            share = model_config.moe_router_topk / model_config.num_experts
        expected += parameter.numel() * share
    assert load_script().active_matmul_parameters(model_config) == expected


def test_summary_of_a_real_run(gspo_run):
    """The summary reads real metric names; with the CPU run's times the arithmetic holds."""
    from megatron_gspo.config.loader import load_config

    script = load_script()
    cfg = load_config("cpu_demo", ["steps=3"])
    records = gspo_run.metrics()
    rows = script.summarise(records, cfg, world_size=1, peak=989.0)["steps"]
    assert [row["step"] for row in rows] == [0, 1, 2]
    for record, row in zip(records, rows):
        tokens = record["num_samples"] * (record["prompt_len_mean"] + record["response_len_mean"])
        train_s = record["time/update_s"] + record["time/old_log_probs_s"]
        assert row["train_tokens_per_s"] == pytest.approx(tokens / train_s)
        flops = script.step_flops(record, cfg)
        # One recompute forward + fwd/bwd: 4 forwards of 2 * N * T plus attention.
        assert flops >= 4 * 2 * script.active_matmul_parameters(cfg.model) * tokens
        assert row["mfu"] == pytest.approx(flops / train_s / 989e12)
        assert all(math.isfinite(v) for v in row.values() if v is not None)
