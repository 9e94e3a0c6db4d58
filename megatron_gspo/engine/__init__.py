"""Training engine: the only package that imports ``megatron.core``.

Public API (imported lazily, so ``import megatron_gspo.engine.logprobs`` stays light)::

    from megatron_gspo.engine import TrainEngine                    # train_step.py
    from megatron_gspo.engine import initialize_parallel, destroy_parallel, ParallelState
    from megatron_gspo.engine import build_policy_model, transformer_config, PolicyModel
    from megatron_gspo.engine import iter_global_parameters, shard_full_tensor, gather_full_tensor
    from megatron_gspo.engine import initialize_weights_from_seed, ShardInfo
    from megatron_gspo.engine import apply_cpu_shims

Modules: ``compat`` (CPU shims, version checks), ``parallel`` (process groups), ``model``
(TransformerConfig, layer spec, PolicyModel, DDP), ``sharding`` (global names, full <-> local,
seed init), ``attention`` (CPU THD / context-parallel core attention), ``packing`` (THD packing,
data- and context-parallel splits), ``batches`` (TrainSample -> micro-batches), ``train_step``
(TrainEngine), ``optimizer`` (AdamW, clipping, lr schedule), ``logprobs`` (vocab-parallel
log-probs), ``checkpoint`` + ``optimizer_state`` (distributed checkpoints), ``routing_replay``
(R2/R3 on Megatron's RouterReplay, routing-change metrics), ``hf_import_export`` (Hugging Face
weights in and out).
"""

from __future__ import annotations

import importlib
from typing import Any

from megatron_gspo.engine import deferred_compile

# Before any engine module imports Megatron: its torch.compile decorations stop building the
# compiler at import (deferred_compile.py; about a third of Megatron's import time).
deferred_compile.install()

_EXPORTS = {
    "apply_cpu_shims": "compat",
    "MEGATRON_CORE_VERSION": "compat",
    "ParallelState": "parallel",
    "initialize_parallel": "parallel",
    "destroy_parallel": "parallel",
    "current_parallel_state": "parallel",
    "PolicyModel": "model",
    "build_policy_model": "model",
    "transformer_config": "model",
    "wrap_with_ddp": "model",
    "unwrap": "model",
    "ShardInfo": "sharding",
    "iter_global_parameters": "sharding",
    "shard_full_tensor": "sharding",
    "gather_full_tensor": "sharding",
    "gather_full_state": "sharding",
    "initialize_weights_from_seed": "sharding",
    "split_for_context_parallel": "packing",
    "pack_sequences": "packing",
    "TrainEngine": "train_step",
    "NonFiniteStepsError": "train_step",
    "build_optimizer": "optimizer",
    "build_scheduler": "optimizer",
    "vocab_parallel_log_probs": "logprobs",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "load_weights_only": "checkpoint",
    "CheckpointError": "checkpoint",
    "PolicyRouting": "routing_replay",
    "RoutingReplayError": "routing_replay",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_gspo.engine' has no attribute {name!r}")
    module = importlib.import_module(f"megatron_gspo.engine.{_EXPORTS[name]}")
    return getattr(module, name)
