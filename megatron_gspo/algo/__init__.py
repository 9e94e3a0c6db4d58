"""Algorithm core: advantages, policy losses, KL. Pure torch; never imports Megatron.

Public API::

    from megatron_gspo.algo import policy_loss, compute_advantages

Both take tensors (and, where a reduction crosses ranks, process groups), never a config object.
"""

from megatron_gspo.algo.advantages import (
    RunningMoments,
    add_token_level_kl,
    compute_advantages,
    estimate_advantages,
    finish_advantages,
    group_statistics,
    normalize_rewards,
    whiten,
)
from megatron_gspo.algo.kl import kl_estimate
from megatron_gspo.algo.losses import RATIO_FUNCTIONS, aggregate, policy_loss, sequence_log_ratio

__all__ = [
    "RATIO_FUNCTIONS",
    "RunningMoments",
    "add_token_level_kl",
    "aggregate",
    "compute_advantages",
    "estimate_advantages",
    "finish_advantages",
    "group_statistics",
    "kl_estimate",
    "normalize_rewards",
    "policy_loss",
    "sequence_log_ratio",
    "whiten",
]
