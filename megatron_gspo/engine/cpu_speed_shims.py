"""The CPU shims for speed alone: each replaces an upstream step that is slow on CPU with the
same operations done once or batched, bit-identical to upstream (7b: no dynamo trace of the
router's no-op expert-bias update; 11: the local experts without per-expert modules,
``engine/experts.py``; 12: packed RoPE tables once per micro-batch; 13: no gradient all-reduce
over a data-parallel group of one; 14: no per-step walk over every module when nothing is to be
reset; 15: no grad-norm all-reduce over a model-parallel group of one). Registered like the others
(:func:`megatron_gspo.engine.shim_registry.cpu_shim`); section numbers and reasons:
``docs/megatron-cpu.md``; measurements: benchmarks/README.md, "vs TRL".
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from megatron_gspo.engine import experts
from megatron_gspo.engine.shim_registry import cpu_shim

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# 7b. torch.compile of the router's expert-bias update
# ---------------------------------------------------------------------------------------------


@cpu_shim(
    "router_expert_bias_compile",
    "transformer.moe.router.TopKRouter._apply_expert_bias, decorated with megatron.core.jit."
    "jit_fuser (torch.compile for torch >= 2.2) and called on every router forward",
)
def _shim_router_expert_bias_compile() -> None:
    """The router's expert-bias update runs uncompiled. Without expert bias (our configs) it is
    a no-op, yet its first call makes dynamo trace it: 0.2 s and ~4 MB of peak memory per
    process, and a guard check on every later call."""
    from megatron.core.transformer.moe.router import TopKRouter

    original = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable", None)
    if original is not None:
        TopKRouter._apply_expert_bias = original


# ---------------------------------------------------------------------------------------------
# 11. SequentialMLP: the local experts without per-expert modules
# ---------------------------------------------------------------------------------------------

SEQUENTIAL_MLP_FORWARD_PARAMETERS = (
    "self",
    "permuted_local_hidden_states",
    "tokens_per_expert",
    "permuted_probs",
)
"""The ``SequentialMLP.forward`` signature ``engine/experts.py`` was written against (0.16.1,
0.17.1); another one is left unpatched (and the shim's check in tests/engine fails)."""


def _with_batched_experts(forward: Callable) -> Callable:
    if getattr(forward, "_cpu_shim", False):
        return forward

    @functools.wraps(forward)
    def batched_forward(self: Any, hidden: Any, tokens_per_expert: Any, probs: Any, *args, **kw):
        if (
            args
            or kw
            or not experts.batched_experts_supported(self, hidden, tokens_per_expert, probs)
        ):
            return forward(self, hidden, tokens_per_expert, probs, *args, **kw)
        return experts.batched_experts_forward(self, hidden, tokens_per_expert, probs)

    batched_forward._cpu_shim = True
    return batched_forward


@cpu_shim(
    "batched_experts",
    "transformer.moe.experts.SequentialMLP.forward (the experts without Transformer Engine or "
    "grouped_gemm: a Python loop over local experts, two Megatron linear autograd Functions, an "
    "activation and a probs product each; identical in 0.17.1)",
)
def _shim_batched_experts() -> None:
    """``SequentialMLP.forward`` runs :func:`megatron_gspo.engine.experts.
    batched_experts_forward` (same operations, same parameters, bit-identical results, ~1.6x
    faster at test sizes) where it is exact, the original forward otherwise."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    parameters = tuple(inspect.signature(SequentialMLP.forward).parameters)
    if parameters != SEQUENTIAL_MLP_FORWARD_PARAMETERS:
        logger.warning(
            "SequentialMLP.forward%s differs from the checked signature; experts run per module",
            parameters,
        )
        return
    SequentialMLP.forward = _with_batched_experts(SequentialMLP.forward)


# ---------------------------------------------------------------------------------------------
# 12. Packed (THD) RoPE: the micro-batch's rotary tables built once
# ---------------------------------------------------------------------------------------------

THD_ROPE_PARAMETERS = (
    "t",
    "cu_seqlens",
    "freqs",
    "rotary_interleaved",
    "multi_latent_attention",
    "mscale",
    "cp_group",
)
"""The ``_apply_rotary_pos_emb_thd`` signature of 0.16.1-0.18.x this shim reproduces."""


def _with_cached_thd_tables(apply_thd: Callable) -> Callable:
    if getattr(apply_thd, "_cpu_shim", False):
        return apply_thd
    from megatron.core.models.common.embeddings import rope_utils

    # One entry: the last micro-batch's (cu_seqlens, freqs, cp rank, dtype, mscale) and its
    # cos / sin tables. The tensors themselves are kept, so their ids cannot be reused.
    cache: dict[str, Any] = {}

    @functools.wraps(apply_thd)
    def apply(
        t: torch.Tensor,
        cu_seqlens: torch.Tensor,
        freqs: torch.Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
        cp_group: Any = None,
    ) -> torch.Tensor:
        if cp_group is None or multi_latent_attention or t.device.type != "cpu":
            return apply_thd(
                t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group
            )
        key = (
            cp_group.size(),
            cp_group.rank(),
            t.dtype,
            mscale,
            cu_seqlens._version,
            torch.is_inference_mode_enabled(),
        )
        entry = cache.get("tables")
        if (
            entry is None
            or entry["cu_seqlens"] is not cu_seqlens
            or entry["freqs"] is not freqs
            or entry["key"] != key
            or entry["freqs_version"] != freqs._version
        ):
            cp_size, cp_rank = key[0], key[1]
            # Upstream's packed frequencies (both of its mappings), as it builds them per call.
            seqlens = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
            exact = freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]
            slices = [
                rope_utils._get_thd_freqs_on_this_cp_rank(
                    cp_rank, cp_size, x, freqs, *((int(cu_seqlens[i]),) if exact else ())
                )
                for i, x in enumerate(torch.split(t, seqlens))
            ]
            packed = torch.cat(slices, dim=0)
            entry = {
                "cu_seqlens": cu_seqlens,
                "freqs": freqs,
                "key": key,
                "freqs_version": freqs._version,
                "rot_dim": packed.shape[-1],
                "cos": (torch.cos(packed) * mscale).to(t.dtype),
                "sin": (torch.sin(packed) * mscale).to(t.dtype),
            }
            cache["tables"] = entry
        # _apply_rotary_pos_emb_bshd's arithmetic on [t, 1, h, d] with the cached tables.
        t = t.unsqueeze(1)
        rot_dim = entry["rot_dim"]
        rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
        rotated = (rotated * entry["cos"]) + (
            rope_utils._rotate_half(rotated, rotary_interleaved) * entry["sin"]
        )
        # Upstream concatenates the (here empty) pass-through part: a copy of equal values.
        if passed.shape[-1]:
            rotated = torch.cat((rotated, passed), dim=-1)
        return rotated.squeeze(1)

    apply._cpu_shim = True
    return apply


@cpu_shim(
    "thd_rope_tables",
    "models.common.embeddings.rope_utils._apply_rotary_pos_emb_thd (unfused RoPE of packed "
    "sequences: per call, a Python loop over the micro-batch's sequences slicing the frequency "
    "table, a cat, then cos and sin of the packed table; 2 calls per layer, same tables)",
)
def _shim_thd_rope_tables() -> None:
    """Packed RoPE builds the micro-batch's frequency, cos and sin tables once and reuses them
    for the queries and keys of every layer (same values, same arithmetic: bit-identical)."""
    from megatron.core.models.common.embeddings import rope_utils

    parameters = tuple(inspect.signature(rope_utils._apply_rotary_pos_emb_thd).parameters)
    if parameters != THD_ROPE_PARAMETERS:
        logger.warning(
            "_apply_rotary_pos_emb_thd%s differs from the checked signature; RoPE tables are "
            "rebuilt per call",
            parameters,
        )
        return
    rope_utils._apply_rotary_pos_emb_thd = _with_cached_thd_tables(
        rope_utils._apply_rotary_pos_emb_thd
    )


# ---------------------------------------------------------------------------------------------
# 13. Gradient all-reduce over a data-parallel group of one
# ---------------------------------------------------------------------------------------------


def _skipping_lone_grad_sync(start_grad_sync: Callable) -> Callable:
    if getattr(start_grad_sync, "_cpu_shim", False):
        return start_grad_sync

    @functools.wraps(start_grad_sync)
    def start(self: Any, force_all_reduce: bool = False) -> None:
        config = self.ddp_config
        group = (
            self.intra_distributed_optimizer_instance_group
            if config.use_distributed_optimizer
            else self.data_parallel_group
        )
        if (
            config.overlap_grad_reduce
            or config.num_distributed_optimizer_instances != 1
            or config.check_for_nan_in_grad
            or config.check_for_large_grads
            or group is None
            or group.size() != 1
        ):
            return start_grad_sync(self, force_all_reduce)
        # What upstream does before its collective, which on one rank leaves the buffer as is.
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data *= bucket.gradient_scaling_factor
        self.grad_reduce_handle = None

    start._cpu_shim = True
    return start


@cpu_shim(
    "lone_grad_sync",
    "distributed.param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync (a coalesced "
    "gloo all-reduce of every gradient bucket, twice per optimizer step, also when the "
    "data-parallel group is this rank alone: a hand-off to gloo's worker thread each)",
)
def _shim_lone_grad_sync() -> None:
    """Gradient buckets of a data-parallel group of one rank are only scaled (upstream's
    ``gradient_scaling_factor``), not all-reduced with themselves."""
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    _ParamAndGradBucketGroup.start_grad_sync = _skipping_lone_grad_sync(
        _ParamAndGradBucketGroup.start_grad_sync
    )


# ---------------------------------------------------------------------------------------------
# 14. The per-step walk over every module to reset MoE temporary tensors
# ---------------------------------------------------------------------------------------------


def _resets_temporary_tensors(config: Any) -> bool:
    """Whether upstream's ``reset_model_temporary_tensors`` can change anything under ``config``:
    its loop body acts only with expert bias or a global aux loss (the same two tests)."""
    balancing = config.moe_router_load_balancing_type
    return bool(config.moe_router_enable_expert_bias) or (
        balancing == "global_aux_loss" or "global_aux_loss" in balancing
    )


def _skipping_idle_temporary_reset(reset: Callable) -> Callable:
    if getattr(reset, "_cpu_shim", False):
        return reset

    @functools.wraps(reset)
    def reset_if_any(config: Any, model: list) -> None:
        if _resets_temporary_tensors(config):
            reset(config, model)

    reset_if_any._cpu_shim = True
    return reset_if_any


@cpu_shim(
    "idle_temporary_reset",
    "distributed.finalize_model_grads.reset_model_temporary_tensors (called by "
    "finalize_model_grads once per optimizer step: a walk over every module of the model, "
    "~1000 at the vs-TRL medium size, testing two settings per module that are the same for all)",
)
def _shim_idle_temporary_reset() -> None:
    """The walk is skipped when neither expert bias nor a global aux loss is configured: then
    upstream's loop body does nothing for any module."""
    # The package re-exports the function under the module's name: import the module itself.
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    finalize.reset_model_temporary_tensors = _skipping_idle_temporary_reset(
        finalize.reset_model_temporary_tensors
    )


# ---------------------------------------------------------------------------------------------
# 15. The grad-norm all-reduce over a model-parallel group of one
# ---------------------------------------------------------------------------------------------


def _local_grad_norm(get_grad_norm_fp32: Callable) -> Callable:
    if getattr(get_grad_norm_fp32, "_cpu_shim", False):
        return get_grad_norm_fp32
    from megatron.core.optimizer import clip_grads

    @functools.wraps(get_grad_norm_fp32)
    def grad_norm(
        grads_for_norm: Any, norm_type: Any = 2, grad_stats_parallel_group: Any = None
    ) -> float:
        grads = [grads_for_norm] if isinstance(grads_for_norm, torch.Tensor) else grads_for_norm
        if (
            float(norm_type) != 2.0
            or grad_stats_parallel_group is None
            or grad_stats_parallel_group.size() != 1
            or any(type(grad) is not torch.Tensor for grad in grads)  # DTensors: upstream
        ):
            return get_grad_norm_fp32(grads_for_norm, norm_type, grad_stats_parallel_group)
        # Upstream's L2 branch for plain tensors, less its sum over a group of this rank alone.
        if grads:
            overflow = torch.zeros(1, dtype=torch.int)
            norm, _ = clip_grads.multi_tensor_applier(
                clip_grads.l2_norm_impl, overflow, [grads], False
            )
        else:
            norm = torch.zeros(1, dtype=torch.float)
        return (norm**2.0).item() ** (1.0 / 2.0)

    grad_norm._cpu_shim = True
    return grad_norm


@cpu_shim(
    "lone_grad_norm",
    "optimizer.clip_grads.get_grad_norm_fp32 as bound in optimizer.optimizer (the optimizers' "
    "get_grad_norm: per step and sub-optimizer a gloo all-reduce of the squared norm over the "
    "model-parallel group, also when that group is this rank alone, and a no-grad context per "
    "gradient to unwrap DTensors)",
)
def _shim_lone_grad_norm() -> None:
    """Over a model-parallel group of one rank and plain gradient tensors, the L2 norm is
    upstream's local norm without the all-reduce (a sum over one value: the same number)."""
    from megatron.core.optimizer import optimizer

    optimizer.get_grad_norm_fp32 = _local_grad_norm(optimizer.get_grad_norm_fp32)
