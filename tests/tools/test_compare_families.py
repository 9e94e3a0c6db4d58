"""The GLM-4.5 and DeepSeek-V3 families trained for real, through the compare tool: per family,
two GSPO steps and two GRPO + R3 steps on the embedded engine (tiny models), with the routing
metrics the tool reports (expert volatility, R3's mismatch against the engine).

This is the default tier's short training run per family (issue 26): each family's four runs go in
one process (``--one-process``: Megatron's start-up paid once, the runs' metrics equal separate
processes' bit for bit, measured), and both families in the same process. What it shows: the
loss is finite, the policy moves (the second mini-batch's sequence ratios leave 1, routes change),
the trainer computes the engine's network before each update (after step 0 the weight sync
carries every updated tensor, MLA's included), and R3 trains on exactly the engine's experts.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "compare_grpo_gspo.py"
FAMILIES = ("glm4_moe", "deepseek_v3")
RUN = (
    "--one-process",
    "--no-plots",
    "--variants",
    "gspo,grpo_r3",
    "--steps",
    "2",
    "--",
    "algo.rollout_batch_size=2",
    "algo.num_return_sequences_in_group=4",
    "algo.num_mini_batches=2",
    "algo.response_length=8",
    "sft_warmup_steps=0",
)
"""Two steps of 8 samples in 2 mini-batches: the second mini-batch of each step sees the policy
the first moved."""


RUN_BOTH = """
import sys
sys.path.insert(0, sys.argv[1])
import compare_grpo_gspo as tool
out, run = sys.argv[2], sys.argv[3:]
codes = [tool.main(["--architecture", family, "--out", f"{out}/{family}", *run])
         for family in ("glm4_moe", "deepseek_v3")]
sys.exit(max(codes))
"""
"""Both families' comparisons in one process: the tool's ``--one-process`` runs share its
imports, and so do the two families' (the runs of one family after the other's)."""


@pytest.fixture(scope="module")
def comparisons(tmp_path_factory) -> dict[str, Path]:
    """Each family's comparison (both in one process, one core)."""
    root = tmp_path_factory.mktemp("families")
    result = subprocess.run(
        [sys.executable, "-c", RUN_BOTH, str(TOOL.parent), str(root), *RUN],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return {family: root / family for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_with_gspo_and_grpo_r3(comparisons, family):
    out = comparisons[family]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["architecture"] == family
    assert list(summary["variants"]) == ["gspo", "grpo_r3"]
    for variant, values in summary["variants"].items():
        assert (values["exit_code"], values["steps"]) == (0, 2), variant
        records = [
            json.loads(line) for line in (out / variant / "metrics.jsonl").read_text().splitlines()
        ]
        for record in records:
            assert math.isfinite(record["policy_loss"]), (variant, record["step"])
            assert 0 < record["grad_norm"] < math.inf, (variant, record["step"])
            # Before each update the trainer's log-probs are the engine's (fp32 twins): at step 1
            # after the weight sync of every updated tensor of the family.
            assert record["kl"] < 1e-9, (variant, record["step"], record["kl"])
        # The policy moved: the second mini-batch's sequence ratios leave 1 ...
        assert values["mean_seq_log_ratio_abs_mean"] > 1e-4, variant
        # ... and so do its routes: the expert volatility the tool reports (layer 1 is the
        # only routed layer: layer 0 is dense).
        assert values["mean_routing_change_frac"] > 0, variant
        assert all("routing_change_frac/layer_1" in r for r in records), variant
        assert not any("routing_change_frac/layer_0" in r for r in records), variant
    # R3: the training forwards used exactly the engine's experts on the routed layer.
    r3 = summary["variants"]["grpo_r3"]
    assert r3["mean_routing_mismatch_vs_rollout"] == 0.0
    assert r3["mean_routing_mismatch_vs_rollout_per_layer"] == {"1": 0.0}
    # Without replay the second mini-batch routes natively under the moved router: the mismatch
    # the tool reports is the drift R3 removes.
    assert summary["variants"]["gspo"]["mean_routing_mismatch_vs_rollout"] > 0
    assert "| grpo_r3 |" in (out / "summary.md").read_text()


def test_architecture_with_a_model_path_is_refused(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--architecture",
            "glm4_moe",
            "--out",
            str(tmp_path),
            "--",
            "model.hf_path=/models/GLM-4.5-Air",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 2
    assert "--architecture builds a tiny model" in result.stderr
