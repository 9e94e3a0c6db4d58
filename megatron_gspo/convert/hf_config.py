"""Hugging Face ``transformers`` config of a :class:`~megatron_gspo.config.ModelConfig`.

:func:`hf_config_kwargs` / :func:`hf_config_from_model_config` build the HF config that describes
the same network as the Megatron model (the embedded rollout engine instantiates it);
:func:`hf_config_dict` is the ``config.json`` an export writes (both transformers 4 and 5
spellings); :func:`model_config_from_hf` / :func:`resolve_model_config` read a ``config.json``
back into a :class:`ModelConfig` (``model.hf_path``).

Field correspondence (ours -> HF):

=============================  ==================================================================
``vocab_size``                 ``vocab_size``
``hidden_size``                ``hidden_size``
``num_layers``                 ``num_hidden_layers``
``num_attention_heads``        ``num_attention_heads``
``num_query_groups``           ``num_key_value_heads``
``head_dim``                   ``head_dim``
``ffn_hidden_size``            ``intermediate_size`` (dense layers)
``moe_ffn_hidden_size``        ``moe_intermediate_size`` (Mixtral: ``intermediate_size``)
``num_experts``                ``num_experts`` (Mixtral: ``num_local_experts``, GLM-4.5:
                               ``n_routed_experts``)
``moe_router_topk``            ``num_experts_per_tok``
``moe_renormalize_topk``       ``norm_topk_prob`` (Mixtral always renormalises)
``first_k_dense_layers``       ``mlp_only_layers = [0, ..., k-1]`` (Qwen MoE),
                               ``first_k_dense_replace`` (GLM-4.5)
``shared_expert_...``          ``shared_expert_intermediate_size`` (Qwen2-MoE),
                               ``moe_intermediate_size * n_shared_experts`` (GLM-4.5)
``add_qkv_bias``               ``qkv_bias`` (Qwen2-MoE) / ``attention_bias`` (Qwen3, GLM-4.5)
``qk_layernorm``               ``use_qk_norm`` (GLM-4.5; Qwen3 always, others never)
``moe_router_num_groups``      ``n_group`` (GLM-4.5)
``moe_router_group_topk``      ``topk_group`` (GLM-4.5)
``moe_router_topk_scaling...`` ``routed_scaling_factor`` (GLM-4.5)
``rotary_percent``             ``partial_rotary_factor`` (GLM-4.5; in ``rope_parameters`` in HF 5)
=============================  ==================================================================

DeepSeek-V3 (``deepseek_v3``, ``docs/deepseek-v3.md``) reads GLM-4.5's router keys with the same
code, plus its multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``: the :class:`ModelConfig` fields of the
same names) and YaRN (``rope_scaling`` / ``rope_parameters`` type ``yarn``: ``rope_scaling_*`` and
``yarn_*``); fp8 checkpoints (``quantization_config``) are refused.

GLM-4.5's router always scores with a sigmoid and selects with its ``e_score_correction_bias``
(``docs/glm4-moe.md``); its multi-token-prediction layers (``num_nextn_predict_layers``) are not
built: their tensors are left unused on import and an export writes
``num_nextn_predict_layers = 0``.

The router auxiliary loss is switched off (``output_router_logits=False``,
``router_aux_loss_coef=0``): the trainer owns the load-balancing loss, and an HF forward must not
add one behind its back.

``rope_theta`` is written both as HF 5's ``rope_parameters`` and as the flat ``rope_theta`` key,
because transformers 4.57 silently ignores ``rope_parameters`` (see
``docs/hf-mapping.md`` section 1, "Both spellings are written").
"""

from __future__ import annotations

from typing import Any

from megatron_gspo.config import ConfigError, ModelConfig
from megatron_gspo.config.model import GLM4_ONLY_FIELDS, MLA_FIELDS, SIGMOID_ROUTER_ARCHITECTURES

HF_ARCHITECTURE_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""``transformers`` causal-LM class of each of our architectures."""


def _check_representable(model: ModelConfig) -> None:
    """Reject the combinations the HF class of ``model.architecture`` cannot express."""
    arch = model.architecture
    if arch in ("qwen3_moe", "qwen3") and not model.qk_layernorm:
        raise ConfigError(
            "model.qk_layernorm",
            f"{arch} without q/k layernorm",
            "the transformers Qwen3 attention always applies q_norm/k_norm",
            "set model.qk_layernorm=true",
        )
    if arch in ("mixtral", "qwen2_moe") and model.qk_layernorm:
        raise ConfigError(
            "model.qk_layernorm",
            f"{arch} with q/k layernorm",
            f"the transformers {HF_ARCHITECTURE_CLASS[arch]} attention has no q_norm/k_norm",
            "set model.qk_layernorm=false",
        )
    if arch == "mixtral":
        if model.first_k_dense_layers:
            raise ConfigError(
                "model.first_k_dense_layers",
                f"mixtral with {model.first_k_dense_layers} dense layers",
                "every Mixtral decoder layer is a sparse MoE layer",
                "set model.first_k_dense_layers=0 or use architecture=qwen3_moe",
            )
        if model.add_qkv_bias:
            raise ConfigError(
                "model.add_qkv_bias",
                "mixtral with q/k/v bias",
                "the transformers Mixtral attention has no bias",
                "set model.add_qkv_bias=false",
            )
        if not model.moe_renormalize_topk:
            raise ConfigError(
                "model.moe_renormalize_topk",
                "mixtral without top-k renormalisation",
                "Mixtral's router always renormalises the top-k probabilities",
                "set model.moe_renormalize_topk=true",
            )
    if arch in ("qwen3_moe", "qwen3") and model.add_qkv_bias:
        raise ConfigError(
            "model.add_qkv_bias",
            f"{arch} with q/k/v bias",
            "the transformers Qwen3 attention_bias switch also adds an o_proj bias, which the "
            "Megatron model (add_qkv_bias) does not have",
            "set model.add_qkv_bias=false, or use architecture=qwen2_moe for q/k/v bias",
        )
    if arch not in ("qwen2_moe", *SIGMOID_ROUTER_ARCHITECTURES) and (
        model.shared_expert_intermediate_size
    ):
        raise ConfigError(
            "model.shared_expert_intermediate_size",
            f"a shared expert on {arch}",
            "only the Qwen2-MoE (gated) and GLM-4.5 (un-gated) HF classes have a shared expert",
            "set model.shared_expert_intermediate_size=0 or use architecture=qwen2_moe",
        )
    if arch != "deepseek_v3":
        for name, neutral in MLA_FIELDS.items():
            if getattr(model, name) != neutral:
                raise ConfigError(
                    f"model.{name}",
                    f"{getattr(model, name)!r} on {arch}",
                    "only DeepSeek-V3 has multi-head latent attention and YaRN here; the "
                    f"{HF_ARCHITECTURE_CLASS[arch]} class would ignore it",
                    f"set model.{name}={neutral!r} or use architecture=deepseek_v3",
                )
    if arch == "deepseek_v3":
        for name in ("qk_layernorm", "add_qkv_bias"):
            if getattr(model, name):
                raise ConfigError(
                    f"model.{name}",
                    f"deepseek_v3 with {name}",
                    "DeepSeek-V3's attention has latent norms instead of q/k norms, and its "
                    "attention_bias would also bias the down projections and o_proj",
                    f"set model.{name}=false",
                )
        if model.rotary_percent != 1.0:
            raise ConfigError(
                "model.rotary_percent",
                f"{model.rotary_percent} on deepseek_v3",
                "MLA rotates its own qk_rope_head_dim channels, all of them",
                "set model.rotary_percent=1.0 and size the rotary part with qk_rope_head_dim",
            )
        if model.head_dim != model.qk_rope_head_dim:
            raise ConfigError(
                "model.head_dim",
                f"{model.head_dim} != qk_rope_head_dim={model.qk_rope_head_dim}",
                "DeepseekV3Config sets head_dim = qk_rope_head_dim (the width of its rotary "
                "tables); the MLA head widths are qk_nope_head_dim, qk_rope_head_dim, v_head_dim",
                f"set model.head_dim={model.qk_rope_head_dim}",
            )
    if arch not in SIGMOID_ROUTER_ARCHITECTURES:
        for name, neutral in GLM4_ONLY_FIELDS.items():
            if getattr(model, name) != neutral:
                raise ConfigError(
                    f"model.{name}",
                    f"{getattr(model, name)!r} on {arch}",
                    f"only GLM-4.5 and DeepSeek-V3 have this feature; the "
                    f"{HF_ARCHITECTURE_CLASS[arch]} class would ignore it, so the rollout engine "
                    "would compute another network",
                    f"set model.{name}={neutral!r} or use architecture=glm4_moe",
                )
    if arch in SIGMOID_ROUTER_ARCHITECTURES:
        shared, expert = model.shared_expert_intermediate_size, model.moe_ffn_hidden_size
        if shared <= 0 or shared % expert:
            raise ConfigError(
                "model.shared_expert_intermediate_size",
                f"{shared} is not a positive multiple of moe_ffn_hidden_size={expert}",
                "the GLM-4.5 and DeepSeek-V3 HF classes size their shared experts as moe_intermediate_size * "
                "n_shared_experts",
                f"set model.shared_expert_intermediate_size to n * {expert} with n >= 1",
            )


def _sigmoid_router_kwargs(model: ModelConfig) -> dict[str, Any]:
    """The HF config fields of the sigmoid router with experts that GLM-4.5 and DeepSeek-V3 share
    (their reader is :func:`_sigmoid_router_fields`)."""
    return dict(
        num_experts_per_tok=model.moe_router_topk,
        output_router_logits=False,
        moe_intermediate_size=model.moe_ffn_hidden_size,
        n_routed_experts=model.num_experts,
        n_shared_experts=model.shared_expert_intermediate_size // model.moe_ffn_hidden_size,
        norm_topk_prob=model.moe_renormalize_topk,
        first_k_dense_replace=model.first_k_dense_layers,
        n_group=model.moe_router_num_groups,
        topk_group=model.moe_router_group_topk,
        routed_scaling_factor=model.moe_router_topk_scaling_factor,
    )


def hf_config_kwargs(model: ModelConfig) -> dict[str, Any]:
    """Keyword arguments of the HF config class for ``model`` (plain data, JSON-serialisable).

    Raises :class:`ConfigError` when the HF class cannot represent ``model``.
    """
    _check_representable(model)
    kwargs: dict[str, Any] = {
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "intermediate_size": model.ffn_hidden_size,
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "initializer_range": model.init_std,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "architectures": [HF_ARCHITECTURE_CLASS[model.architecture]],
    }
    arch = model.architecture
    if arch in ("deepseek_v3", "glm4_moe"):
        del kwargs["use_sliding_window"]
        kwargs.update(_sigmoid_router_kwargs(model))
    if arch == "deepseek_v3":
        kwargs.update(
            attention_bias=False,
            q_lora_rank=model.q_lora_rank,
            kv_lora_rank=model.kv_lora_rank,
            qk_nope_head_dim=model.qk_nope_head_dim,
            qk_rope_head_dim=model.qk_rope_head_dim,
            v_head_dim=model.v_head_dim,
            rope_interleave=True,
            rope_parameters=rope_parameters_of(model),
            # The multi-token-prediction layers are not built (docs/deepseek-v3.md).
            num_nextn_predict_layers=0,
            # The published config.json's router fields, which transformers 5's class does not
            # define but SGLang's DeepSeek class reads (without topk_method=noaux_tc it builds
            # no correction bias; docs/deepseek-v3.md, "On a real SGLang server").
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
        )
        return kwargs
    if arch == "glm4_moe":
        kwargs.update(
            attention_bias=model.add_qkv_bias,
            use_qk_norm=model.qk_layernorm,
            partial_rotary_factor=model.rotary_percent,
            # The multi-token-prediction layers are not built (docs/glm4-moe.md).
            num_nextn_predict_layers=0,
        )
        return kwargs
    if arch == "qwen3":
        kwargs["attention_bias"] = model.add_qkv_bias
        return kwargs
    kwargs.update(
        num_experts_per_tok=model.moe_router_topk,
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    )
    if arch == "mixtral":
        # Mixtral has no dense layers, so its only FFN width is the experts' one.
        kwargs.update(
            intermediate_size=model.moe_ffn_hidden_size,
            num_local_experts=model.num_experts,
            router_jitter_noise=0.0,
        )
        return kwargs
    kwargs.update(
        moe_intermediate_size=model.moe_ffn_hidden_size,
        num_experts=model.num_experts,
        norm_topk_prob=model.moe_renormalize_topk,
        decoder_sparse_step=1,
        mlp_only_layers=list(range(model.first_k_dense_layers)),
    )
    if arch == "qwen3_moe":
        kwargs["attention_bias"] = model.add_qkv_bias
    else:  # qwen2_moe
        kwargs.update(
            qkv_bias=model.add_qkv_bias,
            shared_expert_intermediate_size=model.shared_expert_intermediate_size,
        )
    return kwargs


def rope_parameters_of(model: ModelConfig) -> dict[str, Any]:
    """HF 5's ``rope_parameters`` of ``model``: plain RoPE, or YaRN (deepseek_v3,
    ``rope_scaling_factor > 1``) with every parameter spelled out."""
    if model.rope_scaling_factor == 1.0:
        return {"rope_type": "default", "rope_theta": model.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": model.rope_theta,
        "factor": model.rope_scaling_factor,
        "original_max_position_embeddings": model.rope_scaling_original_max_position_embeddings,
        "beta_fast": model.yarn_beta_fast,
        "beta_slow": model.yarn_beta_slow,
        "mscale": model.yarn_mscale,
        "mscale_all_dim": model.yarn_mscale_all_dim,
    }


def hf_config_from_model_config(model: ModelConfig):
    """The ``transformers`` config object (``Qwen3MoeConfig``, ``MixtralConfig``, ...) of ``model``.

    The flat ``rope_theta`` attribute is set next to ``rope_parameters`` so that the saved
    ``config.json`` is read correctly by transformers 4.x as well.
    """
    import transformers

    kwargs = hf_config_kwargs(model)
    config_class_name = {
        "qwen3_moe": "Qwen3MoeConfig",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "qwen3": "Qwen3Config",
        "glm4_moe": "Glm4MoeConfig",
        "deepseek_v3": "DeepseekV3Config",
    }[model.architecture]
    config = getattr(transformers, config_class_name)(**kwargs)
    config.rope_theta = model.rope_theta
    return config


# ---------------------------------------------------------------------------------------------
# config.json: writing (both transformers 4 and 5 spellings) and reading
# ---------------------------------------------------------------------------------------------

_TRAINING_ONLY_KEYS = ("router_aux_loss_coef", "output_router_logits", "initializer_range")
"""Keys of :func:`hf_config_kwargs` that describe training, not the network: an export keeps the
original checkpoint's values of these."""


_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
    "type",
)
"""The ``rope_parameters`` keys of a RoPE scaling, dropped when plain RoPE is written."""


def hf_config_dict(
    model: ModelConfig, *, base: dict[str, Any] | None = None, dtype: str | None = None
) -> dict[str, Any]:
    """The ``config.json`` content of ``model``, readable by transformers 4.5x and 5.x.

    Both spellings of every key that changed between the two are written, because each version
    silently falls back to its default for the spelling it does not know (4.57 read a 5.x
    Qwen3-MoE config as 128 experts and rope_theta 10000):

    * ``num_experts`` and ``num_local_experts`` (MoE architectures);
    * ``rope_theta`` and ``rope_parameters = {"rope_type": "default", "rope_theta": ...}``;
    * ``torch_dtype`` and ``dtype``.

    ``base`` is the original checkpoint's config.json: its keys (token ids, training settings)
    are kept and the architecture keys are overwritten with ``model``'s values. ``dtype``
    (``"bfloat16"``/``"float32"``) defaults to ``model.dtype``.
    """
    kwargs = hf_config_kwargs(model)
    if base is None:
        # What save_pretrained writes: the keys that differ from the class defaults.
        config = hf_config_from_model_config(model).to_diff_dict()
        config.update(kwargs)
    else:
        config = dict(base)
        config.update({k: v for k, v in kwargs.items() if k not in _TRAINING_ONLY_KEYS})
    config["model_type"] = model.architecture
    config["rope_theta"] = model.rope_theta
    rope_parameters = {
        k: v for k, v in (config.get("rope_parameters") or {}).items() if k not in _YARN_KEYS
    }
    rope_parameters.update(rope_type="default", rope_theta=model.rope_theta)
    if model.architecture == "glm4_moe":
        # transformers 5 reads it from rope_parameters, 4.x from the top level; a config
        # without it defaults to 0.5 in both.
        rope_parameters["partial_rotary_factor"] = config["partial_rotary_factor"] = (
            model.rotary_percent
        )
    config.pop("rope_scaling", None)
    if model.rope_scaling_factor != 1.0:
        # YaRN (deepseek_v3): HF 5 reads rope_parameters, 4.x the legacy rope_scaling.
        rope_parameters = rope_parameters_of(model)
        legacy = {k: v for k, v in rope_parameters.items() if k not in ("rope_type", "rope_theta")}
        config["rope_scaling"] = {**legacy, "type": "yarn", "rope_type": "yarn"}
    config["rope_parameters"] = rope_parameters
    if model.is_moe:
        config["num_experts"] = config["num_local_experts"] = model.num_experts
    dtype = dtype or model.dtype
    config["torch_dtype"] = config["dtype"] = dtype
    return config


def _hf_rope_theta(config: Any, model_type: str) -> float:
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    rope_scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = rope_parameters.get("rope_type") or rope_scaling.get("rope_type") or "default"
    legacy_type = rope_scaling.get("type") or rope_type
    yarn_ok = model_type == "deepseek_v3" and rope_type == legacy_type == "yarn"
    if not yarn_ok and (rope_type != "default" or legacy_type != "default"):
        raise ConfigError(
            "model.hf_path",
            f"the {model_type} config uses RoPE scaling {rope_type!r}",
            "the Megatron model is built with plain RoPE (YaRN on deepseek_v3 only), so "
            "positions would be encoded differently from the HF model",
            "remove rope_scaling from config.json (plain RoPE) or use a checkpoint without it",
        )
    theta = rope_parameters.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ConfigError(
            "model.hf_path",
            f"the {model_type} config has neither rope_parameters.rope_theta nor rope_theta",
            "the RoPE base frequency must be known",
            "add rope_theta to config.json",
        )
    return float(theta)


def model_config_fields_from_hf(config_json: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` fields described by an HF ``config.json`` (as a dict).

    The dict is parsed by the installed transformers config class, so missing keys take the same
    defaults transformers would use when loading that directory, and both the 4.x and 5.x
    spellings are understood. Raises :class:`ConfigError` for what the Megatron model cannot
    reproduce (sliding-window attention, RoPE scaling, a non-SiLU activation, sparse-step layouts,
    q/k/v bias on Qwen3).
    """
    import transformers

    model_type = config_json.get("model_type")
    if model_type not in HF_ARCHITECTURE_CLASS:
        raise ConfigError(
            "model.hf_path",
            f"config.json has model_type={model_type!r}",
            "a weight mapping exists only for " + ", ".join(HF_ARCHITECTURE_CLASS),
            "use a Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3, GLM-4.5 or DeepSeek-V3 checkpoint",
        )
    config_class = transformers.CONFIG_MAPPING[model_type]
    config = config_class(
        **{k: v for k, v in config_json.items() if k not in ("model_type", "transformers_version")}
    )

    def unsupported(key: str, what: str, fix: str) -> ConfigError:
        return ConfigError(
            "model.hf_path",
            f"config.json {key}: {what}",
            "the Megatron model cannot express it",
            fix,
        )

    if getattr(config, "hidden_act", "silu") != "silu":
        raise unsupported("hidden_act", repr(config.hidden_act), "use a SiLU (SwiGLU) model")
    sliding = getattr(config, "sliding_window", None)
    if sliding and (model_type == "mixtral" or getattr(config, "use_sliding_window", False)):
        raise unsupported(
            "sliding_window", f"sliding-window attention ({sliding})", "set sliding_window=null"
        )
    heads = config.num_attention_heads
    fields: dict[str, Any] = {
        "architecture": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "num_attention_heads": heads,
        "num_query_groups": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
        "rms_norm_eps": float(config.rms_norm_eps),
        "rope_theta": _hf_rope_theta(config, model_type),
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "qk_layernorm": model_type in ("qwen3_moe", "qwen3"),
        "add_qkv_bias": bool(getattr(config, "qkv_bias", True))
        if model_type == "qwen2_moe"
        else False,
    }
    if model_type in ("qwen3_moe", "qwen3") and getattr(config, "attention_bias", False):
        raise unsupported(
            "attention_bias",
            "true (bias on q/k/v and o_proj)",
            "use a model without attention bias",
        )
    if model_type == "qwen3":
        fields["ffn_hidden_size"] = config.intermediate_size
        return fields
    fields["moe_router_topk"] = config.num_experts_per_tok
    if model_type == "glm4_moe":
        return _glm4_moe_fields(config, fields)
    if model_type == "deepseek_v3":
        return _deepseek_v3_fields(config, config_json, fields)
    if model_type == "mixtral":
        fields.update(
            num_experts=config.num_local_experts,
            moe_ffn_hidden_size=config.intermediate_size,
            moe_renormalize_topk=True,
            first_k_dense_layers=0,
        )
        return fields
    num_experts = getattr(config, "num_experts", None) or config.num_local_experts
    mlp_only_layers = sorted(getattr(config, "mlp_only_layers", None) or [])
    if mlp_only_layers != list(range(len(mlp_only_layers))):
        raise unsupported(
            "mlp_only_layers",
            f"{mlp_only_layers} is not a prefix 0..k-1",
            "use first-k dense layers",
        )
    if getattr(config, "decoder_sparse_step", 1) != 1:
        raise unsupported(
            "decoder_sparse_step",
            f"{config.decoder_sparse_step} (MoE every few layers)",
            "use decoder_sparse_step=1",
        )
    fields.update(
        num_experts=num_experts,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        ffn_hidden_size=config.intermediate_size,
        moe_renormalize_topk=bool(config.norm_topk_prob),
        first_k_dense_layers=len(mlp_only_layers),
    )
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = config.shared_expert_intermediate_size
    return fields


def _sigmoid_router_fields(config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The router and MLP fields GLM-4.5 and DeepSeek-V3 share (``config``: a Glm4MoeConfig or a
    DeepseekV3Config)."""
    fields.update(
        num_experts=config.n_routed_experts,
        moe_ffn_hidden_size=config.moe_intermediate_size,
        ffn_hidden_size=config.intermediate_size,
        moe_renormalize_topk=bool(config.norm_topk_prob),
        first_k_dense_layers=min(config.first_k_dense_replace, config.num_hidden_layers),
        shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        moe_router_num_groups=config.n_group,
        moe_router_group_topk=config.topk_group,
        moe_router_topk_scaling_factor=float(config.routed_scaling_factor),
    )
    return fields


def _glm4_moe_fields(config: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The GLM-4.5 part of :func:`model_config_fields_from_hf` (``config``: a Glm4MoeConfig)."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    # The Glm4MoeConfig default, as transformers applies it to a config.json without the key.
    rotary_percent = rope_parameters.get(
        "partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.5)
    )
    _sigmoid_router_fields(config, fields)
    fields.update(
        qk_layernorm=bool(config.use_qk_norm),
        add_qkv_bias=bool(config.attention_bias),
        rotary_percent=float(rotary_percent),
    )
    return fields


def _deepseek_v3_fields(
    config: Any, config_json: dict[str, Any], fields: dict[str, Any]
) -> dict[str, Any]:
    """The DeepSeek-V3 part of :func:`model_config_fields_from_hf` (``config``: a
    DeepseekV3Config). The router is GLM-4.5's (``_glm4_moe_fields``); the attention is MLA."""

    def unsupported(key: str, what: str, why: str, fix: str) -> ConfigError:
        return ConfigError("model.hf_path", f"config.json {key}: {what}", why, fix)

    if config_json.get("quantization_config"):
        method = config_json["quantization_config"].get("quant_method")
        raise unsupported(
            "quantization_config",
            f"{method!r} quantized weights (DeepSeek-V3's published checkpoint is fp8 with "
            "128x128 block scales, weight_scale_inv)",
            "the loader reads plain bf16/fp32 tensors; fp8 ones with their scales would be "
            "loaded as numbers of another scale",
            "dequantize the checkpoint to bf16 first (DeepSeek's fp8_cast_bf16.py) and drop "
            "quantization_config",
        )
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if config_json.get(key, expected) != expected:
            raise unsupported(
                key,
                repr(config_json[key]),
                f"transformers' DeepseekV3 router is the {expected} one whatever this key says, "
                "and so is the Megatron model",
                f"use a DeepSeek-V3-style checkpoint ({key}={expected!r})",
            )
    if getattr(config, "rope_interleave", True) is not True:
        raise unsupported(
            "rope_interleave",
            "false",
            "Megatron's MLA RoPE always reads the rotary channels in DeepSeek's interleaved pair "
            "order (rope_interleave=true, the published checkpoints' layout)",
            "use a checkpoint with rope_interleave=true",
        )
    if getattr(config, "attention_bias", False):
        raise unsupported(
            "attention_bias",
            "true (bias on q_a_proj, kv_a_proj_with_mqa and o_proj)",
            "the Megatron MLA layers are built without biases",
            "use a model without attention bias",
        )
    if getattr(config, "moe_layer_freq", 1) != 1:
        raise unsupported(
            "moe_layer_freq",
            repr(config.moe_layer_freq),
            "transformers' DeepseekV3 makes every layer after first_k_dense_replace an MoE one",
            "use moe_layer_freq=1",
        )
    _sigmoid_router_fields(config, fields)
    fields["qk_layernorm"] = fields["add_qkv_bias"] = False
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope.update(getattr(config, "rope_scaling", None) or {})
    fields.update(
        num_query_groups=config.num_attention_heads,
        head_dim=config.qk_rope_head_dim,
        q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
    )
    if getattr(config, "num_key_value_heads", None) not in (None, config.num_attention_heads):
        raise unsupported(
            "num_key_value_heads",
            f"{config.num_key_value_heads} != num_attention_heads",
            "MLA up-projects one key and value per head; transformers' DeepseekV3 would repeat "
            "them in groups, which the Megatron MLA layer does not",
            "set num_key_value_heads = num_attention_heads",
        )
    if rope.get("rope_type", rope.get("type")) == "yarn":
        fields.update(
            rope_scaling_factor=float(rope["factor"]),
            rope_scaling_original_max_position_embeddings=int(
                rope["original_max_position_embeddings"]
            ),
            yarn_beta_fast=float(rope.get("beta_fast", 32.0)),
            yarn_beta_slow=float(rope.get("beta_slow", 1.0)),
            yarn_mscale=float(rope.get("mscale", 1.0)),
            yarn_mscale_all_dim=float(rope.get("mscale_all_dim", 0.0)),
        )
    return fields


def model_config_from_hf(
    config_json: dict[str, Any], base: ModelConfig | None = None
) -> ModelConfig:
    """``base`` (default: a default :class:`ModelConfig`) with the fields of an HF config.json.

    A field of ``base`` that differs from the :class:`ModelConfig` default was set by the user
    and must agree with the checkpoint; otherwise the checkpoint's value is taken. (A field set
    explicitly to its default value cannot be told apart and takes the checkpoint's value.)
    """
    import dataclasses

    base = base or ModelConfig()
    fields = model_config_fields_from_hf(config_json)
    defaults = ModelConfig()
    for name, hf_value in fields.items():
        value = getattr(base, name)
        if value != getattr(defaults, name) and value != hf_value:
            raise ConfigError(
                f"model.{name}",
                f"{value!r} disagrees with the HF checkpoint's {hf_value!r}",
                "the architecture and sizes of a model started from model.hf_path come from its "
                "config.json",
                f"remove model.{name} from the config or set it to {hf_value!r}",
            )
    return dataclasses.replace(base, **fields)


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    """``hf_dir/config.json`` as a dict, with a clear error when it is missing or malformed."""
    import json
    import os

    path = os.path.join(hf_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        raise ConfigError(
            "model.hf_path",
            f"{path} does not exist",
            "a Hugging Face model directory holds config.json next to its safetensors",
            "point model.hf_path at a directory written by save_pretrained",
        ) from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            "model.hf_path",
            f"{path} is not valid JSON (line {error.lineno}: {error.msg})",
            "config.json describes the architecture",
            "repair or replace config.json",
        ) from None


def resolve_model_config(model: ModelConfig) -> ModelConfig:
    """``model`` completed from ``model.hf_path``'s config.json (unchanged when hf_path is null)."""
    if not model.hf_path:
        return model
    return model_config_from_hf(read_hf_config(model.hf_path), model)
