"""The CPU shims: what Megatron-Core needs to run on a machine without a GPU at all.

Each is registered with :func:`megatron_gspo.engine.shim_registry.cpu_shim` (the upstream place it
covers, the megatron-core versions that need it) and applied by
:func:`~megatron_gspo.engine.compat.apply_cpu_shims`, only when CUDA is absent. Section numbers
are those of ``docs/megatron-cpu.md`` ("The CPU shims"), which says why each exists; the shims
for speed alone (7b, 11-13) are in ``engine/cpu_speed_shims.py``. Shim 9 is not a patch but a
norm class used in the local layer spec.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_gspo.engine.shim_registry import NeededOn, cpu_shim, needed_here

# ---------------------------------------------------------------------------------------------
# 1. torch.cuda.current_device
# ---------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


@cpu_shim(
    "current_device",
    "torch.cuda.current_device() used as the device of ~100 allocations (DDP grad buffers, "
    "tensor_parallel.mappings gathers, router.gating, p2p shape exchange)",
)
def _shim_current_device() -> None:
    """``torch.cuda.current_device()`` returns the CPU device."""
    torch.cuda.current_device = lambda: _CPU


# ---------------------------------------------------------------------------------------------
# 2. Hard-coded device="cuda" allocations
# ---------------------------------------------------------------------------------------------


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuAllocatingTorch:
    """Stands in for the ``torch`` module inside one upstream module: tensor factories called
    with ``device="cuda"`` allocate on CPU, and ``pin_memory`` is dropped. Everything else is
    the real ``torch``."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "empty_like")

    def __init__(self, real_torch: Any):
        self._torch = real_torch

    def __getattr__(self, name: str) -> Any:
        # Resolved once, then found in the instance (the module's hot path asks for ``torch.mm``,
        # ``torch.cat``, ... tens of times per training step). Nothing patches torch's top-level
        # names after import.
        value = getattr(self._torch, name)
        if name in self._FACTORIES:
            value = self._wrap(value)
        setattr(self, name, value)
        return value

    @staticmethod
    def _wrap(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def cpu_factory(*args: Any, **kwargs: Any) -> Any:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = _CPU
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return cpu_factory


CUDA_ALLOCATING_MODULES: dict[str, NeededOn] = {
    "megatron.core.pipeline_parallel.schedules": NeededOn(),
    "megatron.core.optimizer.optimizer": NeededOn(),
    "megatron.core.optimizer.clip_grads": NeededOn(),
    "megatron.core.optimizer.grad_scaler": NeededOn(),
    # 0.18 moved the aux-loss tracker to moe_logging.py, which allocates on the current device.
    "megatron.core.transformer.moe.moe_utils": NeededOn(fixed_in="0.18.0"),
}
"""Modules whose functions allocate with a literal ``device="cuda"`` on our path, and the versions
that do: schedules (``total_num_tokens`` of every forward_backward function), optimizer
(``FP32Optimizer._scale``, ``MixedPrecisionOptimizer.found_inf`` / ``_dummy_overflow_buf`` /
``_scale_one``), clip_grads (``get_grad_norm_fp32``, ``clip_grad_by_total_norm_fp32``,
``count_zeros_fp32``), grad_scaler (scaler state), moe_utils (``reduce_aux_losses_tracker_across_
ranks`` tracker init)."""


@cpu_shim(
    "cuda_allocations",
    "device='cuda' literals in " + ", ".join(m.rsplit(".", 1)[-1] for m in CUDA_ALLOCATING_MODULES),
)
def _shim_cuda_allocations() -> None:
    """Each listed module that the installed version needs it for sees a ``torch`` whose
    factories allocate on CPU (module-scoped, not a global change of torch)."""
    import importlib

    for module_name, needed in CUDA_ALLOCATING_MODULES.items():
        module = importlib.import_module(module_name)
        if needed_here(needed) and not isinstance(module.torch, _CpuAllocatingTorch):
            module.torch = _CpuAllocatingTorch(module.torch)


# 2b. The grad-norm fallback without apex/TE.
@cpu_shim(
    "local_l2_norm",
    "megatron.core.utils.local_multi_tensor_l2_norm (allocates its result on 'cuda'), bound as "
    "optimizer.clip_grads.l2_norm_impl without apex/TE",
)
def _shim_l2_norm() -> None:
    """The grad-norm fallback on CPU: one ``_foreach_norm`` over the tensors (no per-tensor
    fp64 copies), the norms combined in fp64, a CPU tensor returned."""
    from megatron.core.optimizer import clip_grads

    def cpu_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        # Gradients never require grad: no detach per tensor (49 dispatches on the tiny model).
        tensors = [t.detach() if t.requires_grad else t for group in tensor_lists for t in group]
        if not tensors:
            return torch.zeros(1), None
        norms = torch.stack(torch._foreach_norm(tensors)).double()
        return norms.pow(2).sum().sqrt().float().reshape(1), None

    clip_grads.l2_norm_impl = cpu_multi_tensor_l2_norm


# ---------------------------------------------------------------------------------------------
# 3. CUDA RNG
# ---------------------------------------------------------------------------------------------

_STANDIN_CUDA_GENERATOR = torch.Generator(device="cpu")
"""Plays the CUDA default generator. A separate generator (not the CPU default one) so that
``model_parallel_cuda_manual_seed`` does not reseed the CPU stream. Dropout is 0 on CPU runs, so
nothing draws from it; it only has to hold the tracker's states."""


@cpu_shim(
    "cuda_rng",
    "torch.cuda.get_rng_state/set_rng_state/manual_seed and "
    "tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state (model_parallel_cuda_manual_seed,"
    " CudaRNGStatesTracker.add/fork used by TransformerBlock under sequence parallel)",
)
def _shim_cuda_rng() -> None:
    """CUDA RNG calls read and write a CPU stand-in generator."""
    from megatron.core.tensor_parallel import random as tp_random

    def get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
        return _STANDIN_CUDA_GENERATOR.get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
        _STANDIN_CUDA_GENERATOR.set_state(new_state)

    torch.cuda.get_rng_state = get_rng_state
    torch.cuda.set_rng_state = set_rng_state
    torch.cuda.manual_seed = lambda seed: _STANDIN_CUDA_GENERATOR.manual_seed(int(seed))
    tp_random._get_cuda_rng_state = get_rng_state
    tp_random._set_cuda_rng_state = set_rng_state


# ---------------------------------------------------------------------------------------------
# 4 + 6. Synchronisation, streams and events
# ---------------------------------------------------------------------------------------------


class _CpuEvent:
    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """All streams are one stream on CPU: ``current_stream() == Stream()`` so upstream code takes
    its same-stream path (no ``record_stream``)."""

    _instance: _CpuStream | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> _CpuStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass


@cpu_shim(
    "synchronize_and_streams",
    "torch.cuda.synchronize (p2p_communication._p2p_ops / _communicate, DDP, dist-checkpoint "
    "writer); torch.cuda.Stream/current_stream/default_stream/stream/Event "
    "(MoEAlltoAllTokenDispatcher.__init__ and _maybe_dtoh_and_synchronize, param_and_grad_buffer)",
)
def _shim_streams() -> None:
    """Synchronisation is a no-op and every stream is one CPU stand-in."""
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.Event = _CpuEvent
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.default_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# 5. Tensor.type() == 'torch.cuda.FloatTensor' checks
# ---------------------------------------------------------------------------------------------

_REAL_TENSOR_TYPE = torch.Tensor.type


def _cuda_named_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _REAL_TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _REAL_TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


def _with_tensor_method(function: Callable, name: str, replacement: Callable) -> Callable:
    """Run ``function`` with ``torch.Tensor.<name>`` replaced by ``replacement``, restored on
    return (the patch is scoped to the upstream call that needs it)."""
    if getattr(function, "_cpu_shim", False):
        return function

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        # Restore what was there at the call, not at wrapping: a shimmed function may call
        # another (DistributedOptimizer.__init__ calls _build_model_and_main_param_groups), and
        # the inner one must not end the outer one's patch.
        previous = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, replacement)
        try:
            return function(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, previous)

    wrapper._cpu_shim = True
    return wrapper


def _with_cuda_type_names(function: Callable) -> Callable:
    """Run ``function`` with ``Tensor.type()`` reporting CPU tensors under their CUDA names."""
    return _with_tensor_method(function, "type", _cuda_named_type)


@cpu_shim(
    "tensor_type_names",
    "optimizer.clip_grads.clip_grad_by_total_norm_fp32 (asserts grad.type() == "
    "'torch.cuda.FloatTensor') and DistributedOptimizer._build_model_and_main_param_groups "
    "('Wrapped parameters must be one of torch.cuda.FloatTensor...')",
)
def _shim_tensor_type() -> None:
    """Only while those two functions run, ``Tensor.type()`` names CPU tensors as CUDA ones."""
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    wrapped = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = wrapped
    optimizer.clip_grad_by_total_norm_fp32 = wrapped
    cls = distrib_optimizer.DistributedOptimizer
    build = cls.__dict__["_build_model_and_main_param_groups"]
    # A classmethod in 0.16.1 (a staticmethod in older versions): keep the descriptor type.
    descriptor = type(build) if isinstance(build, (classmethod, staticmethod)) else None
    function = build.__func__ if descriptor else build
    if not getattr(function, "_cpu_shim", False):
        wrapped = _with_cuda_type_names(function)
        cls._build_model_and_main_param_groups = descriptor(wrapped) if descriptor else wrapped


# ---------------------------------------------------------------------------------------------
# 5c. The same type names in the mixed-precision optimizers' constructors (bf16 runs)
# ---------------------------------------------------------------------------------------------

MIXED_PRECISION_OPTIMIZER_INITS = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer"),
)
"""(module, class) whose ``__init__`` sorts the parameters by ``param.type()`` under CUDA names."""


@cpu_shim(
    "mixed_precision_type_names",
    "optimizer.Float16OptimizerWithFloat16Params.__init__ (model.dtype=bfloat16: keeps an fp32 "
    "main copy only of 'torch.cuda.BFloat16Tensor' parameters and raises 'Wrapped parameters must "
    "be one of torch.cuda.FloatTensor...' for CPU ones) and DistributedOptimizer.__init__ (marks "
    "'torch.cuda.BFloat16Tensor' parameters as having sharded fp32 main params)",
)
def _shim_mixed_precision_type_names() -> None:
    """bf16 on CPU: while those two constructors run, ``Tensor.type()`` names CPU tensors as
    CUDA ones, so bf16 parameters get Megatron's fp32 main parameters as on a GPU."""
    import importlib

    for module_name, class_name in MIXED_PRECISION_OPTIMIZER_INITS:
        cls = getattr(importlib.import_module(module_name), class_name)
        cls.__init__ = _with_cuda_type_names(cls.__init__)


# ---------------------------------------------------------------------------------------------
# 5b. Tensor.cuda() while tying embeddings across pipeline stages
# ---------------------------------------------------------------------------------------------


def _with_cuda_as_identity(function: Callable) -> Callable:
    """Run ``function`` with ``Tensor.cuda()`` returning the (CPU) tensor itself."""
    return _with_tensor_method(function, "cuda", lambda self, *args, **kwargs: self)


@cpu_shim(
    "tied_embedding_cuda",
    "models.common.language_module.LanguageModule.setup_embeddings_and_output_layer: "
    "'weight.data = weight.data.cuda()' before all-reducing the tied embedding copy of the last "
    "pipeline stage (tied embeddings with pp > 1)",
)
def _shim_tied_embedding_cuda() -> None:
    """Only while that method runs, ``Tensor.cuda()`` keeps tensors on CPU."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    LanguageModule.setup_embeddings_and_output_layer = _with_cuda_as_identity(
        LanguageModule.setup_embeddings_and_output_layer
    )


# ---------------------------------------------------------------------------------------------
# 7. moe_utils.te_general_gemm
# ---------------------------------------------------------------------------------------------


@cpu_shim(
    "te_general_gemm",
    "transformer.moe.moe_utils.RouterGatingLinearFunction reads te_general_gemm, which is only "
    "defined when Transformer Engine imports (NameError otherwise; 0.17 defines it as None)",
    NeededOn(fixed_in="0.17.0"),
)
def _shim_te_general_gemm() -> None:
    """Define ``moe_utils.te_general_gemm = None`` so the router takes its torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# ---------------------------------------------------------------------------------------------
# 8. maybe_move_tensor_to_cpu(as_numpy=True)
# ---------------------------------------------------------------------------------------------


def _cpu_maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """Like upstream, but also converts CPU tensors when ``as_numpy`` (split sizes for
    ``all_to_all_single`` must be Python sequences)."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().cpu()
        if as_numpy:
            return tensor.numpy()
    return tensor


@cpu_shim(
    "split_sizes_to_numpy",
    "transformer.moe.moe_utils.maybe_move_tensor_to_cpu (and its import in token_dispatcher): "
    "keeps CPU split sizes as tensors, which all_to_all_single rejects with ep > 1",
)
def _shim_split_sizes() -> None:
    """``maybe_move_tensor_to_cpu(..., as_numpy=True)`` returns numpy arrays for CPU tensors."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    moe_utils.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = _cpu_maybe_move_tensor_to_cpu


# ---------------------------------------------------------------------------------------------
# 9. Norms under sequence parallel
# ---------------------------------------------------------------------------------------------


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.RMSNorm`` / ``LayerNorm`` and tags its parameters ``sequence_parallel``.

    Covers ``megatron.core.transformer.torch_norm.WrappedTorchNorm`` (the local spec's norm without
    apex), which asserts ``not config.sequence_parallel``. Under sequence parallel each tensor
    rank normalises a different slice of tokens with the same replicated weight, so the weight's
    gradient must be summed over tp: ``finalize_model_grads`` does that for parameters tagged
    ``sequence_parallel=True``. Used in the local layer spec (it is a spec substitution, not a
    patch), only without a GPU.
    """

    needed = NeededOn()
    """The versions whose ``WrappedTorchNorm`` rejects sequence parallel."""

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported on CPU")
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm


# ---------------------------------------------------------------------------------------------
# 10. Uneven all-gather on gloo
# ---------------------------------------------------------------------------------------------


def _padded_uneven_all_gather(original: Callable) -> Callable:
    if getattr(original, "_cpu_shim", False):
        return original

    @functools.wraps(original)
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (
            output_split_sizes is None
            or group.size() == 1
            or len(set(int(s) for s in output_split_sizes)) == 1
        ):
            return original(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((longest * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        return torch.cat([gathered[r * longest : r * longest + n] for r, n in enumerate(sizes)])

    gather._cpu_shim = True
    return gather


@cpu_shim(
    "uneven_all_gather",
    "tensor_parallel.mappings._gather_along_first_dim with output_split_sizes (expert-tp > 1 "
    "token gathers): gloo's allgather rejects tensors of different sizes",
)
def _shim_uneven_all_gather() -> None:
    """Pad every rank's part to the longest, all-gather, strip the padding."""
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _padded_uneven_all_gather(mappings._gather_along_first_dim)
