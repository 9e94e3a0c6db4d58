"""Offline torch_dist -> HF conversion (no Megatron): key layouts, sharded output, the CLI.

Checkpoints here are written with ``torch.distributed.checkpoint.save`` in each of Megatron's key
layouts (stacked layers, per-layer keys, singleton experts with gate/up halves), or by the
benchmark's chunk-by-chunk writer; the Megatron-written ones are covered by
``test_megatron_equivalence.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import transformers
from safetensors.torch import load_file

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.export import convert_torch_dist_to_hf
from megatron_gspo.convert.hf_config import model_config_from_hf, read_hf_config
from megatron_gspo.convert.mapping import (
    ConversionError,
    megatron_from_hf,
    megatron_parameter_shapes,
    parse_megatron_name,
)
from megatron_gspo.convert.safetensors_io import HFCheckpointReader
from megatron_gspo.convert.torch_dist import TorchDistCheckpoint

from .tiny_models import build_hf_model, hf_logits, input_ids

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI = REPO_ROOT / "tools" / "convert_checkpoint.py"


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A Qwen3-MoE without dense layers (so every layer can be stacked) and its full Megatron
    tensors in one-process naming."""
    directory = tmp_path_factory.mktemp("hf_moe")
    hf_model = build_hf_model("qwen3_moe")
    hf_model.config.mlp_only_layers = []
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_model.config).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise)
    hf_model.save_pretrained(directory)
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    model = model_config_from_hf(read_hf_config(str(directory)))
    hf_state = load_file(directory / "model.safetensors")
    megatron = {
        name: megatron_from_hf(name, hf_state.__getitem__, model)
        for name in megatron_parameter_shapes(model)
    }
    return directory, model, hf_state, megatron


def stacked_state_dict(model: ModelConfig, megatron: dict) -> dict:
    """Megatron's homogeneous layout: ``decoder.layers.<rest>`` [L, ...], experts [L, E, ...],
    norms under their TE names."""
    out, layers = {}, {}
    for name, tensor in megatron.items():
        key = parse_megatron_name(name)
        if key.layer is None:
            out[name] = tensor
            continue
        rest = name.split(".", 3)[3]
        rest = rest.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
        rest = rest.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        if key.expert is not None:
            rest = rest.replace(f"local_experts.{key.expert}.", "experts.")
        layers.setdefault(rest, {})[(key.layer, key.expert)] = tensor
    for rest, parts in layers.items():
        if any(expert is not None for _, expert in parts):
            stacked = torch.stack(
                [
                    torch.stack([parts[(layer, e)] for e in range(model.num_experts)])
                    for layer in range(model.num_layers)
                ]
            )
        else:
            stacked = torch.stack([parts[(layer, None)] for layer in range(model.num_layers)])
        out[f"decoder.layers.{rest}"] = stacked
    return out


def singleton_state_dict(megatron: dict) -> dict:
    """``singleton_local_shards``: per-layer and per-expert keys, fc1 as ``_w`` / ``_v`` halves."""
    out = {}
    for name, tensor in megatron.items():
        key = parse_megatron_name(name)
        if key.expert is None:
            out[name] = tensor
            continue
        stored = name.replace(f"local_experts.{key.expert}.", f"experts.{key.expert}.")
        if key.kind == "expert_fc1":
            gate, up = tensor.chunk(2)
            out[stored + "_w"], out[stored + "_v"] = gate.clone(), up.clone()
        else:
            out[stored] = tensor
    return out


def assert_bit_exact(out_dir: Path, hf_state: dict) -> None:
    with HFCheckpointReader(str(out_dir)) as reader:
        assert sorted(reader.names()) == sorted(hf_state)
        for name, tensor in hf_state.items():
            assert torch.equal(reader.get(name), tensor), name


@pytest.mark.parametrize("layout", ["stacked", "singleton"])
def test_layouts_convert_bit_exact(layout, hf_moe, tmp_path):
    hf_dir, model, hf_state, megatron = hf_moe
    state = (
        stacked_state_dict(model, megatron)
        if layout == "stacked"
        else singleton_state_dict(megatron)
    )
    # Optimizer state repeats model keys under another prefix: it must be skipped.
    state["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.zeros(64)
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    summary = convert_torch_dist_to_hf(
        str(tmp_path / "ckpt"), str(tmp_path / "hf"), model, origin_hf=str(hf_dir)
    )
    assert summary.skipped_keys == ["optimizer.state.exp_avg.decoder.final_layernorm.weight"]
    assert_bit_exact(tmp_path / "hf", hf_state)
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    tokens = input_ids(model.vocab_size)
    assert torch.equal(hf_logits(exported, tokens), hf_logits(original, tokens))


def test_sharded_output_index_and_dtype(hf_moe, tmp_path):
    hf_dir, model, hf_state, megatron = hf_moe
    dcp.save(stacked_state_dict(model, megatron), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    summary = convert_torch_dist_to_hf(
        str(tmp_path / "ckpt"),
        str(tmp_path / "hf"),
        model,
        max_shard_bytes=50_000,
        dtype=torch.bfloat16,
    )
    files = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert files == summary.shard_files and len(files) > 3
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(hf_state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in hf_state.values())
    for file in files:
        shard = load_file(tmp_path / "hf" / file)
        # One tensor may exceed the limit alone (as in save_pretrained); others never share.
        if len(shard) > 1:
            assert sum(t.numel() * 2 for t in shard.values()) <= 50_000
        for name, tensor in shard.items():
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, hf_state[name].to(torch.bfloat16))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"


def test_incomplete_checkpoint_is_rejected_and_nothing_is_written(hf_moe, tmp_path):
    _, model, _, megatron = hf_moe
    state = singleton_state_dict(megatron)
    del state["decoder.layers.1.mlp.experts.experts.3.linear_fc2.weight"]
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with pytest.raises(ConversionError, match="1 parameters missing"):
        convert_torch_dist_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), model)
    assert not (tmp_path / "hf").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_existing_output_is_never_overwritten_silently(hf_moe, tmp_path):
    _, model, _, megatron = hf_moe
    dcp.save(singleton_state_dict(megatron), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("precious")
    with pytest.raises(ConversionError, match="already exists"):
        convert_torch_dist_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), model)
    assert (tmp_path / "hf" / "keep.txt").read_text() == "precious"
    convert_torch_dist_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), model, overwrite=True)
    assert not (tmp_path / "hf" / "keep.txt").exists()
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()


def test_wrong_architecture_is_rejected(hf_moe, tmp_path):
    _, model, _, megatron = hf_moe
    dcp.save(singleton_state_dict(megatron), checkpoint_id=tmp_path / "ckpt", no_dist=True)
    wrong = ModelConfig(architecture="qwen3_moe", num_experts=4, vocab_size=128, num_layers=2)
    with pytest.raises(ConversionError, match="does not match the model config"):
        convert_torch_dist_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), wrong)


def _load_benchmark():
    spec = importlib.util.spec_from_file_location(
        "convert_memory", REPO_ROOT / "benchmarks" / "convert_memory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_checkpoint_is_a_valid_dcp_and_reads_per_expert(tmp_path):
    """The benchmark's chunk-by-chunk writer produces what torch's own DCP loader reads, and the
    region reader returns exactly each expert's / layer's slice."""
    benchmark = _load_benchmark()
    model = ModelConfig(vocab_size=96, num_experts=4, first_k_dense_layers=1, num_layers=3)
    benchmark.write_synthetic_checkpoint(tmp_path / "ckpt", model, torch.float32, num_files=3)
    checkpoint = TorchDistCheckpoint(str(tmp_path / "ckpt"))
    full = {key: torch.empty(meta.size) for key, meta in checkpoint.tensors.items()}
    dcp.load(full, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    parameters, skipped = checkpoint.parameters()
    assert not skipped
    assert {parse_megatron_name(p.name) for p in parameters} == {
        parse_megatron_name(n) for n in megatron_parameter_shapes(model)
    }
    for parameter in parameters:
        (region,) = parameter.regions
        expected = full[region.key]
        for dim, (offset, size) in enumerate(zip(region.offsets, region.sizes)):
            expected = expected.narrow(dim, offset, size)
        for _ in range(region.squeeze):
            expected = expected.squeeze(0)
        assert torch.equal(checkpoint.read_parameter(parameter), expected), parameter.name


def _load_cli():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", CLI)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_help_and_errors(tmp_path, capsys):
    cli = _load_cli()
    for command in ([], ["hf-to-megatron"], ["megatron-to-hf"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([*command, "--help"])
        assert exit_info.value.code == 0
        assert "usage:" in capsys.readouterr().out
    out = str(tmp_path / "o")
    assert cli.main(["megatron-to-hf", "--ckpt", str(tmp_path), "--out", out]) == 2
    assert "--origin-hf" in capsys.readouterr().err  # says how to give the architecture
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["megatron-to-hf", "--ckpt", "c", "--out", "o", "--max-shard-size", "5 parsecs"])
    assert exit_info.value.code == 2 and "is not a size" in capsys.readouterr().err
    # The script also runs as a file (not only imported).
    result = subprocess.run([sys.executable, str(CLI), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "megatron-to-hf" in result.stdout


def test_parse_size():
    module = _load_cli()
    assert module.parse_size("5GB") == 5 * 10**9
    assert module.parse_size("2GiB") == 2 * 2**30
    assert module.parse_size("500mb") == 500 * 10**6
    assert module.parse_size("1234") == 1234


def test_convert_package_never_imports_megatron():
    code = (
        "import sys, megatron_gspo.convert, megatron_gspo.convert.export, "
        "megatron_gspo.convert.torch_dist\n"
        "loaded = [m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')]\n"
        "assert not loaded, loaded\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
