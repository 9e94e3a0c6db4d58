"""The README's CPU demo table is the demo's output: the first two RL steps of a demo run here
agree with the table's rows (``tools/readme_demo.py`` regenerates the table; its docstring says
why only the first steps are compared and how closely)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_demo_table_matches_the_demo(cpu_demo_metrics):
    result = subprocess.run(
        [
            sys.executable,
            "tools/readme_demo.py",
            "--check",
            "--steps",
            "2",
            "--metrics",
            str(cpu_demo_metrics),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_check_fails_on_a_changed_row(tmp_path):
    """The comparison can fail: a README row moved by more than the tolerance is reported."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        import readme_demo
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))
    text = (REPO_ROOT / "README.md").read_text()
    rows = readme_demo.readme_rows(text)
    record = {"step": 0}
    for (_, key, _), value in zip(readme_demo.COLUMNS, rows[0]):
        record[key] = value
    assert readme_demo.differences(text, [record]) == []
    record["reward_mean"] += 2 * readme_demo.TOLERANCE
    assert readme_demo.differences(text, [record]) == [
        f"step 0 mean reward: README {rows[0][0]}, the demo {record['reward_mean']:.4f}"
    ]
