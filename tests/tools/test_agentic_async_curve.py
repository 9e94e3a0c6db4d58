"""tools/agentic_async_curve.py: the commands of the two runs, and the summary, table and plot
made from their metrics.jsonl (re-read with --plot-only)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "agentic_async_curve", REPO_ROOT / "tools" / "agentic_async_curve.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_runs_differ_only_in_the_asynchronous_settings(tmp_path):
    tool = load_tool()
    args = tool.parse_args(["--out", str(tmp_path), "--steps", "4", "seed=3"])
    sync = tool.command("sync", tmp_path / "sync", args)
    asynchronous = tool.command("async", tmp_path / "async", args)
    assert [a for a in asynchronous if a not in sync] == [
        "rollout.max_staleness=1",
        "algo.rollout_correction.level=sequence",
        f"output_dir={tmp_path / 'async'}",
    ]
    assert sync[sync.index("--preset") + 1] == "cpu_tool_use"
    assert "steps=4" in sync and "seed=3" in sync


def test_summary_table_and_plot_from_runs(tmp_path, capsys):
    runs = tmp_path / "runs"
    for variant, offset in (("sync", 0.0), ("async", 0.05)):
        (runs / variant).mkdir(parents=True)
        lines = [
            {"step": step, "reward_mean": 0.5 + offset + 0.01 * step, "env/tool_success_frac": 0.9}
            for step in range(6)
        ]
        (runs / variant / "metrics.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines)
        )
    out = tmp_path / "out"
    tool = load_tool()
    assert tool.main(["--out", str(out), "--runs", str(runs), "--plot-only", "--last", "2"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sync"]["reward_first"] == 0.5
    assert abs(summary["async"]["reward_mean_last_2"] - (0.59 + 0.60) / 2) < 1e-12
    table = (out / "summary.md").read_text()
    assert "| 3 | 0.530 | 0.900 | 0.580 | 0.900 |" in table and table in capsys.readouterr().out
    assert (out / "reward.png").stat().st_size > 0
