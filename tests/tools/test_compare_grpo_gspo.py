"""tools/compare_grpo_gspo.py: --quick runs every variant for real and writes every output file;
in the paper regime GSPO clips at least 10x GRPO's token fraction; the mismatch suite
runs on a bf16 engine and reports R3's routes as the engine's, layer by layer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "compare_grpo_gspo.py"
VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2", "grpo_r3")
MISMATCH_VARIANTS = (
    "gspo_recompute",
    "gspo_rollout",
    "grpo_rollout",
    "grpo_tis",
    "grpo_r2",
    "grpo_r3",
)
ASYNC_VARIANTS = ("gspo_async", "gspo_async_mu", "gspo_async_is", "grpo_async", "grpo_async_tis")
PLOTS = (
    "reward.png",
    "clip_fraction.png",
    "routing_change.png",
    "logprob_gap.png",
    "routing_vs_engine.png",
)


def test_help_explains_every_variant():
    result = subprocess.run(
        [sys.executable, str(TOOL), "--help"], capture_output=True, text=True, check=True
    )
    for variant in (*VARIANTS, *MISMATCH_VARIANTS, *ASYNC_VARIANTS):
        assert variant in result.stdout
    assert "--suite" in result.stdout and "--regime" in result.stdout


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
    assert (summary["suite"], summary["regime"]) == ("standard", "paper")
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
    # The paper regime: one update moves token ratios little, so GRPO's [0.8, 1.27] rarely clips
    # while GSPO's sequence ratios still leave [1 - 3e-4, 1 + 4e-4] (paper: ~100x).
    gspo = summary["variants"]["gspo"]["mean_clip_frac_token"]
    grpo = summary["variants"]["grpo"]["mean_clip_frac_token"]
    assert gspo > 0 and gspo >= 10 * grpo, (gspo, grpo)


@pytest.mark.slow
def test_mismatch_suite_runs_on_a_bf16_engine(tmp_path):
    """The mismatch suite's wiring, one variant, one step: the engine samples in bf16 (a real
    trainer-vs-engine gap), R3's training forward uses the engine's experts on every replayed
    layer and the summary reports it per layer. R2 against R3 and GSPO on the engine's
    log-probs, which need several runs, are tests/e2e/test_mismatch.py's (same settings)."""
    out = tmp_path / "mismatch"
    result = subprocess.run(
        [
            sys.executable, str(TOOL), "--suite", "mismatch", "--quick", "--steps", "1",
            "--variants", "grpo_r3", "--out", str(out), "--", "sft_warmup_steps=0",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["suite"] == "mismatch" and list(summary["variants"]) == ["grpo_r3"]
    r3 = summary["variants"]["grpo_r3"]
    assert r3["steps"] == 1
    assert r3["mean_rollout_log_prob_abs_diff"] > 1e-5  # bf16 engine vs fp32 trainer
    assert r3["mean_routing_mismatch_vs_rollout"] == 0.0
    layers = r3["mean_routing_mismatch_vs_rollout_per_layer"]
    assert len(layers) == 2 and set(layers.values()) == {0.0}, layers


def test_unknown_variant_is_refused(tmp_path):
    result = subprocess.run(
        [sys.executable, str(TOOL), "--variants", "gspo,ppo", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert "ppo" in result.stderr and "gspo_token" in result.stderr
    result = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--suite",
            "mismatch",
            "--variants",
            "gspo",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "gspo_rollout" in result.stderr


def load_tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare_grpo_gspo", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_sglang_mode_command_is_a_valid_config(tmp_path):
    """--rollout-engine sglang: each variant launches a bf16 SGLang server from the given
    interpreter with the CPU backend's flags, starts from the exported weights, syncs by disk,
    asks for routes; --quick uses a packable expert size; the overrides compose into a valid
    config (tests/real_sglang/test_bf16.py runs it for real)."""
    from megatron_gspo.config.loader import load_config

    tool = load_tool()
    args, overrides = tool.parse_args(
        ["--suite", "mismatch", "--quick", "--out", str(tmp_path), "--rollout-engine", "sglang"]
    )
    mode = tool.SGLangMode(python="/venv/bin/python", device="cpu", model_dir="/m")
    command = tool.run_command(args, "grpo_r3", overrides, mode, port=31234)
    assert command[1:3] == ["-m", "megatron_gspo.train"]
    run_overrides = command[3:]
    for expected in (
        "rollout.engine=sglang",
        "rollout.sglang.launch=true",
        "rollout.sglang.python=/venv/bin/python",
        "rollout.sglang.port=31234",
        "rollout.sglang.return_routes=true",
        "rollout.weight_transport=disk",
        "model.hf_path=/m",
        "model.moe_ffn_hidden_size=64",
        "algo.routing_replay=r3",
    ):
        assert expected in run_overrides, expected
    assert not any(o.startswith("rollout.dtype=") for o in run_overrides)
    cfg = load_config(None, [o for o in run_overrides if not o.startswith("model.hf_path=")])
    assert cfg.rollout.sglang.extra_args[:4] == ["--dtype", "bfloat16", "--device", "cpu"]
    assert cfg.requests_rollout_routes and cfg.model.moe_ffn_hidden_size == 64
    cfg.algo.routing_replay = "r2"
    assert cfg.requests_rollout_routes  # R2's routing metrics get the engine's routes too
    # On a GPU the server keeps its own flags; only the dtype is the suite's.
    mode.device = "cuda"
    gpu = tool.run_command(args, "grpo_r3", overrides, mode, port=31234)
    assert "rollout.sglang.extra_args=[--dtype,bfloat16]" in gpu


def test_sglang_mode_refuses_impossible_combinations(tmp_path):
    """Every problem at once, before any run starts, exit code 2."""
    result = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "--suite",
            "standard",
            "--rollout-engine",
            "sglang",
            "--sglang-python",
            str(tmp_path / "missing" / "python"),
            "--out",
            str(tmp_path / "out"),
            "--",
            "rollout.dtype=bfloat16",
            "rollout.sglang.urls=[http://127.0.0.1:1]",
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2, result.stderr
    assert "only the mismatch suite" in result.stderr
    assert "rollout.dtype, rollout.sglang.urls" in result.stderr
    assert "no executable file there" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out" / "gspo").exists()
    result = subprocess.run(
        [sys.executable, str(TOOL), "--sglang-device", "cpu", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "without --rollout-engine sglang" in result.stderr


def test_sglang_venv_variable_is_the_packages():
    """The tool spells the variable out (its --help imports no torch); it must be the one the
    package, tests and benchmark use."""
    from megatron_gspo.rollout.sglang_cpu import SGLANG_VENV_ENV

    assert load_tool().SGLANG_VENV_ENV == SGLANG_VENV_ENV


def _load_tool():
    sys.path.insert(0, str(TOOL.parent))
    try:
        import compare_grpo_gspo
    finally:
        sys.path.remove(str(TOOL.parent))
    return compare_grpo_gspo


def test_seed_summary_gives_intervals_and_paired_differences(tmp_path):
    """The summary of a comparison over seeds, from metrics files: per-variant intervals,
    paired differences from the first variant that exclude zero where every seed agrees, a
    banded plot."""
    tool = _load_tool()
    seeds = [1234, 1235, 1236]
    for offset, variant in ((0.0, "gspo"), (-0.3, "grpo")):
        for index, seed in enumerate(seeds):
            run_dir = tool.run_dir_of(tmp_path, variant, seed)
            run_dir.mkdir(parents=True)
            rows = [
                {
                    "step": step,
                    "reward_mean": 0.4 + offset + 0.05 * step + 0.01 * index,
                    "clip_frac_token": 0.01 * (1 + index),
                    "routing_change_frac": 0.1,
                    "grad_norm": 1.0,
                }
                for step in range(8)
            ]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = tool.summarize_seeds(
        tmp_path,
        ["gspo", "grpo"],
        seeds,
        {},
        suite="standard",
        regime="paper",
        threshold=0.5,
        collapse_drop=0.2,
    )
    final = summary["variants"]["gspo"]["final_reward"]
    assert final["n"] == 3 and final["low"] < final["mean"] < final["high"]
    difference = summary["paired"]["grpo - gspo"]["final_reward"]
    assert difference["mean"] == pytest.approx(-0.3) and difference["excludes_zero"] is True
    assert summary["variants"]["gspo"]["steps_to_threshold"]["n"] == 3
    assert summary["variants"]["grpo"]["steps_to_threshold"]["n"] == 0  # never reached
    table = (tmp_path / "summary.md").read_text()
    assert "| grpo - gspo |" in table and "-0.3 [" in table and " *" in table
    assert (tmp_path / "reward.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow
def test_seeds_run_in_parallel_and_a_rerun_keeps_finished_runs(tmp_path):
    out = tmp_path / "seeds"
    command = [
        sys.executable, str(TOOL), "--quick", "--steps", "2", "--seeds", "2", "--jobs", "2",
        "--variants", "gspo,grpo", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["seeds"] == [1234, 1235]
    for variant in ("gspo", "grpo"):
        assert set(summary["variants"][variant]["per_seed"]) == {"1234", "1235"}
        assert (out / variant / "seed_1235.log").exists()
    # The two seeds are different runs, not one run twice.
    first, second = (
        (out / "gspo" / f"seed_{seed}" / "metrics.jsonl").read_text() for seed in (1234, 1235)
    )
    assert first != second
    # A killed comparison continues: the run without its finished record runs again, alone.
    (out / "grpo" / "seed_1235" / "compare_run.json").unlink()
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("finished before, kept") == 3
    assert "grpo seed 1235: " in result.stdout
