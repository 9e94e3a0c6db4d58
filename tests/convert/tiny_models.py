"""Tiny random HF models of every supported architecture, built with transformers from configs.

hidden 64, 2 layers, 4 heads / 2 key-value heads, head_dim 16, top-2 routing. Variants cover what
the mapping must get right: dense first layers (Qwen3-MoE ``mlp_only_layers``), a vocabulary that
tensor parallel must pad (Mixtral, 127), q/k/v bias and a gated shared expert without top-k
renormalisation (Qwen2-MoE), tied embeddings (dense Qwen3).

Every parameter is redrawn (norm weights around 1, biases non-zero) so that a swapped or
mis-sliced tensor changes the logits: transformers initialises norms to exactly 1 and biases to 0,
which would hide a swapped ``input_layernorm`` / ``post_attention_layernorm``.
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

SEQUENCE_LENGTH = 12
BATCH_SIZE = 2


def build_hf_model(architecture: str, seed: int = 0):
    """A random fp32 transformers model of ``architecture`` (eager attention, eval mode)."""
    import transformers

    class_name, kwargs = ARCHITECTURES[architecture]
    config = getattr(transformers, class_name)(**COMMON, **kwargs)
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
