"""``benchmarks/code_sandbox.py`` runs (one round) and reports every variant, or refuses with the
sandbox's fail-closed reason where the kernel cannot isolate code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.reward.sandbox_support import require_sandbox, unavailable_reason

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "code_sandbox.py"


def test_one_round_reports_every_variant():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--rounds", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if unavailable_reason() is not None:
        # It refuses, naming why; the benchmark itself was not measured: skipped (failed in CI).
        assert result.returncode != 0 and "cannot measure the sandbox here" in result.stderr
        require_sandbox()
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report["variants"]) == {
        "bubblewrap",
        "none",
        "code/stdin_stdout",
        "code/function_call",
        "code/test_code",
    }
    for row in report["variants"].values():
        assert row["calls_per_s"] > 0 and row["median_ms"] >= row["min_ms"] > 0
