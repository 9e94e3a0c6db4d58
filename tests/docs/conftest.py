"""One run of the CPU demo, shared by the README table's check and the curve gate."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cpu_demo_metrics(tmp_path_factory) -> Path:
    """``metrics.jsonl`` of the CPU demo as ``python -m megatron_gspo.train`` runs it (about 25 s
    on 2 cores)."""
    output_dir = tmp_path_factory.mktemp("cpu_demo") / "out"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_gspo.train", f"output_dir={output_dir}"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir / "metrics.jsonl"
