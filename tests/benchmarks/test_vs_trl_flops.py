"""The model FLOPs behind ``vs_trl.py``'s utilisation (``vs_trl_job.training_flops``) against
torch's own FLOP counter on the same model's forward and backward.

The transformers model runs its eager paths (per-expert matmuls, matmul attention), which
``torch.utils.flop_counter`` counts: the routed experts, the output layer at the response
positions and the attention scores over the full square (the counter counts the masked half too,
the formula only the causal triangle, so the test adds the difference back).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from vs_trl_job import GROUP_SIZE, Size, model_config, training_flops  # noqa: E402


def test_training_flops_match_torch_flop_counter():
    from megatron_gspo.rollout.hf_model import build_hf_model

    # Odd sizes, so that no two terms can stand in for each other.
    size = Size(
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=8,
        experts=4,
        topk=2,
        expert_ffn=24,
        vocab=50,
        response_tokens=6,
    )
    model = build_hf_model(model_config(size), seed=0)
    model.config._experts_implementation = "eager"
    model.config._attn_implementation = "eager"
    model.train().requires_grad_(True)
    prompt, response = 5, size.response_tokens
    positions = prompt + response - 1
    tokens = torch.randint(
        0, size.vocab, (1, positions), generator=torch.Generator().manual_seed(0)
    )
    with FlopCounterMode(display=False) as counter:
        model(input_ids=tokens, logits_to_keep=response).logits.sum().backward()

    per_sample = training_flops(size, size.vocab, [prompt], response) / GROUP_SIZE
    attention = size.layers * 4 * size.heads * size.head_dim
    causal, square = attention * positions * (positions + 1) / 2, attention * positions**2
    assert counter.get_total_flops() == per_sample + 3 * (square - causal)
