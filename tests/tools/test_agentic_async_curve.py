"""tools/agentic_async_curve.py: the commands of the runs per seed, and the summary over seeds
(means with intervals, the paired difference), table and plot made from their metrics.jsonl
(re-read with --plot-only)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
import warnings
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Student's t 0.975 quantile with 2 degrees of freedom (tables; scipy.stats.t.ppf(0.975, 2)).
T_975_2 = 4.302652729911275


def load_tool():
    spec = importlib.util.spec_from_file_location(
        "agentic_async_curve", REPO_ROOT / "tools" / "agentic_async_curve.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(
    directory: Path,
    rewards: list[float],
    tool_success: float = 0.9,
    evaluations: dict[int, tuple[float, float]] | None = None,
) -> None:
    """A run's metrics.jsonl; ``evaluations``: per step, its held-out (sampled, greedy) reward."""
    directory.mkdir(parents=True)
    lines = [
        {"step": step, "reward_mean": reward, "env/tool_success_frac": tool_success}
        for step, reward in enumerate(rewards)
    ]
    for step, (sampled, greedy) in (evaluations or {}).items():
        lines[step]["eval/sampled_reward_mean"] = sampled
        lines[step]["eval/greedy_reward_mean"] = greedy
    (directory / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.mark.parametrize("variant, level", [("async", "sequence"), ("async_token", "token")])
def test_the_runs_differ_only_in_the_asynchronous_settings(tmp_path, variant, level):
    tool = load_tool()
    args = tool.parse_args(["--out", str(tmp_path), "--steps", "4", "logging.tensorboard=false"])
    sync = tool.command("sync", 7, tmp_path / "sync", args)
    asynchronous = tool.command(variant, 7, tmp_path / variant, args)
    assert [a for a in asynchronous if a not in sync] == [
        "rollout.max_staleness=1",
        f"algo.rollout_correction.level={level}",
        f"output_dir={tmp_path / variant}",
    ]
    assert sync[sync.index("--preset") + 1] == "cpu_tool_use"
    assert "steps=4" in sync and "seed=7" in sync
    # Both evaluate the same held-out prompts, every 5 steps by default.
    assert "eval.interval=5" in sync and "data.num_eval_prompts=32" in sync
    every_two = tool.command(
        "async", 7, tmp_path, tool.parse_args(["--out", "o", "--eval-every", "2"])
    )
    assert "eval.interval=2" in every_two
    # A seed given among the overrides comes after the tool's and wins.
    overridden = tool.command("sync", 7, tmp_path, tool.parse_args(["--out", "o", "seed=3"]))
    assert overridden.index("seed=3") > overridden.index("seed=7")


def test_variants_are_chosen_and_the_baseline_always_runs_first():
    tool = load_tool()
    assert tool.parse_args(["--out", "o"]).variants == ["sync", "async"]
    chosen = tool.parse_args(["--out", "o", "--variants", "async_token", "async"]).variants
    assert chosen == ["sync", "async_token", "async"]
    named = tool.parse_args(["--out", "o", "--variants", "async_token", "sync", "async_token"])
    assert named.variants == ["sync", "async_token"]


def test_seeds_start_at_the_presets_own_seed(tmp_path):
    from megatron_gspo.config import ConfigWarning
    from megatron_gspo.config.loader import load_config

    tool = load_tool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        assert load_config("cpu_tool_use", []).seed == tool.PRESET_SEED
    assert tool.parse_args(["--out", "o"]).seed_list == [tool.PRESET_SEED]
    three = tool.parse_args(["--out", "o", "--seeds", "3"]).seed_list
    assert three == [tool.PRESET_SEED, tool.PRESET_SEED + 1, tool.PRESET_SEED + 2]
    assert tool.parse_args(["--out", "o", "--seed-list", "5", "9"]).seed_list == [5, 9]
    assert tool.run_directory(tmp_path, 9, "async") == tmp_path / "seed_9" / "async"


def test_summary_over_seeds_table_and_plot_from_runs(tmp_path, capsys):
    """Three seeds; async - sync is +0.01, +0.03, +0.05 on every step of seeds 1, 2, 3: the
    paired difference is 0.03 with the t interval of those three values, while the per-variant
    intervals are wide (the seeds differ by 0.1)."""
    runs = tmp_path / "runs"
    offsets = {1: 0.01, 2: 0.03, 3: 0.05}
    for seed, offset in offsets.items():
        base = [0.5 + 0.1 * seed + 0.01 * step for step in range(6)]
        write_run(runs / f"seed_{seed}" / "sync", base)
        write_run(runs / f"seed_{seed}" / "async", [reward + offset for reward in base], 0.8)
    (runs / "seed_2" / "sync" / "run.json").write_text(json.dumps({"wall_s": 12.5}))
    out = tmp_path / "out"
    tool = load_tool()
    arguments = ["--out", str(out), "--runs", str(runs), "--plot-only", "--last", "2"]
    assert tool.main([*arguments, "--seed-list", "1", "2", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [1, 2, 3]
    sync = summary["variants"]["sync"]
    seed_two = sync["per_seed"]["2"]
    assert seed_two["reward_first"] == 0.7 and seed_two["wall_s"] == 12.5
    assert "wall_s" not in sync["per_seed"]["1"]
    assert math.isclose(seed_two["reward_mean_last_2"], (0.74 + 0.75) / 2, rel_tol=1e-12)
    # The area per step of a straight line is its middle value.
    assert math.isclose(seed_two["reward_auc"], 0.725, rel_tol=1e-12)
    # Over seeds: the last-2 means are 0.645, 0.745, 0.845 (spread 0.1).
    final = sync["reward_mean_last_2"]
    half = T_975_2 * 0.1 / math.sqrt(3)
    assert math.isclose(final["mean"], 0.745, rel_tol=1e-12) and final["n"] == 3
    assert math.isclose(final["high"] - final["mean"], half, rel_tol=1e-6)
    paired = summary["paired"]["async - sync"]["reward_mean_last_2"]
    half = T_975_2 * statistics.stdev([0.01, 0.03, 0.05]) / math.sqrt(3)
    assert math.isclose(paired["mean"], 0.03, rel_tol=1e-9)
    assert math.isclose(paired["low"], 0.03 - half, rel_tol=1e-6)
    assert paired["excludes_zero"] is False and paired["seeds"] == [1, 2, 3]
    assert math.isclose(summary["paired"]["async - sync"]["reward_auc"]["mean"], 0.03)
    table = (out / "summary.md").read_text()
    assert table in capsys.readouterr().out
    # The mean curve: step 3's sync reward over seeds is 0.5 + 0.2 + 0.03.
    assert "| 3 | 0.730 | 0.900 | 0.760 | 0.800 |" in table
    assert "| 2 | 0.745 | 0.725 | 0.775 | 0.755 | +0.030 |" in table
    assert "| `async - sync` (paired) | 0.030 [" in table
    assert "no difference detected: the interval contains zero" in table
    assert (out / "reward.png").stat().st_size > 0


def test_one_seed_gives_no_interval(tmp_path):
    """The default, one seed (the preset's): values, no interval. The curves bend, so the
    area (trapezoids) differs from the mean of the points."""
    runs = tmp_path / "runs"
    write_run(runs / "seed_1234" / "sync", [0.5, 0.5, 0.8])
    write_run(runs / "seed_1234" / "async", [0.5, 0.6, 0.8])
    out = tmp_path / "out"
    assert load_tool().main(["--out", str(out), "--runs", str(runs), "--plot-only"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert math.isclose(summary["variants"]["sync"]["reward_auc"]["mean"], 0.575)
    paired = summary["paired"]["async - sync"]["reward_mean_last_10"]
    assert math.isclose(paired["mean"], 0.1 / 3) and paired["low"] is None
    assert math.isclose(summary["paired"]["async - sync"]["reward_auc"]["mean"], 0.05)
    assert "one seed: no interval" in (out / "summary.md").read_text()


def test_reuse_skips_the_runs_already_finished(tmp_path, monkeypatch):
    """--reuse starts no run whose record the tool left. Starting a process fails here: a
    broken --reuse stops the test at once instead of training for an hour."""

    def no_process(*args, **kwargs):
        raise AssertionError(f"a run was started: {args}")

    tool = load_tool()
    monkeypatch.setattr(tool.subprocess, "Popen", no_process)
    runs = tmp_path / "runs"
    for variant in tool.VARIANTS:
        write_run(runs / "seed_4" / variant, [0.5, 0.6])
        (runs / "seed_4" / variant / tool.RUN_RECORD).write_text(json.dumps({"wall_s": 1.0}))
    out = tmp_path / "out"
    assert tool.main(["--out", str(out), "--runs", str(runs), "--seed-list", "4", "--reuse"]) == 0
    assert not (runs / "seed_4" / "sync.log").exists()
    assert json.loads((out / "summary.json").read_text())["seeds"] == [4]


def test_held_out_evaluations_compare_the_same_number_of_updates(tmp_path):
    """Two seeds evaluated after steps 1 and 3 (2 and 4 updates): the held-out statistics are
    the last evaluation's sampled and greedy rewards and the sampled reward's mean over the
    evaluations, per seed, over seeds and paired; a run without evaluations has none."""
    runs = tmp_path / "runs"
    evaluations = {
        (1, "sync"): {1: (0.50, 0.60), 3: (0.70, 0.80)},
        (1, "async"): {1: (0.52, 0.61), 3: (0.74, 0.83)},
        (2, "sync"): {1: (0.40, 0.50), 3: (0.60, 0.70)},
        (2, "async"): {1: (0.40, 0.52), 3: (0.62, 0.71)},
    }
    for (seed, variant), values in evaluations.items():
        write_run(runs / f"seed_{seed}" / variant, [0.5, 0.6, 0.7, 0.8], evaluations=values)
    out = tmp_path / "out"
    tool = load_tool()
    arguments = ["--out", str(out), "--runs", str(runs), "--plot-only", "--seed-list", "1", "2"]
    assert tool.main(arguments) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["held_out"] is True
    seed_one = summary["variants"]["async"]["per_seed"]["1"]
    assert seed_one["heldout_sampled_final"] == 0.74 and seed_one["heldout_greedy_final"] == 0.83
    assert math.isclose(seed_one["heldout_sampled_mean"], (0.52 + 0.74) / 2)
    paired = summary["paired"]["async - sync"]
    assert math.isclose(paired["heldout_sampled_final"]["mean"], (0.04 + 0.02) / 2)
    assert math.isclose(paired["heldout_sampled_mean"]["mean"], (0.03 + 0.01) / 2)
    assert math.isclose(paired["heldout_greedy_final"]["mean"], (0.03 + 0.01) / 2)
    table = (out / "summary.md").read_text()
    # The evaluation after step 3 is of the weights after 4 updates: means over the two seeds.
    assert "| 4 | 0.650 | 0.750 | 0.680 | 0.770 |" in table
    assert "| 2 | 0.450 | 0.550 | 0.460 | 0.565 |" in table
    assert "- `async - sync`, held-out reward, final weights: " in table
    # Runs without evaluations (made before the tool evaluated): no held-out statistics.
    write_run(runs / "seed_3" / "sync", [0.5, 0.6])
    write_run(runs / "seed_3" / "async", [0.5, 0.6])
    assert tool.main([*arguments[:-3], "--seed-list", "3"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["held_out"] is False
        and "heldout_sampled_final" not in summary["paired"]["async - sync"]
    )
    assert "Held-out" not in (out / "summary.md").read_text()


def test_each_variant_is_paired_with_the_baseline(tmp_path):
    """Three variants, two seeds: each asynchronous variant gets its own paired difference from
    sync, its own column and verdicts named after it."""
    runs = tmp_path / "runs"
    for seed in (1, 2):
        base = [0.5 + 0.1 * seed + 0.01 * step for step in range(4)]
        write_run(runs / f"seed_{seed}" / "sync", base)
        write_run(runs / f"seed_{seed}" / "async", [r - 0.02 * seed for r in base])
        write_run(runs / f"seed_{seed}" / "async_token", [r + 0.01 * seed for r in base])
    out = tmp_path / "out"
    arguments = ["--out", str(out), "--runs", str(runs), "--plot-only", "--last", "2"]
    variants = ["--variants", "async", "async_token", "--seed-list", "1", "2"]
    assert load_tool().main([*arguments, *variants]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["variants"]) == ["sync", "async", "async_token"]
    assert list(summary["paired"]) == ["async - sync", "async_token - sync"]
    token = summary["paired"]["async_token - sync"]["reward_mean_last_2"]
    assert math.isclose(token["mean"], 0.015) and token["seeds"] == [1, 2]
    asynchronous = summary["paired"]["async - sync"]["reward_mean_last_2"]
    assert math.isclose(asynchronous["mean"], -0.03)
    table = (out / "summary.md").read_text()
    # Seed 2's per-seed row: one paired column per asynchronous variant.
    assert "| 2 | 0.725 | 0.715 | 0.685 | 0.675 | 0.745 | 0.735 | -0.040 | +0.020 |" in table
    assert "- `async_token - sync`, last 2 steps: no difference detected" in table
    assert "async_token is at most" in table
