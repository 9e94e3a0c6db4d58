"""tools/compare_grpo_gspo.py --suite attribution (tools/compare_attribution.py): the fp32 twin's
gap is at float rounding, a bf16 engine's is orders of magnitude larger, and the table and its JSON
have every column; the rows' arithmetic (flip share, paired reward differences) on known
records; the options it refuses."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "compare_grpo_gspo.py"
sys.path.insert(0, str(REPO_ROOT / "tools"))
import compare_attribution  # noqa: E402
import compare_grpo_gspo  # noqa: E402

# The tiniest run that has a step: no cold start, one RL step of 4 prompts x 2 samples.
TINY = [
    "steps=1",
    "sft_warmup_steps=0",
    "algo.rollout_batch_size=4",
    "algo.num_return_sequences_in_group=2",
    "algo.response_length=8",
    "model.vocab_size=16",
]


def _run_tool(out: Path, *options: str, overrides: list[str] = TINY) -> subprocess.CompletedProcess:
    # Two runs at once, one core each (the tool sets OMP_NUM_THREADS for --jobs 2).
    return subprocess.run(
        [sys.executable, str(TOOL), "--suite", "attribution", "--jobs", "2", "--out", str(out)]
        + list(options)
        + ["--", *overrides],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env={key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"},
    )


def test_twin_is_exact_and_bf16_is_not_and_every_column_is_written(tmp_path):
    """Two real runs (the fp32 twin, added to any selection, and a bf16 engine), one step each."""
    out = tmp_path / "attribution"
    result = _run_tool(out, "--sources", "bf16", "--corrections", "none")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "attribution.json").read_text())
    assert summary["columns"] == list(compare_attribution.TABLE_KEYS)
    rows = {row["variant"]: row for row in summary["rows"]}
    assert list(rows) == ["fp32_twin", "bf16"]  # the twin first: the differences' baseline
    for row in rows.values():
        assert set(compare_attribution.TABLE_KEYS) <= set(row)
        assert row["seeds"] == [compare_grpo_gspo.DEFAULT_SEED]
    twin, bf16 = rows["fp32_twin"]["log_prob_gap"]["mean"], rows["bf16"]["log_prob_gap"]["mean"]
    # The fp32 engine is the trainer's twin: they differ by float32 rounding only (~1e-7 per
    # token). bf16 has 8 bits of mantissa: ~1e-3 (docs/compare_grpo_gspo.md).
    assert twin <= 1e-6, twin
    assert bf16 >= 1e-4 and bf16 >= 100 * twin, (bf16, twin)
    assert rows["fp32_twin"]["kl_k3"]["mean"] < 1e-10 < rows["bf16"]["kl_k3"]["mean"]
    assert rows["bf16"]["seq_log_ratio"]["mean"] > 10 * rows["fp32_twin"]["seq_log_ratio"]["mean"]
    assert rows["bf16"]["routing_flips"]["mean"] is not None
    assert 0.0 <= rows["bf16"]["reward_auc"]["mean"] <= 1.0
    table = (out / "attribution.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| source |"))
    titles = [cell.strip() for cell in header.strip("|").split("|")]
    expected = (
        ["source", "correction"]
        + [title for _, _, title in compare_attribution.COLUMNS]
        + ["flip share"]
        + [title for _, title in compare_attribution.REWARD_COLUMNS]
        + [title for _, title in compare_attribution.DIFFERENCE_COLUMNS]
    )
    assert titles == expected
    assert "| fp32_twin | none |" in table and "| bf16 | none |" in table
    for plot in summary["plots"]:
        assert (out / plot).read_bytes().startswith(b"\x89PNG"), plot


def _records(gap: float, rewards: list[float], flips: float = 0.0) -> list[dict]:
    return [
        {
            "step": step,
            "reward_mean": reward,
            "rollout_log_prob_abs_diff": gap,
            "routing_mismatch_vs_rollout": flips,
        }
        for step, reward in enumerate(rewards)
    ]


def test_rows_give_flip_share_and_paired_reward_differences():
    runs = {
        "fp32_twin": {1: _records(1e-7, [0.1, 0.2]), 2: _records(1e-7, [0.1, 0.3])},
        "bf16": {1: _records(4e-3, [0.1, 0.1], 0.02), 2: _records(4e-3, [0.1, 0.2], 0.02)},
        "bf16+r3": {1: _records(1e-3, [0.2, 0.3]), 2: _records(1e-3, [0.2, 0.4])},
    }
    rows = {
        row["variant"]: row
        for row in compare_attribution.attribution_rows(runs, threshold=0.5, collapse_drop=0.2)
    }
    # Replaying the engine's routes removed 3/4 of the bf16 gap: the flips' share.
    assert rows["bf16"]["flip_share"] == pytest.approx(0.75)
    assert rows["fp32_twin"]["flip_share"] is None  # no r3 run of the twin
    # Reward AUC per step: twin 0.15 and 0.2, bf16 0.1 and 0.15, bf16+r3 0.25 and 0.3.
    versus_twin = rows["bf16"]["reward_vs_twin"]
    assert versus_twin["mean"] == pytest.approx(-0.05) and versus_twin["seeds"] == [1, 2]
    assert rows["bf16+r3"]["reward_vs_uncorrected"]["mean"] == pytest.approx(0.15)
    assert rows["bf16+r3"]["reward_vs_twin"] is None  # no fp32_twin+r3 run to pair with
    assert rows["fp32_twin"]["reward_vs_twin"] is None
    assert rows["bf16"]["routing_flips"]["mean"] == pytest.approx(0.02)
    assert rows["bf16"]["log_prob_gap"]["n"] == 2


def test_selection_puts_the_twin_first_and_refuses_what_it_cannot_run(tmp_path):
    def select(*options: str) -> tuple[list[str], list[str]]:
        args, _ = compare_grpo_gspo.parse_args(
            ["--suite", "attribution", "--out", str(tmp_path), *options]
        )
        return compare_attribution.selected_variants(args)

    variants, problems = select("--sources", "stale1,bf16", "--corrections", "none,tis")
    assert problems == []
    assert variants == [
        "fp32_twin",
        "fp32_twin+tis",
        "stale1",
        "stale1+tis",
        "bf16",
        "bf16+tis",
    ]
    # The trainer's routes forced into a bf16 engine: its own source, a config override.
    variants, problems = select("--sources", "bf16_trainer_routes", "--corrections", "none,r3")
    assert problems == []
    assert variants == [
        "fp32_twin",
        "fp32_twin+r3",
        "bf16_trainer_routes",
        "bf16_trainer_routes+r3",
    ]
    assert compare_attribution.VARIANTS["bf16_trainer_routes"] == [
        "rollout.dtype=bfloat16",
        "rollout.embedded_route_source=float32_twin",
    ]
    _, problems = select("--sources", "bf8", "--corrections", "magic")
    assert problems == ["unknown source 'bf8'", "unknown correction 'magic'"]
    _, problems = select("--rollout-engine", "sglang")
    assert any("embedded engine" in problem for problem in problems)
    # The suite's options given to another suite would be ignored: refused instead.
    refused = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(tmp_path), "--sources", "bf16"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2 and "--sources belong to --suite attribution" in refused.stderr
    # Every variant's command composes: the algorithm and one optimizer step per batch come
    # after --quick's mini-batches, the source and correction last.
    args, overrides = compare_grpo_gspo.parse_args(
        ["--suite", "attribution", "--quick", "--out", str(tmp_path)]
    )
    command = compare_grpo_gspo.run_command(args, "bf16_stale1+r3", overrides, seed=1)
    assert command.index("algo.num_mini_batches=4") < command.index("algo.num_mini_batches=1")
    assert command[-4:-1] == [
        "rollout.dtype=bfloat16",
        "rollout.max_staleness=1",
        "algo.routing_replay=r3",
    ]


@pytest.mark.slow
def test_staleness_batch_composition_and_routing_replay_rows(tmp_path):
    """Every source switched by a config key runs, and R3 gives a flip share; two steps, so a
    stale source has samples a version old."""
    out = tmp_path / "attribution"
    overrides = [o if o != "steps=1" else "steps=3" for o in TINY]
    result = _run_tool(
        out,
        "--sources",
        "bf16,fp16,batch1,stale1,stale2,bf16_batch1,bf16_stale1,bf16_trainer_routes",
        "--corrections",
        "none,r3",
        overrides=overrides,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((out / "attribution.json").read_text())["rows"]}
    assert len(rows) == 18
    assert rows["stale1"]["staleness"]["mean"] > 0
    assert rows["stale2"]["staleness"]["mean"] >= rows["stale1"]["staleness"]["mean"]
    assert rows["fp16"]["log_prob_gap"]["mean"] > 10 * rows["fp32_twin"]["log_prob_gap"]["mean"]
    assert rows["bf16"]["flip_share"] is not None
    assert rows["bf16+r3"]["routing_flips"]["mean"] == 0.0  # R3: the engine's experts
    # The trainer's routes in the bf16 engine: bf16's precision gap, and as few flips as the
    # fp32 twin has (none: the float32 copy that chooses routes as the trainer does).
    forced = rows["bf16_trainer_routes"]
    assert forced["log_prob_gap"]["mean"] > 10 * rows["fp32_twin"]["log_prob_gap"]["mean"]
    assert forced["routing_flips"]["mean"] == rows["fp32_twin"]["routing_flips"]["mean"] == 0.0


def test_retokenize_runs_on_the_text_model_against_its_own_twin(tmp_path, qwen_tokenizer_dir):
    """The retokenize source needs a real tokenizer: it and its baseline, ``qwen_twin``, run on
    the text model (Qwen's vocabulary), and its paired differences come from that twin."""

    def select(*options: str, overrides: list[str] = ()) -> tuple[list[str], list[str]]:
        args, _ = compare_grpo_gspo.parse_args(
            ["--suite", "attribution", "--out", str(tmp_path), *options]
        )
        return compare_attribution.selected_variants(args, list(overrides))

    variants, problems = select("--sources", "retokenize,bf16", "--corrections", "none,r3")
    assert problems == []
    # Each model's twin first; R3 cannot replay routes of re-encoded tokens: left out.
    assert variants == [
        "fp32_twin",
        "fp32_twin+r3",
        "qwen_twin",
        "qwen_twin+r3",
        "retokenize",
        "bf16",
        "bf16+r3",
    ]
    assert select("--sources", "retokenize")[0] == ["qwen_twin", "qwen_twin+r3", "retokenize"]
    _, problems = select("--sources", "retokenize", overrides=["model.hf_path=/models/x"])
    assert len(problems) == 1 and "text model" in problems[0]
    # Every source by default with your own model: the text model's sources are left out.
    variants, problems = select(overrides=["model.hf_path=/models/x"])
    assert problems == [] and not {"qwen_twin", "retokenize"} & set(variants)
    args, overrides = compare_grpo_gspo.parse_args(
        ["--suite", "attribution", "--quick", "--out", str(tmp_path)]
    )
    command = compare_grpo_gspo.run_command(args, "retokenize", overrides, seed=1)
    # The text model's overrides come after --quick's 16-token vocabulary, the source's last.
    assert command.index("model.vocab_size=16") < command.index("model.vocab_size=151936")
    assert f"data.tokenizer_path={tmp_path / 'qwen_text' / 'tokenizer'}" in command
    assert command[-2] == "rollout.retokenize_responses=true"
    twin = compare_grpo_gspo.run_command(args, "qwen_twin", overrides, seed=1)
    assert twin[:-1] == [o for o in command[:-1] if o != "rollout.retokenize_responses=true"]
    # The files the text model reads (the tokenizer given here: building it costs 5 s).
    shutil.copytree(qwen_tokenizer_dir, tmp_path / "qwen_text" / "tokenizer")
    assert compare_attribution.prepare_models(["qwen_twin", "retokenize"], tmp_path) == []
    prompts = (tmp_path / "qwen_text" / "arithmetic.jsonl").read_text().splitlines()
    assert len(prompts) == compare_attribution.TEXT_PROMPTS and "\\\\boxed" in prompts[0]
    # Rows: retokenize's reward difference is taken from qwen_twin on the same seeds.
    runs = {
        "fp32_twin": {1: _records(1e-7, [0.5, 0.5])},
        "qwen_twin": {1: _records(3e-7, [0.0, 0.1])},
        "retokenize": {1: _records(0.6, [0.0, 0.0])},
    }
    rows = {
        row["variant"]: row
        for row in compare_attribution.attribution_rows(runs, threshold=0.5, collapse_drop=0.2)
    }
    assert rows["retokenize"]["baseline"] == "qwen_twin"
    assert rows["retokenize"]["reward_vs_twin"]["mean"] == pytest.approx(-0.05)
    assert rows["qwen_twin"]["reward_vs_twin"] is None


@pytest.mark.slow
def test_retokenize_rows_from_real_runs(tmp_path):
    """Two real runs on the text model (its twin and retokenize), one step each: the twin is
    exact, retokenization changes responses and moves the per-token gap by orders of magnitude."""
    out = tmp_path / "attribution"
    result = _run_tool(out, "--sources", "retokenize", "--corrections", "none")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads((out / "attribution.json").read_text())["rows"]}
    assert list(rows) == ["qwen_twin", "retokenize"]
    assert rows["qwen_twin"]["log_prob_gap"]["mean"] <= 1e-6
    assert rows["qwen_twin"]["retokenized_frac_seq"]["mean"] is None
    assert rows["retokenize"]["retokenized_frac_seq"]["mean"] > 0
    assert 0 < rows["retokenize"]["retokenized_frac_token"]["mean"] < 1
    assert (
        rows["retokenize"]["log_prob_gap"]["mean"] > 1e3 * rows["qwen_twin"]["log_prob_gap"]["mean"]
    )
    assert rows["retokenize"]["routing_flips"]["mean"] is None  # no routes for re-encoded tokens
