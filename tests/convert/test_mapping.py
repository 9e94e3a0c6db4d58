"""HF <-> Megatron name and tensor mapping on real transformers checkpoints (no Megatron)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import model_config_from_hf, read_hf_config
from megatron_gspo.convert.mapping import (
    ConversionError,
    hf_names_for,
    hf_parameter_shapes,
    interleave_qkv,
    megatron_from_hf,
    megatron_name,
    megatron_parameter_shapes,
    megatron_to_hf,
    parse_megatron_name,
    split_qkv,
)

from .tiny_models import ARCHITECTURES, write_hf_dir


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for architecture in ARCHITECTURES:
        dirs[architecture] = root / architecture
        write_hf_dir(architecture, dirs[architecture])
    return dirs


def reference_qkv_rows(q, k, v, heads, groups, head_dim):
    """Megatron's row order built head by head with explicit loops (the definition)."""
    rows = []
    heads_per_group = heads // groups
    for group in range(groups):
        for head in range(group * heads_per_group, (group + 1) * heads_per_group):
            rows.append(q[head * head_dim : (head + 1) * head_dim])
        rows.append(k[group * head_dim : (group + 1) * head_dim])
        rows.append(v[group * head_dim : (group + 1) * head_dim])
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 1), (4, 4), (6, 3)])
def test_qkv_interleave_matches_per_head_definition(heads, groups):
    head_dim, hidden = 3, 5
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(groups * head_dim, hidden)
    v = torch.randn(groups * head_dim, hidden)
    fused = interleave_qkv(q, k, v, groups, head_dim)
    assert torch.equal(fused, reference_qkv_rows(q, k, v, heads, groups, head_dim))
    for original, recovered in zip((q, k, v), split_qkv(fused, heads, groups, head_dim)):
        assert torch.equal(original, recovered)
    # Bias: the same row order without the hidden axis.
    bias = interleave_qkv(q[:, 0], k[:, 0], v[:, 0], groups, head_dim)
    assert torch.equal(bias, fused[:, 0])


def test_naive_concatenation_differs_with_grouped_query_attention():
    q, k, v = torch.randn(8, 2), torch.randn(4, 2), torch.randn(4, 2)
    assert not torch.equal(interleave_qkv(q, k, v, 2, 2), torch.cat([q, k, v]))


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_round_trip_is_bit_exact_and_covers_every_hf_tensor(architecture, hf_dirs):
    hf_dir = hf_dirs[architecture]
    model = model_config_from_hf(read_hf_config(str(hf_dir)))
    hf_state = load_file(hf_dir / "model.safetensors")
    exported = {}
    for style in ("local", "te"):
        for name, shape in megatron_parameter_shapes(model, style=style).items():
            full = megatron_from_hf(name, hf_state.__getitem__, model, full_shape=shape)
            assert tuple(full.shape) == shape
            for hf_name, tensor in megatron_to_hf(name, full, model):
                assert torch.equal(tensor, hf_state[hf_name]), (style, name, hf_name)
                exported[hf_name] = tensor
    assert set(exported) == set(hf_state)
    assert hf_parameter_shapes(model) == {k: tuple(v.shape) for k, v in hf_state.items()}


def test_gate_up_and_qkv_layout_against_transformers_modules(hf_dirs):
    """fc1 rows are [gate; up]; linear_qkv applied to x gives each group's [q, k, v] outputs."""
    hf_dir = hf_dirs["qwen3_moe"]
    model = model_config_from_hf(read_hf_config(str(hf_dir)))
    hf_state = load_file(hf_dir / "model.safetensors")
    fc1 = megatron_from_hf(
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
        hf_state.__getitem__,
        model,
    )
    x = torch.randn(5, model.hidden_size)
    gate, up = (x @ fc1.T).chunk(2, dim=-1)
    prefix = "model.layers.1.mlp.experts.3."
    torch.testing.assert_close(gate, x @ hf_state[prefix + "gate_proj.weight"].T)
    torch.testing.assert_close(up, x @ hf_state[prefix + "up_proj.weight"].T)

    qkv = megatron_from_hf(
        "decoder.layers.0.self_attention.linear_qkv.weight", hf_state.__getitem__, model
    )
    d, groups = model.head_dim, model.num_query_groups
    per_group = (x @ qkv.T).reshape(5, groups, -1)
    q_rows = model.num_attention_heads // groups * d
    attn = "model.layers.0.self_attn."
    q = (x @ hf_state[attn + "q_proj.weight"].T).reshape(5, groups, q_rows)
    k = (x @ hf_state[attn + "k_proj.weight"].T).reshape(5, groups, d)
    torch.testing.assert_close(per_group[..., :q_rows], q)
    torch.testing.assert_close(per_group[..., q_rows : q_rows + d], k)


def test_vocab_padding_added_on_import_and_stripped_on_export(hf_dirs):
    hf_dir = hf_dirs["mixtral"]
    model = model_config_from_hf(read_hf_config(str(hf_dir)))
    assert model.vocab_size == 127
    hf_state = load_file(hf_dir / "model.safetensors")
    for name, hf_name in (
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ):
        padded = megatron_from_hf(name, hf_state.__getitem__, model, full_shape=(130, 64))
        assert padded.shape == (130, 64)
        assert torch.equal(padded[:127], hf_state[hf_name])
        assert torch.equal(padded[127:], torch.zeros(3, 64))
        ((exported_name, exported),) = megatron_to_hf(name, padded, model)
        assert exported_name == hf_name and torch.equal(exported, hf_state[hf_name])


def test_tied_embeddings(hf_dirs):
    hf_dir = hf_dirs["qwen3"]
    model = model_config_from_hf(read_hf_config(str(hf_dir)))
    assert model.tie_word_embeddings
    hf_state = load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" not in hf_state
    assert "output_layer.weight" not in megatron_parameter_shapes(model)
    # The last pipeline stage's copy of the output layer is built from the embedding ...
    output = megatron_from_hf("output_layer.weight", hf_state.__getitem__, model)
    assert torch.equal(output, hf_state["model.embed_tokens.weight"])
    # ... and never exported.
    assert megatron_to_hf("output_layer.weight", output, model) == []
    assert hf_names_for("output_layer.weight", model) == []


def test_both_spellings_parse_to_the_same_parameter():
    pairs = [
        (
            "decoder.layers.2.input_layernorm.weight",
            "decoder.layers.2.self_attention.linear_qkv.layer_norm_weight",
        ),
        (
            "decoder.layers.2.pre_mlp_layernorm.weight",
            "decoder.layers.2.mlp.linear_fc1.layer_norm_weight",
        ),
        (
            "decoder.layers.2.mlp.experts.local_experts.7.linear_fc1.weight",
            "decoder.layers.2.mlp.experts.linear_fc1.weight7",
        ),
        (
            "decoder.layers.2.mlp.experts.local_experts.7.linear_fc2.weight",
            "decoder.layers.2.mlp.experts.linear_fc2.weight7",
        ),
    ]
    for local, te in pairs:
        key = parse_megatron_name(local)
        assert key == parse_megatron_name(te)
        assert megatron_name(key, style="local") in (local, te)


def test_mixtral_names():
    model = ModelConfig(architecture="mixtral", qk_layernorm=False, num_experts=4)
    assert hf_names_for("decoder.layers.1.mlp.router.weight", model) == [
        "model.layers.1.block_sparse_moe.gate.weight"
    ]
    assert hf_names_for(
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight", model
    ) == [
        "model.layers.1.block_sparse_moe.experts.2.w1.weight",
        "model.layers.1.block_sparse_moe.experts.2.w3.weight",
    ]


def test_errors_name_the_problem():
    model = ModelConfig(architecture="qwen3_moe", num_experts=8, first_k_dense_layers=1)
    with pytest.raises(ConversionError, match="legacy GroupedMLP"):
        parse_megatron_name("decoder.layers.1.mlp.experts.weight1")
    with pytest.raises(ConversionError, match="no HF mapping"):
        parse_megatron_name("decoder.layers.1.mlp.mystery.weight")
    with pytest.raises(ConversionError, match="dense layer"):
        hf_names_for("decoder.layers.0.mlp.router.weight", model)
    with pytest.raises(ConversionError, match="expert 8 is outside"):
        hf_names_for("decoder.layers.1.mlp.experts.local_experts.8.linear_fc2.weight", model)
    with pytest.raises(ConversionError, match="layer 2 is outside"):
        hf_names_for("decoder.layers.2.input_layernorm.weight", model)
    # A tensor-parallel shard instead of the full tensor.
    shard = torch.zeros(model.hidden_size, model.num_attention_heads * model.head_dim // 2)
    with pytest.raises(ConversionError, match="FULL"):
        megatron_to_hf("decoder.layers.0.self_attention.linear_proj.weight", shard, model)
    mixtral = ModelConfig(architecture="mixtral", qk_layernorm=False)
    with pytest.raises(ConversionError, match="no counterpart"):
        hf_names_for("decoder.layers.0.self_attention.q_layernorm.weight", mixtral)
