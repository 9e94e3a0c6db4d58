"""Tiny random HF models of every supported architecture, built with transformers from configs.

hidden 64, 2 layers, 4 heads / 2 key-value heads, head_dim 16, top-2 routing. Variants cover what
the mapping must get right: dense first layers (Qwen3-MoE ``mlp_only_layers``), a vocabulary that
tensor parallel must pad (Mixtral, 127), q/k/v bias and a gated shared expert without top-k
renormalisation (Qwen2-MoE), tied embeddings (dense Qwen3), and GLM-4.5-Air's published
config.json with only its sizes scaled down (sigmoid router with a score-correction bias, an
un-gated shared expert, a first dense layer, partial RoPE, q/k/v bias).

Every parameter is redrawn (norm weights around 1, biases non-zero) so that a swapped or
mis-sliced tensor changes the logits: transformers initialises norms to exactly 1 and biases to 0,
which would hide a swapped ``input_layernorm`` / ``post_attention_layernorm``. GLM-4.5's
correction bias (a buffer, zero in transformers' initialisation) is drawn too, large enough to
change which experts are selected.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

ARCHITECTURES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            vocab_size=128,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            rope_theta=1_000_000.0,
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(vocab_size=127, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            vocab_size=128,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            qkv_bias=True,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(vocab_size=128, intermediate_size=96, tie_word_embeddings=True),
    ),
}

GLM_4_5_AIR_CONFIG = {  # huggingface.co/zai-org/GLM-4.5-Air, config.json
    "architectures": ["Glm4MoeForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "pad_token_id": 151329,
    "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "partial_rotary_factor": 0.5,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "max_position_embeddings": 131072,
    "model_type": "glm4_moe",
    "moe_intermediate_size": 1408,
    "norm_topk_prob": True,
    "num_attention_heads": 96,
    "n_group": 1,
    "topk_group": 1,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.0,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_hidden_layers": 46,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0",
    "use_cache": True,
    "use_qk_norm": False,
    "vocab_size": 151552,
}

GLM_4_5_AIR_TINY_SIZES = dict(
    {k: v for k, v in COMMON.items() if k != "rms_norm_eps"},
    vocab_size=128,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    num_nextn_predict_layers=0,
)
"""GLM-4.5-Air scaled down: only sizes change (hidden, layers, heads, FFN widths, experts and
top-k in the same 16:1 ratio, vocabulary); routing, bias, RoPE and norm settings are the
published ones. No multi-token-prediction layer (it is not built on either side)."""


def glm4_moe_tiny_config() -> dict:
    """The config.json fields of the tiny GLM-4.5-Air."""
    skip = ("architectures", "model_type", "transformers_version", "torch_dtype", "rope_scaling")
    config = {k: v for k, v in GLM_4_5_AIR_CONFIG.items() if k not in skip}
    config.update(GLM_4_5_AIR_TINY_SIZES)
    config.update(pad_token_id=None, eos_token_id=None)
    return config


ARCHITECTURES["glm4_moe"] = ("Glm4MoeConfig", glm4_moe_tiny_config())

DEEPSEEK_V3_CONFIG = {  # huggingface.co/deepseek-ai/DeepSeek-V3, config.json (auto_map omitted)
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

DEEPSEEK_V3_TINY_SIZES = dict(
    hidden_size=64,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=8,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    vocab_size=128,
    intermediate_size=96,
    moe_intermediate_size=32,
    n_routed_experts=16,
    num_nextn_predict_layers=0,
)
"""DeepSeek-V3 scaled down: only sizes change (hidden, layers, heads and head widths, latent
ranks, FFN widths, experts per group, vocabulary); the router (8 groups, 4 chosen, top-8,
scaling 2.5, sigmoid with correction bias), YaRN (factor 40 over 4096 positions, mscale 1, 1) and
the interleaved RoPE layout are the published ones. The published checkpoint is fp8
(``quantization_config``), which the loader refuses; the tiny model is fp32 without it."""


def deepseek_v3_tiny_config() -> dict:
    """The config.json fields of the tiny DeepSeek-V3."""
    skip = (
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "quantization_config",
    )
    config = {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k not in skip}
    config.update(DEEPSEEK_V3_TINY_SIZES)
    config.update(bos_token_id=None, eos_token_id=None)
    return config


ARCHITECTURES["deepseek_v3"] = ("DeepseekV3Config", deepseek_v3_tiny_config())

SEQUENCE_LENGTH = 12
BATCH_SIZE = 2


def build_hf_model(architecture: str, seed: int = 0):
    """A random fp32 transformers model of ``architecture`` (eager attention, eval mode)."""
    import transformers

    class_name, kwargs = ARCHITECTURES[architecture]
    common = dict(COMMON)
    if class_name == "DeepseekV3Config":  # MLA: one key/value per head, head widths of its own
        common = {
            k: v for k, v in common.items() if k not in ("head_dim", "max_position_embeddings")
        }
    config = getattr(transformers, class_name)(**{**common, **kwargs})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(0.15 * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
    return model


def input_ids(vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 7)
    return torch.randint(0, vocab_size, (BATCH_SIZE, SEQUENCE_LENGTH), generator=generator)


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[B, S, V]`` fp32 logits of a transformers model."""
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def write_hf_dir(architecture: str, directory: Path, seed: int = 0) -> dict:
    """Save a tiny model of ``architecture`` to ``directory`` (save_pretrained) together with
    ``reference.pt`` (input ids and transformers' logits). Returns that reference."""
    model = build_hf_model(architecture, seed)
    model.save_pretrained(directory)
    tokens = input_ids(model.config.vocab_size, seed)
    reference = {"input_ids": tokens, "logits": hf_logits(model, tokens)}
    torch.save(reference, directory / "reference.pt")
    # A tokenizer-side file, to check that the export copies it.
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as file:
        json.dump({"model_max_length": 256, "marker": architecture}, file)
    return reference


def write_all(root: Path) -> dict[str, Path]:
    """One HF directory per architecture under ``root``."""
    directories = {}
    for architecture in ARCHITECTURES:
        directory = root / architecture
        os.makedirs(directory, exist_ok=True)
        write_hf_dir(architecture, directory)
        directories[architecture] = directory
    return directories
