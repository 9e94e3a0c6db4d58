"""benchmarks/sglang_bf16.py starts real SGLang servers (tests/real_sglang covers the same
measurement in CI); here only its command line: the help, and a clear refusal without SGLang's
environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "sglang_bf16.py"


def test_help_and_missing_venv():
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_GSPO_SGLANG_VENV"}
    shown = subprocess.run(
        [sys.executable, str(BENCHMARK), "--help"], capture_output=True, text=True, env=env
    )
    assert shown.returncode == 0 and "--expert-sizes" in shown.stdout
    assert "plain-torch" in shown.stdout  # the kernel path it reports
    refused = subprocess.run(
        [sys.executable, str(BENCHMARK)], capture_output=True, text=True, env=env
    )
    assert refused.returncode == 2 and "MEGATRON_GSPO_SGLANG_VENV" in refused.stderr
