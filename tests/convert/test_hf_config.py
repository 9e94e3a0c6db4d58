"""config.json written for transformers 4 and 5, and read back into a ModelConfig."""

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

from .tiny_models import ARCHITECTURES, build_hf_model

MODELS = {
    "qwen3_moe": ModelConfig(
        architecture="qwen3_moe",
        vocab_size=151,
        num_experts=6,
        moe_router_topk=3,
        first_k_dense_layers=1,
        rope_theta=123_456.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=777,
        dtype="bfloat16",
    ),
    "mixtral": ModelConfig(
        architecture="mixtral", qk_layernorm=False, num_experts=4, moe_ffn_hidden_size=40
    ),
    "qwen2_moe": ModelConfig(
        architecture="qwen2_moe",
        qk_layernorm=False,
        add_qkv_bias=True,
        shared_expert_intermediate_size=56,
        moe_renormalize_topk=False,
        num_experts=4,
    ),
    "qwen3": ModelConfig(architecture="qwen3", tie_word_embeddings=True, ffn_hidden_size=80),
}


@pytest.mark.parametrize("architecture", list(MODELS))
def test_config_json_loads_in_transformers_5_with_the_right_values(architecture, tmp_path):
    model = MODELS[architecture]
    config = hf_config_dict(model)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = transformers.AutoConfig.from_pretrained(tmp_path)
    assert type(loaded).__name__ == ARCHITECTURES[architecture][0]
    assert loaded.architectures == [ARCHITECTURES[architecture][0].replace("Config", "ForCausalLM")]
    assert loaded.hidden_size == model.hidden_size
    assert loaded.num_hidden_layers == model.num_layers
    assert loaded.num_key_value_heads == model.num_query_groups
    assert loaded.head_dim == model.head_dim
    assert loaded.vocab_size == model.vocab_size
    assert loaded.rope_parameters["rope_theta"] == model.rope_theta
    assert loaded.rms_norm_eps == model.rms_norm_eps
    assert loaded.tie_word_embeddings == model.tie_word_embeddings
    assert str(loaded.dtype).removeprefix("torch.") == model.dtype
    if model.is_moe:
        assert loaded.num_experts_per_tok == model.moe_router_topk
        experts = getattr(loaded, "num_local_experts", None) or loaded.num_experts
        assert experts == model.num_experts
    # Reading it back gives the same model config (the training dtype is not the checkpoint's).
    assert model_config_from_hf(config) == dataclasses.replace(model, dtype="float32")


@pytest.mark.parametrize("architecture", list(MODELS))
def test_config_json_has_the_transformers_4_spellings(architecture):
    """transformers 4.57 ignores num_local_experts / rope_parameters / dtype and silently uses its
    defaults (128 experts, rope_theta 10000): the flat 4.x keys must be there too."""
    model = MODELS[architecture]
    config = hf_config_dict(model)
    assert config["rope_theta"] == model.rope_theta
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": model.rope_theta}
    assert config["torch_dtype"] == config["dtype"] == model.dtype
    assert config["model_type"] == architecture
    if model.is_moe:
        assert config["num_experts"] == config["num_local_experts"] == model.num_experts
    if architecture in ("qwen3_moe", "qwen2_moe"):
        assert config["mlp_only_layers"] == list(range(model.first_k_dense_layers))
        assert config["norm_topk_prob"] == model.moe_renormalize_topk
        assert config["moe_intermediate_size"] == model.moe_ffn_hidden_size
    if architecture == "mixtral":
        assert config["intermediate_size"] == model.moe_ffn_hidden_size


def test_transformers_4_style_config_is_read(tmp_path):
    """A 4.x config.json: flat rope_theta, num_experts, torch_dtype, no rope_parameters."""
    config = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "rope_theta": 1_000_000.0,
        "vocab_size": 128,
        "torch_dtype": "bfloat16",
        "mlp_only_layers": [],
    }
    fields = model_config_fields_from_hf(config)
    assert fields["num_experts"] == 6
    assert fields["rope_theta"] == 1_000_000.0
    assert fields["first_k_dense_layers"] == 0
    assert fields["moe_renormalize_topk"] is True


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_transformers_saved_config_round_trip(architecture, tmp_path):
    hf_model = build_hf_model(architecture)
    hf_model.config.save_pretrained(tmp_path)
    model = resolve_model_config(ModelConfig(hf_path=str(tmp_path)))
    rewritten = hf_config_dict(model, base=json.loads((tmp_path / "config.json").read_text()))
    assert model_config_from_hf(rewritten, model) == model
    if architecture == "qwen2_moe":
        assert model.add_qkv_bias and not model.moe_renormalize_topk
        assert model.shared_expert_intermediate_size == 48


def test_disagreeing_user_field_is_an_error():
    config = hf_config_dict(MODELS["mixtral"])
    with pytest.raises(ConfigError, match="model.num_layers"):
        model_config_from_hf(config, ModelConfig(num_layers=7))
    # A field left at its default takes the checkpoint's value.
    assert model_config_from_hf(config, ModelConfig()).architecture == "mixtral"


def test_unsupported_features_are_rejected():
    base = hf_config_dict(MODELS["qwen3_moe"])
    yarn = dict(base, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    yarn.pop("rope_theta")
    with pytest.raises(ConfigError, match="RoPE scaling"):
        model_config_fields_from_hf(yarn)
    with pytest.raises(ConfigError, match="model_type"):
        model_config_fields_from_hf(dict(base, model_type="llama"))
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        model_config_fields_from_hf(dict(base, mlp_only_layers=[1]))
    with pytest.raises(ConfigError, match="attention_bias"):
        model_config_fields_from_hf(dict(base, attention_bias=True))
    with pytest.raises(ConfigError, match="sliding"):
        model_config_fields_from_hf(dict(hf_config_dict(MODELS["mixtral"]), sliding_window=4096))
    with pytest.raises(ConfigError, match="add_qkv_bias"):
        hf_config_dict(dataclasses.replace(MODELS["qwen3"], add_qkv_bias=True))


def test_missing_config_json_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="config.json does not exist"):
        resolve_model_config(ModelConfig(hf_path=str(tmp_path)))
