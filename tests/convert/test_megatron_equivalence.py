"""HF -> Megatron -> HF with real Megatron-Core models (CPU, fp32, gloo).

For every architecture: the Megatron policy loaded from an HF directory gives transformers' logits
(to 1e-5), streaming it back gives the HF tensors bit for bit, and its ``torch_dist`` checkpoint
converted offline gives them too and loads in transformers with identical logits. Layouts: one
process, tp2 + ep2 (4 processes), pp2 + ep2 (4 processes, no forward: the pipeline schedule is
the engine's business; the gather across stages is ours).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from free_ports import free_port  # tests/free_ports.py: safe beside other workers
from safetensors.torch import load_file
from selected_params import selected_params  # tests/selected_params.py

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.export import convert_torch_dist_to_hf
from megatron_gspo.convert.hf_config import resolve_model_config
from megatron_gspo.convert.mapping import megatron_to_hf
from megatron_gspo.convert.safetensors_io import HFCheckpointReader

from .tiny_models import ARCHITECTURES, hf_logits, write_all

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("megatron_worker.py")
CLI = REPO_ROOT / "tools" / "convert_checkpoint.py"
LOGIT_TOLERANCE = 1e-5
FOUR_PROCESS_ARCHITECTURES = [a for a in ARCHITECTURES if a not in ("glm4_moe", "deepseek_v3")]
"""glm4_moe's tp2 x ep2 conversion is in the slow tier (test_glm4_moe_tp2_ep2): its layouts are in
tests/engine/test_layouts.py, its mapping in test_one_process."""
PP2_ARCHITECTURES = ("qwen3_moe", "qwen3")
SLOW_FOUR_PROCESS_RUNS = {"mixtral_tp2_ep2", "qwen2_moe_tp2_ep2", "qwen3_moe_pp2_ep2"}
"""Left to the full run (``--full``): CI gathers tp2 x ep2 shards of Qwen3-MoE and the dense
Qwen3 (tp2 x dp2), and pp2 stages of the tied Qwen3 (the embedding's copy on the last stage);
the other families' shards go through the same gather, and their mappings run in
test_one_process."""


def four_process_params(runs: list[tuple[str, str]]) -> list:
    """``(run name, architecture)`` pairs as parameters, the slow ones marked."""
    return [
        pytest.param(architecture, marks=pytest.mark.slow, id=architecture)
        if name in SLOW_FOUR_PROCESS_RUNS
        else pytest.param(architecture, id=architecture)
        for name, architecture in runs
    ]


BIAS_UPDATE_RATE = 0.01


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_models")
    write_all(root)
    return root


def run_worker(hf_root: Path, out: Path, plan: list[dict], nproc: int = 1) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    arguments = [str(WORKER), "--hf-root", str(hf_root), "--out", str(out)]
    arguments += ["--plan", json.dumps(plan)]
    if nproc == 1:
        command = [sys.executable, *arguments]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            *arguments,
        ]
    environment = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    return out


@pytest.fixture(scope="module")
def one_process(hf_root, tmp_path_factory):
    """Every architecture in one process, plus one training step of Qwen3-MoE (one worker
    process for all, to pay Megatron's start-up once)."""
    plan = [{"name": a, "architecture": a} for a in ARCHITECTURES]
    plan.append({"name": "qwen3_moe_trained", "architecture": "qwen3_moe", "train": True})
    plan.append({"name": "glm4_moe_trained", "architecture": "glm4_moe", "train": True})
    plan.append(
        {
            "name": "glm4_moe_bias_updated",
            "architecture": "glm4_moe",
            "train": True,
            "bias_update_rate": BIAS_UPDATE_RATE,
        }
    )
    return run_worker(hf_root, tmp_path_factory.mktemp("one_process"), plan)


@pytest.fixture(scope="module")
def four_processes(request, hf_root, tmp_path_factory):
    """tp2 + sequence parallel + ep2 (dp2) for every architecture (the dense Qwen3 as tp2 + dp2;
    Mixtral's vocabulary 127 padded to 128), then pp2 + ep2 (no forward: the pipeline schedule
    is the engine's business, the gather across stages is ours) for Qwen3-MoE and the tied
    Qwen3, whose last stage holds a copy of the embedding that must not be exported twice.
    Only the runs of the selected tests are launched (CI leaves SLOW_FOUR_PROCESS_RUNS out)."""
    selected = {
        f"{architecture}_{test.removeprefix('test_')}"
        for test, architecture in selected_params(
            request, ("test_tp2_ep2", "test_pp2_ep2"), "architecture"
        )
    }
    plan = [
        {"name": f"{a}_tp2_ep2", "architecture": a, "tp": 2, "ep": 2 if a != "qwen3" else 1}
        for a in FOUR_PROCESS_ARCHITECTURES
    ]
    plan += [
        {"name": f"{a}_pp2_ep2", "architecture": a, "pp": 2, "ep": 2 if a != "qwen3" else 1}
        for a in PP2_ARCHITECTURES
    ]
    plan = [run for run in plan if run["name"] in selected]
    return run_worker(hf_root, tmp_path_factory.mktemp("four_processes"), plan, nproc=4)


def check_run(
    hf_root: Path, out: Path, run_name: str, architecture: str, *, with_logits: bool
) -> None:
    hf_dir = hf_root / architecture
    hf_state = load_file(hf_dir / "model.safetensors")
    reference = torch.load(hf_dir / "reference.pt")
    result = torch.load(out / f"{run_name}.pt")

    if with_logits:
        difference = (result["logits"] - reference["logits"]).abs().max().item()
        assert difference < LOGIT_TOLERANCE, f"{architecture}: max |logit diff| {difference}"
    assert result["load_report"]["unused_hf_tensors"] == []

    streamed = result["hf_weights"]
    assert sorted(streamed) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(streamed[name], tensor), f"{architecture}: streamed {name} differs"

    # After a weight sync, the rollout engine holds exactly the trainer's weights.
    engine_weights = result["engine_weights"]
    assert sorted(engine_weights) == sorted(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(engine_weights[name], tensor), f"{architecture}: synced {name} differs"
    model_bytes = sum(t.numel() * t.element_size() for t in hf_state.values())
    assert result["sync_stats"] == {"tensors": len(hf_state), "bytes": model_bytes}

    with HFCheckpointReader(str(out / f"{run_name}_live_export")) as reader:
        assert sorted(reader.names()) == sorted(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(reader.get(name), tensor), f"{architecture}: live export {name}"

    model = resolve_model_config(ModelConfig(hf_path=str(hf_dir)))
    exported = out / f"{run_name}_hf"
    convert_torch_dist_to_hf(
        str(out / f"{run_name}_ckpt"), str(exported), model, origin_hf=str(hf_dir)
    )
    with HFCheckpointReader(str(exported)) as reader:
        assert sorted(reader.names()) == sorted(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(reader.get(name), tensor), f"{architecture}: exported {name} differs"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="eager"
    )
    assert torch.equal(hf_logits(loaded, reference["input_ids"]), reference["logits"])
    assert (exported / "tokenizer_config.json").read_text() == (
        hf_dir / "tokenizer_config.json"
    ).read_text()


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_one_process(architecture, hf_root, one_process):
    check_run(hf_root, one_process, architecture, architecture, with_logits=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "architecture", four_process_params([(f"{a}_tp2_ep2", a) for a in FOUR_PROCESS_ARCHITECTURES])
)
def test_tp2_ep2(architecture, hf_root, four_processes):
    check_run(hf_root, four_processes, f"{architecture}_tp2_ep2", architecture, with_logits=True)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "architecture", four_process_params([(f"{a}_pp2_ep2", a) for a in PP2_ARCHITECTURES])
)
def test_pp2_ep2(architecture, hf_root, four_processes):
    check_run(hf_root, four_processes, f"{architecture}_pp2_ep2", architecture, with_logits=False)


def test_cli_round_trip(hf_root, tmp_path):
    """``hf-to-megatron`` then ``megatron-to-hf`` through the command line: bit-exact."""
    hf_dir = hf_root / "qwen2_moe"
    environment = os.environ | {"OMP_NUM_THREADS": "1"}
    for command in (
        ["hf-to-megatron", "--hf", str(hf_dir), "--out", str(tmp_path / "ckpt")],
        [
            "megatron-to-hf",
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "hf"),
            "--origin-hf",
            str(hf_dir),
            "--max-shard-size",
            "40KB",
        ],
    ):
        result = subprocess.run(
            [sys.executable, str(CLI), *command],
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert not list(tmp_path.glob("*.tmp*")), "temporary directories left behind"
    hf_state = load_file(hf_dir / "model.safetensors")
    with HFCheckpointReader(str(tmp_path / "hf")) as reader:
        assert sorted(reader.names()) == sorted(hf_state)
        assert all(torch.equal(reader.get(name), hf_state[name]) for name in hf_state)
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1


def test_exported_checkpoint_after_one_step_differs_only_where_training_changed(
    hf_root, one_process, tmp_path
):
    """Load HF, take one GSPO optimizer step, save a training checkpoint (weights, optimizer
    state, RNG, checkpoint.json), export it with the CLI given only the checkpoint root: every
    exported tensor equals the mapped updated weights, and it differs from the original HF tensor
    exactly at the elements the step changed (embedding rows of unseen tokens stay identical)."""
    hf_dir = hf_root / "qwen3_moe"
    result = torch.load(one_process / "qwen3_moe_trained.pt")
    model = resolve_model_config(ModelConfig(hf_path=str(hf_dir)))
    original = load_file(hf_dir / "model.safetensors")
    exported_dir = tmp_path / "exported"
    command = ["megatron-to-hf", "--ckpt", str(one_process / "qwen3_moe_trained_root")]
    command += ["--out", str(exported_dir), "--json"]
    completed = subprocess.run(
        [sys.executable, str(CLI), *command], capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    summary = json.loads(completed.stdout)
    assert summary["skipped_keys"] and all(
        key.startswith("optimizer.") for key in summary["skipped_keys"]
    )
    with HFCheckpointReader(str(exported_dir)) as reader:
        exported = {name: reader.get(name) for name in reader.names()}
    assert sorted(exported) == sorted(original)
    for name, before in result["before"].items():
        after = result["after"][name]
        mapped_after = dict(megatron_to_hf(name, after, model))
        mapped_changed = dict(megatron_to_hf(name, after != before, model))
        for hf_name, tensor in mapped_after.items():
            assert torch.equal(exported[hf_name], tensor), hf_name
            assert torch.equal(exported[hf_name] != original[hf_name], mapped_changed[hf_name])
    # The step did something, and not everything: unseen tokens' embedding rows are untouched.
    embedding_changed = (
        exported["model.embed_tokens.weight"] != original["model.embed_tokens.weight"]
    ).any(1)
    assert embedding_changed[: model.vocab_size // 4].any()
    assert not embedding_changed[model.vocab_size // 4 :].any()


def test_glm4_moe_correction_bias_is_frozen_by_default_and_moves_at_the_configured_rate(
    hf_root, one_process
):
    """GLM-4.5's score-correction bias (Megatron's ``expert_bias`` buffer) through one GSPO
    optimizer step of the engine (Megatron's ``finalize_model_grads`` included): unchanged with
    the default ``model.moe_router_bias_update_rate=0``, while the trained weights move; with a
    rate, every expert's bias moves by exactly -rate, 0 or +rate (aux-loss-free balancing: up for
    experts below the mean load, down above it), both directions present."""
    frozen = torch.load(one_process / "glm4_moe_trained.pt")
    bias_name = "decoder.layers.1.mlp.router.expert_bias"
    original = load_file(hf_root / "glm4_moe" / "model.safetensors")
    hf_bias = original["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(frozen["before"][bias_name], hf_bias)
    assert torch.equal(frozen["after"][bias_name], hf_bias)
    router = "decoder.layers.1.mlp.router.weight"
    assert not torch.equal(frozen["after"][router], frozen["before"][router])

    updated = torch.load(one_process / "glm4_moe_bias_updated.pt")
    assert torch.equal(updated["before"][bias_name], hf_bias)
    delta = (updated["after"][bias_name] - hf_bias).double()
    moved = delta != 0
    assert moved.any()
    torch.testing.assert_close(
        delta[moved].abs(), torch.full_like(delta[moved], BIAS_UPDATE_RATE), rtol=0, atol=1e-6
    )
    assert (delta > 0).any() and (delta < 0).any()


@pytest.mark.slow
@pytest.mark.distributed
def test_glm4_moe_tp2_ep2(hf_root, tmp_path_factory):
    """GLM-4.5 in tp2 + sequence parallel + ep2 (dp2): HF weights in (each rank its shards, the
    replicated correction bias on every rank), transformers' logits, and back bit for bit
    (stream, weight sync, live export, offline conversion). Slow tier: 43 s alone on 2 cores, the
    four processes' start-up included."""
    plan = [{"name": "glm4_moe_tp2_ep2", "architecture": "glm4_moe", "tp": 2, "ep": 2}]
    out = run_worker(hf_root, tmp_path_factory.mktemp("glm4_four"), plan, nproc=4)
    check_run(hf_root, out, "glm4_moe_tp2_ep2", "glm4_moe", with_logits=True)
