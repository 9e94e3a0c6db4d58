"""``benchmarks/gpu_throughput.py`` on a machine without a GPU, and the model it would measure.

The measurement needs CUDA and Transformer Engine; here the script must say that there is no GPU
and exit 0, and its scaled model must keep the layer shapes of the Qwen3-30B-A3B preset (the
one-node GSPO preset, whose shapes ``tests/docker/test_presets.py`` checks against the released
model), changing only the layer and expert counts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch

from megatron_gspo.config.loader import load_config

from .harness import REPO_ROOT, subprocess_env

SCRIPT = REPO_ROOT / "benchmarks" / "gpu_throughput.py"


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script would run")
def test_exits_0_with_a_message_without_gpu():
    result = run_script("--layers", "2")
    assert result.returncode == 0, result.stderr
    assert "no CUDA GPU" in result.stdout


def test_help_describes_the_model_and_options():
    result = run_script("--help")
    assert result.returncode == 0, result.stderr
    for option in ("--layers", "--experts", "--tp", "--ep", "--sglang-url", "--json"):
        assert option in result.stdout


def test_scaled_model_keeps_the_qwen3_30b_a3b_layer_shapes():
    script = load_script()
    cfg = script.build_config(script.parse_args(["--layers", "6", "--experts", "16"]))
    preset = load_config("qwen3_30b_a3b_gspo_1node", []).model
    scaled = dataclasses.asdict(cfg.model)
    reference = dataclasses.asdict(preset)
    assert (scaled["num_layers"], scaled["num_experts"]) == (6, 16)
    # What may differ: the counts it scales, where the weights come from, recompute (a flag).
    for field in (
        "num_layers",
        "num_experts",
        "hf_path",
        "max_position_embeddings",
        "recompute_activations",
    ):
        scaled.pop(field)
        reference.pop(field)
    assert scaled == reference
    assert cfg.model.dtype == "bfloat16"
    assert cfg.algo.old_log_prob_source == "rollout"
