"""tools/rehearse_presets.py: the scaling rules against every preset (composed for real), one GPU
preset rehearsed end to end (train, resume, HF export, transformers load), and, in the slow
tier, every preset (docs/rehearsal.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import to_dict
from megatron_gspo.config.loader import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
TOOL = REPO_ROOT / "tools" / "rehearse_presets.py"
sys.path.insert(0, str(REPO_ROOT / "tools"))

import rehearse_presets as rehearsal  # noqa: E402 - tools/rehearse_presets.py

FAKE_SGLANG = "/opt/sglang-venv/bin/python"
"""A plan only writes the interpreter into rollout.sglang.python: nothing starts it here."""


def plan_of(preset: str, sglang_python=FAKE_SGLANG, steps: int = 2) -> rehearsal.Plan:
    composed, written = rehearsal.compose_preset(preset)
    return rehearsal.plan_rehearsal(
        preset,
        composed,
        written,
        world=rehearsal.PRESET_WORLD[preset],
        steps=steps,
        sglang_python=sglang_python,
        output_dir="/tmp/rehearsal-plan",
        port=31000,
    )


@pytest.mark.parametrize(
    ("parallel", "world", "expected", "processes"),
    [
        ({"tp": 8, "ep": 8}, 8, {"tp": 2, "ep": 2, "dp": 1}, 2),  # expert dp 1 kept
        ({"ep": 8}, 8, {"ep": 2, "dp": 2}, 2),  # the 1-node preset: expert dp 1
        ({"ep": 8}, 32, {"ep": 2, "dp": 4}, 4),  # the 4-node presets: expert dp 4 -> 2
        ({"pp": 4, "ep": 8}, 32, {"pp": 2, "ep": 2, "dp": 2}, 4),  # Mixtral
        ({"tp": 2, "ep": 2}, 4, {"tp": 2, "ep": 2, "dp": 2}, 4),  # cpu_tiny_4proc unchanged
        ({}, 1, {"dp": 1}, 1),
    ],
)
def test_layout_keeps_every_split_dimension_at_two(parallel, world, expected, processes):
    layout, count = rehearsal.scale_layout(parallel, world)
    full = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, **expected}
    assert (layout, count) == (full, processes)


def test_a_layout_beyond_four_processes_says_why():
    layout, why = rehearsal.scale_layout({"tp": 8, "pp": 8, "cp": 8}, 512)
    assert layout is None and "more than 4 processes" in why


def test_router_topk_scaled_to_the_same_sparsity():
    assert rehearsal.scale_topk(8, 128, 8) == 2  # Qwen3-30B-A3B: top-8 of 128
    assert rehearsal.scale_topk(2, 8, 8) == 2  # Mixtral: kept


def test_batch_reaches_every_rank_in_every_mini_batch():
    prompts, group = rehearsal.scale_batch(
        {"num_return_sequences_in_group": 16, "num_mini_batches": 4, "rollout_batch_size": 128},
        dp=4,
    )
    assert group == 4 and (prompts * group) % (4 * 4) == 0 and prompts <= 128


@pytest.mark.parametrize("preset", rehearsal.GPU_PRESETS)
def test_the_rehearsal_keeps_the_presets_flags(preset):
    """The rehearsal's configuration, composed by the trainer's loader from the preset plus the
    tool's overrides, equals the preset on every key reported kept, and the feature flags a user
    chose (precision, optimizer, algorithm, engine, transport, reward, data format) are among
    them; only reported keys change."""
    plan = plan_of(preset)
    assert plan.blocked is None
    rehearsed = rehearsal.flatten(to_dict(load_config(preset, plan.overrides())))
    original = rehearsal.flatten(to_dict(load_config(preset, [])))
    for key, value in plan.kept.items():
        assert rehearsed[key] == value == original[key], key
    changed = {change.key for change in plan.changes}
    for key in original:
        if rehearsed[key] != original[key]:
            assert key in changed, f"{key} changed without being reported"
    for key in ("algo.importance_sampling", "algo.adv_estimator", "algo.clip_low"):
        assert key in plan.kept
    if preset != "roll_gspo":
        for key in (
            "model.dtype",
            "model.architecture",
            "parallel.use_distributed_optimizer",
            "rollout.weight_transport",
            "algo.routing_replay",
            "data.apply_chat_template",
        ):
            assert key in plan.kept, key
        assert plan.kept["model.dtype"] == "bfloat16"
        if preset == "deepseek_v3_shaped_gspo_4node":
            # SGLang's CPU backend cannot serve MLA: the embedded engine samples instead.
            assert rehearsed["rollout.engine"] == "embedded"
            return
        assert plan.kept["rollout.engine"] == "sglang"
        assert rehearsed["rollout.sglang.launch"] is True
        assert rehearsed["rollout.sglang.python"] == FAKE_SGLANG
        assert rehearsed["rollout.sglang.extra_args"][:2] == ["--dtype", "bfloat16"]
        assert rehearsed["rollout.sglang.release_memory"] is False
        # The preset's reward still runs; a small length term gives a random model's groups
        # non-zero advantages (reported as a change).
        assert rehearsed["reward.functions"] == [
            *original["reward.functions"],
            rehearsal.LENGTH_REWARD,
        ]
        assert plan.nproc <= rehearsal.MAX_PROCESSES


def test_grpo_r3_keeps_routing_replay_and_qwen_vocabulary():
    plan = plan_of("qwen3_30b_a3b_grpo_r3")
    assert plan.kept["algo.routing_replay"] == "r3"
    assert plan.kept["model.vocab_size"] == 151_936  # the real Qwen tokenizer fits
    assert plan.model["moe_router_topk"] == 2 and plan.model["num_experts"] == 8
    assert plan.nproc == 4 and "parallel.ep=2" in plan.overrides()
    assert plan.tokenizer == "qwen" and plan.data_file


def test_mixtral_keeps_its_vocabulary_and_pipeline():
    plan = plan_of("mixtral_8x7b_gspo")
    assert plan.kept["model.vocab_size"] == 32_000 and plan.tokenizer == "mixtral"
    assert "parallel.pp=2" in plan.overrides() and "parallel.ep=2" in plan.overrides()
    assert plan.model["moe_router_topk"] == 2 and plan.model["ffn_hidden_size"] == 64


def test_an_sglang_preset_without_sglang_says_why():
    plan = plan_of("qwen3_30b_a3b_gspo_1node", sglang_python=None)
    assert plan.blocked and rehearsal.SGLANG_VENV_ENV in plan.blocked


def test_record_of_named_presets_replaces_their_rows_only(tmp_path):
    """``--record`` with named presets (a preset added since the last ``--all --record``):
    their rows and printouts replace or join the recorded ones, in the presets' order, the other
    presets' stay as they were, and the header says when the named ones ran."""
    doc = tmp_path / "rehearsal.md"
    doc.write_text((REPO_ROOT / "docs" / "rehearsal.md").read_text())
    before = doc.read_text()
    plan = plan_of("glm45_air_gspo_4node")
    result = rehearsal.Result(
        "glm45_air_gspo_4node", plan, stage_times={"prepare": 1.0, "train": 2.0}, steps=4
    )
    printout = "\n=== glm45_air_gspo_4node\n  scaled (key: preset -> rehearsal, why):\n    x\n"
    command = "python tools/rehearse_presets.py glm45_air_gspo_4node --record"
    rehearsal.record_rows([result], 2, command, printout, doc=doc)
    after = doc.read_text()
    block = after[after.index(rehearsal.RECORD_START) : after.index(rehearsal.RECORD_END)]
    rows = [line for line in block.splitlines() if line.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names == [name for name in rehearsal.ALL_PRESETS if name in names]
    (glm,) = [row for row in rows if row.startswith("| `glm45_air_gspo_4node` |")]
    assert glm.rstrip().endswith("| passed |") and "| 4 | 3 |" in glm
    for row in before.splitlines():  # every other preset's row is kept as it was
        if row.startswith("| `") and not row.startswith("| `glm45_air_gspo_4node` |"):
            assert row in rows
    assert "=== glm45_air_gspo_4node\n  scaled" in block and "=== cpu_demo" in block
    assert "Rows of `glm45_air_gspo_4node`: " in block and f"`{command}`" in block
    assert (
        after[: after.index(rehearsal.RECORD_START)]
        == before[: before.index(rehearsal.RECORD_START)]
    )
    assert (
        after[after.index(rehearsal.RECORD_END) :] == before[before.index(rehearsal.RECORD_END) :]
    )


def test_the_docs_table_lists_every_preset():
    page = (REPO_ROOT / "docs" / "rehearsal.md").read_text()
    recorded = page[page.index(rehearsal.RECORD_START) : page.index(rehearsal.RECORD_END)]
    for preset in rehearsal.ALL_PRESETS:
        assert f"| `{preset}` |" in recorded, f"{preset} missing: rerun --all --record"


def run_tool(arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, str(TOOL), *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO_ROOT,
    )


@pytest.mark.slow  # 40 s; the plan tests above check every preset's flags in CI
def test_roll_gspo_rehearsed_end_to_end(tmp_path):
    """ROLL's GSPO preset (the cheapest GPU preset: the embedded engine, one process) for real:
    one step, resumed to two, exported to HF and loaded by transformers."""
    result = run_tool(["roll_gspo", "--steps", "1", "--out", str(tmp_path)], timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "algo.dual_clip_loss=True " in output and "algo.kl_estimator=k3 " in output
    assert "algo.response_length: 4096 -> 16" in output
    row = next(line for line in output.splitlines() if line.startswith("| `roll_gspo`"))
    assert row.rstrip().endswith("| passed |"), row
    records = [
        json.loads(line)
        for line in (tmp_path / "roll_gspo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in records if "policy_loss" in r] == [0, 1]
    assert (tmp_path / "roll_gspo" / "hf_export" / "config.json").is_file()
    assert "Qwen3MoeForCausalLM" in output


@pytest.mark.slow
def test_every_preset_rehearsed(tmp_path):
    """The whole rehearsal (docs/rehearsal.md): every preset, its SGLang ones on a real SGLang
    CPU server."""
    if not os.environ.get(rehearsal.SGLANG_VENV_ENV):
        pytest.skip(f"the SGLang presets need {rehearsal.SGLANG_VENV_ENV} (SGLang's CPU venv)")
    result = run_tool(["--all", "--out", str(tmp_path)], timeout=3600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    for preset in rehearsal.ALL_PRESETS:
        row = next(line for line in output.splitlines() if line.startswith(f"| `{preset}`"))
        assert row.rstrip().endswith("| passed |"), row
