"""KL estimators between the policy and a reference (Schulman, "Approximating KL divergence", 2020).

With ``log_ratio = ref - lp`` (log of ref/policy for a token sampled from the policy):

* k1 = ``lp - ref`` (unbiased, high variance, can be negative)
* k2 = ``(lp - ref)^2 / 2``
* k3 = ``exp(ref - lp) - (ref - lp) - 1`` (unbiased, non-negative)

The log ratio is clamped to ``[-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP]`` *before* ``exp``: an
output-only clamp leaves ``0 * inf = NaN`` in the backward when ``ref - lp`` is huge (pitfall 16 of
``docs/loss-pitfalls.md``; verl clamps the input at 20).

k3 can also be capped, ``clamp(k3, -c, c)`` with ``k3_clamp = c``: verl's and slime's
``low_var_kl`` and ROLL's ``k3`` clamp it to [-10, 10]. Without the cap a token whose reference
log-prob lies far above the policy's (``ref - lp`` near the input clamp, 20) adds up to
``e^20 ~ 5e8`` times the KL coefficient to the gradient; beyond the cap it adds 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_gspo.config.loss_rules import KL_ESTIMATORS

KL_LOG_RATIO_CLAMP = 20.0


def kl_estimate(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: str,
    *,
    k3_clamp: Optional[float] = None,
) -> torch.Tensor:
    """Per-token KL estimate, same shape as the inputs; k3 clamped to ``+-k3_clamp`` if given."""
    log_ratio = (ref_log_probs - log_probs).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        k3 = torch.exp(log_ratio) - log_ratio - 1.0
        return k3 if k3_clamp is None else k3.clamp(-k3_clamp, k3_clamp)
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")
