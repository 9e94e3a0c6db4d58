"""DeepSeek-V3 / R1 / Kimi-K2 (``deepseek_v3``): config.json <-> ModelConfig, and what is rejected.

The published DeepSeek-V3 config.json (``tiny_models.DEEPSEEK_V3_CONFIG``) is read through the
function that reads ``model.hf_path`` at run time; the HF -> Megatron -> HF weights (bit for bit)
and the teacher-forced logits of the tiny model built from it are in
``test_megatron_equivalence.py::test_one_process[deepseek_v3]`` and ``test_mapping.py``.
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

from .tiny_models import ARCHITECTURES, DEEPSEEK_V3_CONFIG

PUBLISHED = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "quantization_config"}
"""The published config.json as after dequantising the fp8 checkpoint to bf16 (DeepSeek's
fp8_cast_bf16.py writes the same config without quantization_config)."""

TINY = ModelConfig(
    architecture="deepseek_v3",
    vocab_size=100,
    num_layers=3,
    first_k_dense_layers=1,
    num_attention_heads=4,
    num_query_groups=4,
    head_dim=8,
    num_experts=16,
    moe_router_topk=8,
    moe_ffn_hidden_size=24,
    shared_expert_intermediate_size=24,
    moe_router_num_groups=8,
    moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5,
    qk_layernorm=False,
    q_lora_rank=24,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rope_theta=10000.0,
    rope_scaling_factor=40.0,
    rope_scaling_original_max_position_embeddings=4096,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=1.0,
)
"""Every DeepSeek-V3 feature: groups, scaling 2.5, a low-rank query, a value width of its own,
YaRN with the softmax mscale."""


def test_published_deepseek_v3_config_is_read_with_every_value():
    fields = model_config_fields_from_hf(PUBLISHED)
    assert fields == {
        "architecture": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "num_layers": 61,
        "num_attention_heads": 128,
        "num_query_groups": 128,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 163840,
        "tie_word_embeddings": False,
        "qk_layernorm": False,
        "add_qkv_bias": False,
        "moe_router_topk": 8,
        "num_experts": 256,
        "moe_ffn_hidden_size": 2048,
        "ffn_hidden_size": 18432,
        "moe_renormalize_topk": True,
        "first_k_dense_layers": 3,
        "shared_expert_intermediate_size": 2048,
        "moe_router_num_groups": 8,
        "moe_router_group_topk": 4,
        "moe_router_topk_scaling_factor": 2.5,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_scaling_factor": 40.0,
        "rope_scaling_original_max_position_embeddings": 4096,
        "yarn_beta_fast": 32.0,
        "yarn_beta_slow": 1.0,
        "yarn_mscale": 1.0,
        "yarn_mscale_all_dim": 1.0,
    }
    model = model_config_from_hf(PUBLISHED)
    assert model.moe_layer_indices == list(range(3, 61))
    # The names and shapes of the first MoE layer (five layers: 61 x 256 experts take seconds).
    names = hf_parameter_shapes(dataclasses.replace(model, num_layers=5))
    assert names["model.layers.3.self_attn.q_a_proj.weight"] == (1536, 7168)
    assert names["model.layers.3.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert names["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"] == (512 + 64, 7168)
    assert names["model.layers.3.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert names["model.layers.3.self_attn.o_proj.weight"] == (7168, 128 * 128)
    assert names["model.layers.3.mlp.gate.e_score_correction_bias"] == (256,)
    assert "model.layers.2.mlp.gate.weight" not in names  # first three layers dense


def test_fp8_checkpoint_and_other_routers_are_rejected_at_start():
    with pytest.raises(ConfigError, match="quantization_config"):
        model_config_fields_from_hf(DEEPSEEK_V3_CONFIG)
    for key, value in (
        ("scoring_func", "softmax"),
        ("topk_method", "greedy"),
        ("rope_interleave", False),
        ("attention_bias", True),
        ("moe_layer_freq", 2),
        ("num_key_value_heads", 64),
    ):
        with pytest.raises(ConfigError, match=key):
            model_config_fields_from_hf({**PUBLISHED, key: value})
    # Another RoPE scaling than YaRN.
    linear = {**PUBLISHED, "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(ConfigError, match="RoPE scaling"):
        model_config_fields_from_hf(linear)


def test_config_json_loads_in_transformers_5_and_reads_back(tmp_path):
    config = hf_config_dict(TINY)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "DeepseekV3Config"
    assert loaded.q_lora_rank == 24 and loaded.kv_lora_rank == 16
    assert (loaded.qk_nope_head_dim, loaded.qk_rope_head_dim, loaded.v_head_dim) == (16, 8, 12)
    assert loaded.n_group == 8 and loaded.topk_group == 4 and loaded.routed_scaling_factor == 2.5
    assert loaded.rope_parameters["rope_type"] == "yarn"
    assert loaded.rope_parameters["factor"] == 40.0
    assert loaded.rope_parameters["mscale_all_dim"] == 1.0
    assert loaded.num_nextn_predict_layers == 0 and loaded.rope_interleave
    # transformers 4.x reads the legacy rope_scaling.
    assert config["rope_scaling"]["type"] == "yarn" and config["rope_scaling"]["factor"] == 40.0
    assert model_config_from_hf(config) == TINY
    # Without a low-rank query (DeepSeek-V2-Lite style): a plain q_proj.
    plain = dataclasses.replace(
        TINY,
        q_lora_rank=None,
        rope_scaling_factor=1.0,
        rope_scaling_original_max_position_embeddings=0,
        yarn_mscale_all_dim=0.0,
    )
    assert model_config_from_hf(hf_config_dict(plain)) == plain
    names = hf_parameter_shapes(plain)
    assert names["model.layers.0.self_attn.q_proj.weight"] == (4 * 24, 64)
    assert not any("q_a_proj" in name or "q_b_proj" in name for name in names)
    # Plain RoPE written over a YaRN config.json leaves no YaRN key behind.
    unscaled = hf_config_dict(plain, base=PUBLISHED)
    assert "rope_scaling" not in unscaled and unscaled["rope_parameters"]["rope_type"] == "default"
    assert "factor" not in unscaled["rope_parameters"]
    # An export on top of the published config.json keeps its other keys and drops the MTP layer.
    rewritten = hf_config_dict(TINY, base=PUBLISHED)
    assert rewritten["bos_token_id"] == 0 and rewritten["num_nextn_predict_layers"] == 0
    assert model_config_from_hf(rewritten) == TINY


def test_transformers_saved_config_round_trip(tmp_path):
    class_name, kwargs = ARCHITECTURES["deepseek_v3"]
    getattr(transformers, class_name)(**kwargs).save_pretrained(tmp_path)
    model = resolve_model_config(ModelConfig(hf_path=str(tmp_path)))
    assert model.rope_scaling_factor == 40.0 and model.q_lora_rank == 24
    rewritten = hf_config_dict(model, base=json.loads((tmp_path / "config.json").read_text()))
    assert model_config_from_hf(rewritten, model) == model


def test_parameter_names_of_multi_latent_attention():
    megatron = megatron_parameter_shapes(TINY)
    layer = "decoder.layers.1.self_attention."
    assert megatron[layer + "linear_q_down_proj.weight"] == (24, 64)
    assert megatron[layer + "q_layernorm.weight"] == (24,)
    assert megatron[layer + "linear_q_up_proj.weight"] == (4 * 24, 24)
    assert megatron[layer + "linear_kv_down_proj.weight"] == (16 + 8, 64)
    assert megatron[layer + "kv_layernorm.weight"] == (16,)
    assert megatron[layer + "linear_kv_up_proj.weight"] == (4 * (16 + 12), 16)
    assert megatron[layer + "linear_proj.weight"] == (64, 4 * 12)
    assert megatron["decoder.layers.1.mlp.router.expert_bias"] == (16,)
    # TE's spec fuses the latent norms into the up projections.
    te = megatron_parameter_shapes(TINY, style="te")
    assert te[layer + "linear_q_up_proj.layer_norm_weight"] == (24,)
    assert te[layer + "linear_kv_up_proj.layer_norm_weight"] == (16,)


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(num_query_groups=2), "model.num_query_groups"),
        (dict(qk_rope_head_dim=7), "model.qk_rope_head_dim"),
        (dict(kv_lora_rank=0), "model.kv_lora_rank"),
        (dict(v_head_dim=0), "model.v_head_dim"),
        (dict(q_lora_rank=0), "model.q_lora_rank"),
        (dict(rope_scaling_factor=0.5), "model.rope_scaling_factor"),
        (
            dict(rope_scaling_original_max_position_embeddings=0),
            "model.rope_scaling_original_max_position_embeddings",
        ),
        # The GLM-4.5 router rules hold here too.
        (dict(moe_router_num_groups=2, moe_router_group_topk=1), "model.moe_router_group_topk"),
        (dict(moe_renormalize_topk=False), "model.moe_renormalize_topk"),
    ],
)
def test_invalid_mla_fields_are_rejected(change, key):
    with pytest.raises(ConfigError, match=key):
        dataclasses.replace(TINY, **change)


@pytest.mark.parametrize(
    "model, key",
    [
        (ModelConfig(kv_lora_rank=8), "model.kv_lora_rank"),
        (ModelConfig(rope_scaling_factor=4.0), "model.rope_scaling_factor"),
        (dataclasses.replace(TINY, qk_layernorm=True), "model.qk_layernorm"),
        (dataclasses.replace(TINY, rotary_percent=0.5), "model.rotary_percent"),
        (dataclasses.replace(TINY, head_dim=16), "model.head_dim"),
    ],
)
def test_what_the_hf_class_cannot_express_is_rejected(model, key):
    # Checked where the HF class is chosen: a config with hf_path learns its architecture there.
    with pytest.raises(ConfigError, match=key):
        hf_config_dict(model)
