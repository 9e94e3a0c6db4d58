"""GLM-4.5 / GLM-4.5-Air (``glm4_moe``): config.json <-> ModelConfig, and what is rejected.

The published GLM-4.5-Air config.json (``tiny_models.GLM_4_5_AIR_CONFIG``) is read through the
function that reads ``model.hf_path`` at run time; the Megatron <-> HF weights and logits of the
tiny model built from it are in ``test_megatron_equivalence.py`` and ``test_mapping.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import transformers

from megatron_gspo.config import ConfigError, ModelConfig
from megatron_gspo.convert.hf_config import (
    hf_config_dict,
    model_config_fields_from_hf,
    model_config_from_hf,
    resolve_model_config,
)
from megatron_gspo.convert.mapping import hf_parameter_shapes, megatron_parameter_shapes

from .tiny_models import ARCHITECTURES, COMMON, GLM_4_5_AIR_CONFIG

TINY = ModelConfig(
    architecture="glm4_moe",
    vocab_size=100,
    num_layers=3,
    first_k_dense_layers=1,
    num_experts=8,
    moe_router_topk=4,
    moe_ffn_hidden_size=24,
    shared_expert_intermediate_size=48,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    qk_layernorm=True,
    add_qkv_bias=True,
    rotary_percent=0.5,
    rms_norm_eps=1e-5,
)
"""Every GLM-4.5 feature away from its neutral value: groups, scaling (GLM-4.5's 2.5), q/k norm
(GLM-4.5's use_qk_norm), two shared experts."""


def test_published_glm_4_5_air_config_is_read_with_every_value():
    fields = model_config_fields_from_hf(GLM_4_5_AIR_CONFIG)
    assert fields == {
        "architecture": "glm4_moe",
        "vocab_size": 151552,
        "hidden_size": 4096,
        "num_layers": 46,
        "num_attention_heads": 96,
        "num_query_groups": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "qk_layernorm": False,
        "add_qkv_bias": True,
        "moe_router_topk": 8,
        "num_experts": 128,
        "moe_ffn_hidden_size": 1408,
        "ffn_hidden_size": 10944,
        "moe_renormalize_topk": True,
        "first_k_dense_layers": 1,
        "shared_expert_intermediate_size": 1408,
        "moe_router_num_groups": 1,
        "moe_router_group_topk": 1,
        "moe_router_topk_scaling_factor": 1.0,
        "rotary_percent": 0.5,
    }
    model = model_config_from_hf(GLM_4_5_AIR_CONFIG)
    assert model.moe_layer_indices == list(range(1, 46))
    assert model.moe_router_bias_update_rate == 0.0  # frozen unless asked (docs/glm4-moe.md)
    # Every layer but the first routes: a correction bias per MoE layer, none on the dense one.
    names = hf_parameter_shapes(model)
    assert names["model.layers.1.mlp.gate.e_score_correction_bias"] == (128,)
    assert "model.layers.0.mlp.gate.e_score_correction_bias" not in names
    assert names["model.layers.1.mlp.shared_experts.gate_proj.weight"] == (1408, 4096)
    assert names["model.layers.1.self_attn.q_proj.bias"] == (96 * 128,)
    assert "model.layers.1.self_attn.o_proj.bias" not in names
    assert "model.layers.46.mlp.gate.weight" not in names  # the MTP layer is not built


def test_config_json_loads_in_transformers_5_and_reads_back(tmp_path):
    config = hf_config_dict(TINY)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "Glm4MoeConfig"
    assert loaded.n_routed_experts == 8 and loaded.num_experts_per_tok == 4
    assert loaded.n_shared_experts == 2 and loaded.moe_intermediate_size == 24
    assert loaded.n_group == 4 and loaded.topk_group == 2
    assert loaded.routed_scaling_factor == 2.5 and loaded.norm_topk_prob
    assert loaded.first_k_dense_replace == 1
    assert loaded.use_qk_norm and loaded.attention_bias
    assert loaded.rope_parameters["partial_rotary_factor"] == 0.5
    assert loaded.num_nextn_predict_layers == 0
    # transformers 4.x reads the flat key.
    assert config["partial_rotary_factor"] == 0.5 and config["rope_theta"] == TINY.rope_theta
    assert model_config_from_hf(config) == TINY
    # An export on top of the published config.json keeps its other keys and drops the MTP layer.
    rewritten = hf_config_dict(TINY, base=GLM_4_5_AIR_CONFIG)
    assert rewritten["eos_token_id"] == [151329, 151336, 151338]
    assert rewritten["num_nextn_predict_layers"] == 0
    assert model_config_from_hf(rewritten) == TINY


def test_transformers_saved_config_round_trip(tmp_path):
    class_name, kwargs = ARCHITECTURES["glm4_moe"]
    getattr(transformers, class_name)(**{**COMMON, **kwargs}).save_pretrained(tmp_path)
    model = resolve_model_config(ModelConfig(hf_path=str(tmp_path)))
    assert model.rotary_percent == 0.5 and model.add_qkv_bias and not model.qk_layernorm
    rewritten = hf_config_dict(model, base=json.loads((tmp_path / "config.json").read_text()))
    assert model_config_from_hf(rewritten, model) == model


def test_parameter_names_of_every_feature():
    megatron = megatron_parameter_shapes(TINY)
    assert megatron["decoder.layers.1.mlp.router.expert_bias"] == (8,)
    assert "decoder.layers.0.mlp.router.expert_bias" not in megatron
    assert megatron["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (96, 64)
    assert not any("gate_weight" in name for name in megatron)  # un-gated shared expert
    assert megatron["decoder.layers.2.self_attention.q_layernorm.weight"] == (16,)


@pytest.mark.parametrize(
    "change, key",
    [
        # Megatron ranks groups by their top-(k / group_topk) scores, HF by their top-2.
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "model.moe_router_group_topk"),
        (dict(moe_router_num_groups=3), "model.moe_router_num_groups"),
        (dict(moe_router_group_topk=5), "model.moe_router_group_topk"),
        (dict(moe_renormalize_topk=False), "model.moe_renormalize_topk"),
        (dict(rotary_percent=0.3), "model.rotary_percent"),
        (dict(rotary_percent=1.5), "model.rotary_percent"),
        (dict(moe_router_bias_update_rate=-1.0), "model.moe_router_bias_update_rate"),
    ],
)
def test_what_megatron_and_hf_would_compute_differently_is_rejected(change, key):
    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(TINY, **change)


def test_glm4_features_on_other_architectures_and_shared_expert_sizes_are_rejected():
    # Checked where the HF class is chosen: a config with hf_path learns its architecture there.
    with pytest.raises(ConfigError, match="model.rotary_percent"):
        hf_config_dict(ModelConfig(rotary_percent=0.5))
    scaled = ModelConfig(
        architecture="qwen2_moe",
        qk_layernorm=False,
        shared_expert_intermediate_size=8,
        moe_router_topk_scaling_factor=2.0,
    )
    with pytest.raises(ConfigError, match="model.moe_router_topk_scaling_factor"):
        hf_config_dict(scaled)
    with pytest.raises(ConfigError, match="model.shared_expert_intermediate_size"):
        hf_config_dict(dataclasses.replace(TINY, shared_expert_intermediate_size=30))
    with pytest.raises(ConfigError, match="model.shared_expert_intermediate_size"):
        hf_config_dict(dataclasses.replace(TINY, shared_expert_intermediate_size=0))
    # A GLM-4.5 field next to hf_path is accepted before the architecture is known.
    ModelConfig(hf_path="/models/GLM-4.5-Air", moe_router_bias_update_rate=1e-3)


def test_bf16_export_keeps_the_correction_bias_in_float32(tmp_path):
    """A bf16 export stores every tensor in bf16 but the correction bias, which stays float32 as
    in the published checkpoints (its values shift scores by less than bf16 resolves)."""
    import torch
    from safetensors.torch import load_file

    from megatron_gspo.convert.export import save_hf_checkpoint

    shapes = hf_parameter_shapes(TINY)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=generator) * 1e-3 for name, shape in shapes.items()
    }
    save_hf_checkpoint(iter(tensors.items()), str(tmp_path / "hf"), TINY, dtype=torch.bfloat16)
    saved = {}
    for path in (tmp_path / "hf").glob("*.safetensors"):
        saved.update(load_file(path))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert saved[bias].dtype == torch.float32 and torch.equal(saved[bias], tensors[bias])
    assert {t.dtype for n, t in saved.items() if "e_score_correction_bias" not in n} == {
        torch.bfloat16
    }
