"""Megatron-Core version differences and the CPU shims, in one place.

Megatron-Core assumes CUDA. On a machine without a GPU (CI, development) :func:`apply_cpu_shims`
replaces the few upstream places that allocate on ``"cuda"``, use CUDA streams/RNG or reject CPU
tensors, so that the same training code runs under gloo on CPU. Nothing here is applied when CUDA
is available, and every shim is idempotent. Each shim names the upstream function it covers and
declares the megatron-core versions that need it; ``tests/engine`` has a test per shim that fails
when an upstream change makes it unnecessary or ineffective.

Section numbers are those of ``docs/megatron-cpu.md`` ("The CPU shims"), which says why each
exists; 2b (the grad-norm fallback) and 5b (``Tensor.cuda()`` when tying embeddings over pipeline
stages) were found here, as were four for speed alone: 7b (dynamo traces the router's no-op
expert-bias update), 11 (the local experts without per-expert modules, ``engine/experts.py``),
12 (packed RoPE tables once per micro-batch) and 13 (no gradient all-reduce over a
data-parallel group of one); benchmarks/README.md, "vs TRL", has their measurements.
Shim 9 is not a patch but a norm class used in the local layer spec.

Version differences are guarded here and nowhere else. Each shim (and each part of one, such as a
module of :data:`CUDA_ALLOCATING_MODULES`) declares the megatron-core versions whose upstream code
needs it (:class:`NeededOn`); :func:`needed_here` is the one comparison with the installed version,
and :func:`apply_cpu_shims` applies only what it says is needed. ``tests/engine/test_compat.py``
checks every declaration on the installed version, and CI runs it on each of
:data:`CHECKED_VERSIONS`. Differences that are not shims are detected by feature:
:func:`has_router_replay`, :func:`gpt_postprocess_parameters`.

The upstream classes we extend on every device, CPU and GPU (their instances re-classed into a
subclass of ours, nothing global patched), are registered here too
(:func:`registered_extensions`), each with the upstream members it relies on, which the same test
checks on the installed version: Megatron's ``RouterReplay`` (:class:`PolicyRouterReplay`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import megatron.core
import torch
import torch.distributed as dist
from megatron.core import package_info
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

logger = logging.getLogger(__name__)


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.17.1"`` -> ``(0, 17, 1)`` (pre-release and local suffixes are not part of it)."""
    major, minor, patch = (text.split("+")[0].split(".") + ["0", "0"])[:3]
    return int(major), int(minor), int(re.match(r"\d*", patch).group() or 0)


MEGATRON_CORE_VERSION: tuple[int, int, int] = tuple(int(v) for v in package_info.VERSION[:3])
"""(major, minor, patch) of the installed megatron-core."""

OLDEST_SUPPORTED_VERSION = "0.16.1"
"""The oldest megatron-core megatron_gspo runs on (the first with ``RouterReplay``; setup.py's
lower bound)."""

CHECKED_VERSIONS = ("0.16.1", "0.17.1")
"""Every megatron-core version CI runs, each shim's declaration checked on it: 0.16.1 (Python
3.11 job; the newest for Python 3.11) and 0.17.1 (Python 3.12 job; the Docker image's). The
Python 3.12 job is ``.ci/run --py312``; docs/architecture.md has the versions policy."""


@dataclass(frozen=True)
class NeededOn:
    """The megatron-core versions whose upstream code needs a shim: ``since <= version <
    fixed_in`` (``fixed_in=None``: no release has fixed it yet)."""

    since: str = OLDEST_SUPPORTED_VERSION
    fixed_in: str | None = None

    def __contains__(self, version: tuple[int, int, int]) -> bool:
        return parse_version(self.since) <= version and (
            self.fixed_in is None or version < parse_version(self.fixed_in)
        )

    def __str__(self) -> str:
        return f">= {self.since}" + (f", < {self.fixed_in}" if self.fixed_in else "")


def needed_here(needed: NeededOn) -> bool:
    """Whether the installed megatron-core is one of ``needed``'s versions: the only place the
    installed version decides what gets patched."""
    return MEGATRON_CORE_VERSION in needed


def cuda_available() -> bool:
    return torch.cuda.is_available()


def has_transformer_engine() -> bool:
    """Transformer Engine imports (it is only used together with a GPU)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def has_router_replay() -> bool:
    """megatron-core ships ``RouterReplay`` (0.16 and later)."""
    try:
        from megatron.core.transformer.moe import router_replay  # noqa: F401
    except ImportError:
        return False
    return True


def gpt_postprocess_parameters() -> tuple[str, ...]:
    """Parameter names of ``GPTModel._postprocess`` in this version (``PolicyModel`` overrides it
    and must accept what ``GPTModel.forward`` passes)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    return tuple(inspect.signature(GPTModel._postprocess).parameters)[1:]


# ---------------------------------------------------------------------------------------------
# Shim registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shim:
    name: str
    upstream: str
    """The upstream function(s) or call sites the shim covers."""
    apply: Callable[[], None]
    needed: NeededOn
    """The megatron-core versions whose upstream code needs it."""


_SHIMS: list[Shim] = []
_APPLIED: list[str] = []
_ACTIVE = False


def _shim(
    name: str, upstream: str, needed: NeededOn | None = None
) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """Register a shim, needed on ``needed`` (default: every supported version so far); its
    docstring gains the upstream place and those versions."""
    needed = needed or NeededOn()

    def register(function: Callable[[], None]) -> Callable[[], None]:
        function.__doc__ = (
            f"{(function.__doc__ or '').strip()}\n\nCovers: {upstream}.\n"
            f"Needed on megatron-core {needed} (checked on {', '.join(CHECKED_VERSIONS)})."
        )
        _SHIMS.append(Shim(name, upstream, function, needed))
        return function

    return register


def registered_shims() -> list[Shim]:
    return list(_SHIMS)


def declared_needs() -> dict[str, bool]:
    """Whether each shim, and each part of one, is declared needed on the installed version.
    Parts are named ``shim[part]``; ``tests/engine/test_compat.py`` probes every entry."""
    needs = {shim.name: needed_here(shim.needed) for shim in _SHIMS}
    needs.update(
        (f"cuda_allocations[{module}]", needed_here(needed))
        for module, needed in CUDA_ALLOCATING_MODULES.items()
    )
    needs["sequence_parallel_norm"] = needed_here(SequenceParallelTorchNorm.needed)
    return needs


def apply_cpu_shims() -> bool:
    """Apply once, when CUDA is absent, every CPU shim the installed megatron-core needs;
    returns whether shims are active."""
    global _ACTIVE
    if cuda_available():
        return False
    if _ACTIVE:
        return True
    if ".".join(map(str, MEGATRON_CORE_VERSION)) not in CHECKED_VERSIONS:
        logger.warning(
            "megatron-core %s: the CPU shims were checked on %s only; run tests/engine to verify",
            megatron.core.__version__,
            ", ".join(CHECKED_VERSIONS),
        )
    for shim in _SHIMS:
        if needed_here(shim.needed):
            shim.apply()
            _APPLIED.append(shim.name)
    _ACTIVE = True
    return True


def cpu_shims_active() -> bool:
    return _ACTIVE


def applied_shims() -> list[str]:
    """Names of the shims :func:`apply_cpu_shims` applied (those the installed version needs)."""
    return list(_APPLIED)


# ---------------------------------------------------------------------------------------------
# 1. torch.cuda.current_device
# ---------------------------------------------------------------------------------------------

_CPU = torch.device("cpu")


@_shim(
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
        value = getattr(self._torch, name)
        if name in self._FACTORIES:
            return self._wrap(value)
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


@_shim(
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
@_shim(
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


@_shim(
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


@_shim(
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
    real = getattr(torch.Tensor, name)

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        setattr(torch.Tensor, name, replacement)
        try:
            return function(*args, **kwargs)
        finally:
            setattr(torch.Tensor, name, real)

    wrapper._cpu_shim = True
    return wrapper


def _with_cuda_type_names(function: Callable) -> Callable:
    """Run ``function`` with ``Tensor.type()`` reporting CPU tensors under their CUDA names."""
    return _with_tensor_method(function, "type", _cuda_named_type)


@_shim(
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
# 5b. Tensor.cuda() while tying embeddings across pipeline stages
# ---------------------------------------------------------------------------------------------


def _with_cuda_as_identity(function: Callable) -> Callable:
    """Run ``function`` with ``Tensor.cuda()`` returning the (CPU) tensor itself."""
    return _with_tensor_method(function, "cuda", lambda self, *args, **kwargs: self)


@_shim(
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


@_shim(
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
# 7b. torch.compile of the router's expert-bias update
# ---------------------------------------------------------------------------------------------


@_shim(
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


@_shim(
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


@_shim(
    "uneven_all_gather",
    "tensor_parallel.mappings._gather_along_first_dim with output_split_sizes (expert-tp > 1 "
    "token gathers): gloo's allgather rejects tensors of different sizes",
)
def _shim_uneven_all_gather() -> None:
    """Pad every rank's part to the longest, all-gather, strip the padding."""
    from megatron.core.tensor_parallel import mappings

    mappings._gather_along_first_dim = _padded_uneven_all_gather(mappings._gather_along_first_dim)


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
    from megatron_gspo.engine import experts

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


@_shim(
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


@_shim(
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


@_shim(
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
# Upstream classes extended on every device (not CPU shims: nothing global is patched)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassExtension:
    """An upstream class whose instances we re-class into a subclass of ours, on CPU and GPU
    alike. ``relies_on`` names the upstream members the subclass uses; ``tests/engine/
    test_compat.py`` checks them (and the overridden signatures) on the installed version."""

    name: str
    upstream: str
    needed: NeededOn
    relies_on: tuple[str, ...]


_EXTENSIONS: list[ClassExtension] = []


def registered_extensions() -> list[ClassExtension]:
    return list(_EXTENSIONS)


class RoutingReplayError(RuntimeError):
    """Routes were not consumed exactly once, or a router bypassed its ``RouterReplay``."""


ROUTER_REPLAY_TOPK_PARAMETERS = (
    "self",
    "scores",
    "topk",
    "num_groups",
    "group_topk",
    "default_compute_topk",
)
"""The ``RouterReplay.get_replay_topk`` signature :class:`PolicyRouterReplay` overrides (0.16.1,
unchanged in 0.17.1)."""

_EXTENSIONS.append(
    ClassExtension(
        "router_replay",
        "transformer.moe.router_replay.RouterReplay (get_replay_topk: counts what each replaying "
        "forward consumes and keeps the native top-k for routing_change_frac; "
        "engine/routing_replay.py adopts the policy routers' instances)",
        NeededOn(),
        (
            "router_replay_action",
            "target_topk_idx",
            "recorded_topk_idx",
            "replay_backward_list",
            "get_replay_topk",
            "clear_router_replay_action",
            "clear_indices",
            "set_target_indices",
            "set_router_replay_action",
            "global_router_replay_instances",
        ),
    )
)


class PolicyRouterReplay(RouterReplay):
    """Megatron's ``RouterReplay`` of one policy MoE layer, counting what it consumes and keeping
    the native top-k it computes (for ``routing_change_frac``).

    Built by :meth:`adopt` from the instance Megatron's ``TopKRouter`` created, so the router,
    Megatron's registry and the base-class state stay as upstream made them.
    """

    layer_number: int
    """Global decoder layer number (1-based, Megatron's)."""
    moe_index: int
    """Column of this layer in ``[L - 1, M, K]`` routes."""
    record_native: bool
    native_topk_idx: Optional[torch.Tensor]
    used_topk_idx: Optional[torch.Tensor]
    """The experts this forward dispatched to (replayed or native)."""
    forward_uses: int

    @classmethod
    def adopt(cls, replay: RouterReplay, layer_number: int, moe_index: int) -> PolicyRouterReplay:
        # Re-class Megatron's own instance instead of swapping in a new one: TopKRouter, the
        # registry and RouterReplay's static helpers keep referring to the same object.
        replay.__class__ = cls
        replay.layer_number = layer_number
        replay.moe_index = moe_index
        replay.record_native = False
        replay.native_topk_idx = None
        replay.used_topk_idx = None
        replay.forward_uses = 0
        return replay

    def reset(self) -> None:
        self.clear_router_replay_action()
        self.clear_indices()
        self.record_native = False
        self.native_topk_idx = None
        self.used_topk_idx = None
        self.forward_uses = 0

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: Optional[int] = None,
        group_topk: Optional[int] = None,
        default_compute_topk: Optional[Callable] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        action = self.router_replay_action
        where = f"decoder layer {self.layer_number - 1}"
        if action == RouterReplayAction.REPLAY_FORWARD:
            if self.target_topk_idx is None:
                raise RoutingReplayError(f"{where}: replay was asked but no routes were set")
            if self.forward_uses:
                raise RoutingReplayError(
                    f"{where}: routed twice in one forward; its replayed routes are consumed once"
                )
            if self.target_topk_idx.shape != (scores.shape[0], topk):
                raise RoutingReplayError(
                    f"{where}: replayed routes have shape {tuple(self.target_topk_idx.shape)}, "
                    f"the router sees {scores.shape[0]} tokens with top-{topk}"
                )
            self.forward_uses += 1
            if self.record_native:
                # The scores Megatron hands over are what native routing would rank.
                with torch.no_grad():
                    _, native = default_compute_topk(
                        scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                    )
                self.native_topk_idx = native
        elif action == RouterReplayAction.REPLAY_BACKWARD and not self.replay_backward_list:
            raise RoutingReplayError(
                f"{where}: the backward recomputation found no replayed routes left (recompute "
                "ran more forwards than were replayed)"
            )
        probs, indices = super().get_replay_topk(
            scores, topk, num_groups, group_topk, default_compute_topk
        )
        if action == RouterReplayAction.RECORD:
            self.native_topk_idx = indices
        if action != RouterReplayAction.REPLAY_BACKWARD:
            self.used_topk_idx = indices
        return probs, indices
