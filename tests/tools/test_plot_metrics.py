"""tools/plot_metrics.py: the PNG and the Markdown table of a run's metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "plot_metrics", REPO_ROOT / "tools" / "plot_metrics.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_and_table(tmp_path, capsys):
    records = [
        {"step": step, "reward_mean": 0.1 * step, "env/turns_mean": 2.0} for step in range(12)
    ]
    records[3].pop("env/turns_mean")  # a step without the key leaves its cell empty
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    out = tmp_path / "out"
    tool = load_tool()
    assert (
        tool.main([str(metrics), "--out", str(out), "--keys", "reward_mean", "env/turns_mean"]) == 0
    )
    assert (out / "metrics.png").read_bytes().startswith(b"\x89PNG")
    table = (out / "metrics.md").read_text()
    assert table == capsys.readouterr().out
    rows = table.splitlines()
    assert rows[0] == "| step | reward_mean | env/turns_mean |"
    # Every 5 steps and the last one.
    assert [row.split("|")[1].strip() for row in rows[2:]] == ["0", "5", "10", "11"]
    assert rows[-1] == "| 11 | 1.100 | 2.000 |"
