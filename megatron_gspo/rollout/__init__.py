"""Rollout engines: the request/result contract, the embedded transformers engine, its loopback
server, and the SGLang client and launcher (the weight transports are
:mod:`megatron_gspo.weight_sync`).

Only the contract is imported here; engines load on demand (``rollout.embedded`` pulls
transformers, ``rollout.sglang_client`` requests).
"""

from megatron_gspo.rollout.types import (
    GenerateRequest,
    GenerateResult,
    RolloutEngine,
    RolloutEngineError,
    derive_seed,
    derive_turn_seed,
    expand_samples,
    sync_weights_paused,
)

__all__ = [
    "GenerateRequest",
    "GenerateResult",
    "RolloutEngine",
    "RolloutEngineError",
    "derive_seed",
    "derive_turn_seed",
    "expand_samples",
    "sync_weights_paused",
]
