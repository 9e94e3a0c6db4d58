"""tools/compare_grpo_gspo.py: --quick runs every variant for real and writes every output file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "compare_grpo_gspo.py"
VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2", "grpo_r3")
PLOTS = ("reward.png", "clip_fraction.png", "routing_change.png", "logprob_gap.png")


def test_help_explains_every_variant():
    result = subprocess.run(
        [sys.executable, str(TOOL), "--help"], capture_output=True, text=True, check=True
    )
    for variant in VARIANTS:
        assert variant in result.stdout


@pytest.mark.slow
def test_quick_mode_writes_every_output(tmp_path):
    out = tmp_path / "compare"
    result = subprocess.run(
        [sys.executable, str(TOOL), "--quick", "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["variants"]) == list(VARIANTS)
    for variant, values in summary["variants"].items():
        assert values["steps"] == 2, variant
        assert values["exit_code"] == 0, variant
        assert 0.0 <= values["final_reward"] <= 1.0
        assert values["mean_clip_frac_token"] is not None
        assert values["mean_routing_change_frac"] is not None, variant
        assert values["mean_rollout_kl_k3"] is not None, variant
    table = (out / "summary.md").read_text()
    assert all(f"| {variant} |" in table for variant in VARIANTS)
    for plot in PLOTS:
        data = (out / plot).read_bytes()
        assert data.startswith(b"\x89PNG"), plot
    assert summary["plots"] == list(PLOTS)


def test_unknown_variant_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), "--variants", "gspo,ppo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "ppo" in result.stderr and "gspo_token" in result.stderr
