"""Hand-shaped batches for the loss tests: ratios placed inside and outside the clip range."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.algo import PolicyLossSettings

# Per sequence: (target mean log ratio in units of `scale`, sequence advantage, response length).
# With clip_low = 0.2 scale, clip_high = 0.28 scale and dual clip c = 1 + 0.5 scale:
SEQUENCES = (
    (-0.6, 1.3, 7),  # ratio below 1 - clip_low, A > 0: out of range, not binding
    (-0.5, -0.7, 3),  # below, A < 0: binding low clip
    (0.5, 0.4, 5),  # above 1 + clip_high, A > 0: binding high clip
    (0.9, -1.1, 1),  # above the dual-clip constant, A < 0: dual clip binds
    (0.05, -0.9, 6),  # inside
    (0.3, -0.8, 4),  # above 1 + clip_high, A < 0, below c: out of range, not binding
    (-0.02, 0.8, 2),  # inside
    (0.0, 0.5, 0),  # no response token at all
)
WIDTH = 7


@dataclass
class Batch:
    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    ref_log_probs: torch.Tensor
    entropy: torch.Tensor
    clip_low: float
    clip_high: float
    dual_clip_constant: float


def make_batch(
    *,
    seed: int = 0,
    scale: float = 1.0,
    per_token_advantages: bool = False,
    token_noise: float = 0.3,
    dtype: torch.dtype = torch.float64,
    extra: int = 0,
    positions: Optional[dict[int, list[int]]] = None,
) -> Batch:
    """Batch of ``len(SEQUENCES) + extra`` sequences (extras are random), width ``WIDTH``.

    Masks are scattered (not prefixes), old log-probs are built so that the masked mean of
    ``lp - old`` over each sequence is exactly its target, and token log ratios spread by
    ``token_noise * scale`` around it (so token ratios fall on both sides of the clip range).
    ``positions`` fixes the response positions of some rows (their length becomes ``len``).
    """
    generator = torch.Generator().manual_seed(seed)
    specs = list(SEQUENCES)
    for _ in range(extra):
        target = float(torch.randn((), generator=generator)) * 0.5
        advantage = float(torch.randn((), generator=generator))
        length = int(torch.randint(1, WIDTH + 1, (), generator=generator))
        specs.append((target, advantage, length))
    batch = len(specs)
    mask = torch.zeros(batch, WIDTH, dtype=torch.bool)
    for i, (_, _, length) in enumerate(specs):
        mask[i, torch.randperm(WIDTH, generator=generator)[:length]] = True
    for i, columns in (positions or {}).items():
        mask[i] = False
        mask[i, columns] = True
    log_probs = -3 * torch.rand(batch, WIDTH, generator=generator, dtype=torch.float64) - 0.05
    noise = (
        torch.randn(batch, WIDTH, generator=generator, dtype=torch.float64) * token_noise * scale
    )
    noise = torch.where(mask, noise, torch.zeros_like(noise))
    lengths = mask.sum(-1).clamp(min=1)
    noise = torch.where(mask, noise - (noise.sum(-1) / lengths).unsqueeze(-1), noise)
    targets = torch.tensor([s[0] for s in specs], dtype=torch.float64) * scale
    old_log_probs = log_probs - targets.unsqueeze(-1) - noise
    advantages = torch.tensor([s[1] for s in specs], dtype=torch.float64)
    if per_token_advantages:
        advantages = advantages.unsqueeze(-1) + 0.8 * torch.randn(
            batch, WIDTH, generator=generator, dtype=torch.float64
        )
    ref_log_probs = log_probs + 0.5 * torch.randn(
        batch, WIDTH, generator=generator, dtype=torch.float64
    )
    entropy = 2 * torch.rand(batch, WIDTH, generator=generator, dtype=torch.float64)
    return Batch(
        log_probs=log_probs.to(dtype),
        old_log_probs=old_log_probs.to(dtype),
        advantages=advantages.to(dtype),
        mask=mask,
        ref_log_probs=ref_log_probs.to(dtype),
        entropy=entropy.to(dtype),
        clip_low=0.2 * scale,
        clip_high=0.28 * scale,
        dual_clip_constant=1 + 0.5 * scale,
    )


def loss_settings(
    batch: Batch, importance_sampling: str, agg: str, **overrides
) -> PolicyLossSettings:
    """Every term of the loss on: the batch's clip range and dual clip, KL (coefficient 0.3) and
    entropy (0.05); ``overrides`` sets the rest (the KL estimator, a rollout correction, ...)."""
    return PolicyLossSettings(
        importance_sampling=importance_sampling,
        clip_low=batch.clip_low,
        clip_high=batch.clip_high,
        loss_agg_mode=agg,
        dual_clip_constant=batch.dual_clip_constant,
        kl_coef=0.3,
        entropy_coef=0.05,
        **overrides,
    )
