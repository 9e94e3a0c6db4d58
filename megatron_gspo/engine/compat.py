"""Megatron-Core version differences and the CPU shims: their registry and checks, in one place.

Megatron-Core assumes CUDA. On a machine without a GPU (CI, development) :func:`apply_cpu_shims`
replaces the few upstream places that allocate on ``"cuda"``, use CUDA streams/RNG or reject CPU
tensors, so that the same training code runs under gloo on CPU. Nothing here is applied when CUDA
is available, and every shim is idempotent. Each shim names the upstream function it covers and
declares the megatron-core versions that need it; ``tests/engine`` has a test per shim that fails
when an upstream change makes it unnecessary or ineffective.

The shims themselves live in two modules that register them with
:func:`~megatron_gspo.engine.shim_registry.cpu_shim` (the registry and the version declarations,
below all three modules) and are imported here: ``engine/cpu_shims.py``, what Megatron needs to run on CPU at
all, and ``engine/cpu_speed_shims.py``, the four for speed alone (7b, 11, 12, 13: bit-identical
results; benchmarks/README.md, "vs TRL", has their measurements). Section numbers are those of
``docs/megatron-cpu.md`` ("The CPU shims"), which says why each exists.

Version differences are guarded here and in those two modules, nowhere else. Each shim (and each
part of one, such as a module of ``cpu_shims.CUDA_ALLOCATING_MODULES``) declares the megatron-core
versions whose upstream code needs it (``shim_registry.NeededOn``); ``shim_registry.needed_here`` is
the one comparison with the installed version, and :func:`apply_cpu_shims` applies only what it says is
needed. ``tests/engine/test_compat.py`` checks every declaration on the installed version, and CI
runs it on each of :data:`CHECKED_VERSIONS`. Differences that are not shims are detected by
feature: :func:`has_router_replay`, :func:`gpt_postprocess_parameters`.

The upstream classes we extend on every device, CPU and GPU (their instances re-classed into a
subclass of ours, nothing global patched), are registered here too
(:func:`registered_extensions`), each with the upstream members it relies on, which the same test
checks on the installed version: Megatron's ``RouterReplay`` (:class:`PolicyRouterReplay`).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import megatron.core
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

# The shim modules register their shims with the registry on import.
from megatron_gspo.engine import cpu_shims, cpu_speed_shims  # noqa: F401
from megatron_gspo.engine.cpu_shims import CUDA_ALLOCATING_MODULES, SequenceParallelTorchNorm
from megatron_gspo.engine.shim_registry import (
    CHECKED_VERSIONS,
    MEGATRON_CORE_VERSION,
    SHIMS,
    WORKAROUNDS,
    NeededOn,
    Shim,
    Workaround,
    needed_here,
    upstream_workaround,
)

logger = logging.getLogger(__name__)


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
# Applying the registered shims
# ---------------------------------------------------------------------------------------------


_APPLIED: list[str] = []
_ACTIVE = False


def registered_shims() -> list[Shim]:
    """Every shim of the two shim modules (each registers its shims on import, above)."""
    return list(SHIMS)


def registered_workarounds() -> list[Workaround]:
    """Every upstream workaround applied on every device (registered below, in this module)."""
    return list(WORKAROUNDS)


def declared_needs() -> dict[str, bool]:
    """Whether each shim, each part of one and each workaround is declared needed on the
    installed version. Parts are named ``shim[part]``; ``tests/engine/test_compat.py`` probes
    every entry."""
    needs = {shim.name: needed_here(shim.needed) for shim in registered_shims()}
    needs.update((workaround.name, needed_here(workaround.needed)) for workaround in WORKAROUNDS)
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
    for shim in registered_shims():
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


# ---------------------------------------------------------------------------------------------
# Expert-bias token counting (GLM-4.5's aux-loss-free load balancing)
# ---------------------------------------------------------------------------------------------


ROUTED_TOKEN_COUNT = NeededOn()
"""Checked on 0.16.1 and 0.17.1: both mask ``[tokens, experts]`` with ``[tokens]``."""


@upstream_workaround(
    "count_routed_tokens",
    "transformer.moe.router.TopKRouter._apply_expert_bias (the padding mask without the expert "
    "axis); installed on the routers with an expert bias by install_routed_token_counting",
    ROUTED_TOKEN_COUNT,
)
def count_routed_tokens(
    router: torch.nn.Module, routing_map: torch.Tensor, padding_mask: Optional[torch.Tensor] = None
) -> None:
    """``TopKRouter._apply_expert_bias`` (0.16.1) with the padding mask broadcast over experts.

    Upstream masks the ``[tokens, experts]`` routing map with the ``[tokens]`` padding mask
    (True at padding) without adding the expert axis, which raises as soon as a packed
    micro-batch carries a padding mask in a training forward (every one of ours). The counts feed
    only ``finalize_model_grads``' expert-bias update (``model.moe_router_bias_update_rate``).
    Same rule as upstream otherwise: count in grad-enabled forwards only (not in evaluation, not
    in ``torch.no_grad`` recomputation), padding excluded."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)


class _AbsentTransformerEngineLinear:
    """Stands for Transformer Engine's ``TELinear`` where TE is not installed: no module is an
    instance of it."""


MLA_WITHOUT_TRANSFORMER_ENGINE = NeededOn(fixed_in="0.17.0")
"""0.16.1 needs it; 0.17.1 guards the ``isinstance`` with ``HAVE_TE`` (0.17.0 not checked)."""


@upstream_workaround(
    "allow_mla_without_transformer_engine",
    "transformer.multi_latent_attention.MultiLatentAttention.__init__ (isinstance with "
    "TELinear, a MagicMock without Transformer Engine)",
    MLA_WITHOUT_TRANSFORMER_ENGINE,
)
def allow_mla_without_transformer_engine() -> bool:
    """Let Megatron's ``MLASelfAttention`` be built without Transformer Engine; True if changed.

    megatron-core 0.16.1's ``transformer/multi_latent_attention.py`` imports ``TELinear`` from
    ``extensions/transformer_engine.py``, which without TE defines its classes on a
    ``MagicMock`` module, so the import succeeds (``HAVE_TE = True``) and ``TELinear`` is a
    MagicMock instance, not a class; ``MultiLatentAttention.__init__`` then calls
    ``isinstance(self.linear_proj, TELinear)`` (line 185) and raises ``TypeError: isinstance()
    arg 2 must be a type``: the local MLA spec cannot be instantiated at all. Replaced by a
    class nothing is an instance of (TE's fp8 branch it guards is then skipped, as without TE).
    Checked on 0.16.1; 0.17.1 imports TE behind ``if HAVE_TE`` and needs nothing (this is then
    a no-op: ``TELinear`` is a class or None)."""
    from megatron.core.transformer import multi_latent_attention

    if not needed_here(MLA_WITHOUT_TRANSFORMER_ENGINE):
        return False
    current = getattr(multi_latent_attention, "TELinear", None)
    if current is None or isinstance(current, type):
        return False
    multi_latent_attention.TELinear = _AbsentTransformerEngineLinear
    return True


def install_routed_token_counting(chunks: list[torch.nn.Module]) -> int:
    """Give every router with an expert bias :func:`count_routed_tokens` (an instance attribute:
    the class stays upstream's). Returns the number of routers changed (0 on a megatron-core
    that counts correctly itself)."""
    import functools

    if not needed_here(ROUTED_TOKEN_COUNT):
        return 0
    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "expert_bias", None) is not None and hasattr(
                module, "local_tokens_per_expert"
            ):
                module._apply_expert_bias = functools.partial(count_routed_tokens, module)
                count += 1
    return count


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
    native_topk_probs: Optional[torch.Tensor]
    """``[tokens, K]`` the combine weights a recording forward gave ``native_topk_idx`` (after
    Megatron's renormalisation and scaling), set by :func:`replay_combine_weights`."""
    target_topk_probs: Optional[torch.Tensor]
    """Combine weights to use at the replayed ids instead of the current router's."""
    replay_backward_probs: list
    """``target_topk_probs`` queued for the backward recomputation, beside
    ``replay_backward_list``."""
    pending_probs: Optional[tuple[torch.Tensor, torch.Tensor]]
    """``(replayed ids, weights)`` of the routing call under way, for
    :func:`replay_combine_weights`."""
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
        replay.native_topk_probs = None
        replay.target_topk_probs = None
        replay.replay_backward_probs = []
        replay.pending_probs = None
        replay.forward_uses = 0
        return replay

    def reset(self) -> None:
        self.clear_router_replay_action()
        self.clear_indices()
        self.record_native = False
        self.native_topk_idx = None
        self.used_topk_idx = None
        self.native_topk_probs = None
        self.target_topk_probs = None
        self.replay_backward_probs = []
        self.pending_probs = None
        self.forward_uses = 0

    def set_target_probs(self, probs: torch.Tensor) -> None:
        """Replay these combine weights (``[tokens, K]``, constants) at the replayed ids of the
        next forward, and of its backward recomputation (:func:`replay_combine_weights`)."""
        self.target_topk_probs = probs
        self.replay_backward_probs.append(probs)

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
        elif action == RouterReplayAction.REPLAY_FORWARD and self.target_topk_probs is not None:
            self.pending_probs = (indices, self.target_topk_probs)
        elif action == RouterReplayAction.REPLAY_BACKWARD and self.replay_backward_probs:
            self.pending_probs = (indices, self.replay_backward_probs.pop(0))
        if action != RouterReplayAction.REPLAY_BACKWARD:
            self.used_topk_idx = indices
        return probs, indices


def replay_combine_weights(router: torch.nn.Module, replay: PolicyRouterReplay) -> None:
    """Wrap ``router.routing`` (``TopKRouter.routing(logits, padding_mask)``, an instance
    attribute: the class stays upstream's) so that its combine weights can be recorded and
    replayed, whatever the score function (softmax, sigmoid with expert bias, groups, scaling):

    * after a recording forward (``RouterReplayAction.RECORD``) ``replay.native_topk_probs`` holds
      the final weights at ``replay.native_topk_idx``;
    * when :meth:`PolicyRouterReplay.set_target_probs` queued weights for a replayed forward (or
      its backward recomputation), the router returns them at the replayed ids, constants: no
      gradient reaches the router through them. ``+ 0 * probs`` keeps upstream's probs in the
      graph, so that the load-balancing loss attached to them still gets its gradient.

    Upstream's sigmoid router with an expert bias ignores the scores ``get_replay_topk`` returns
    and re-gathers its own, so the weights must be replaced here, after ``routing``."""
    upstream = router.routing

    def routing(logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        probs, routing_map = upstream(logits, padding_mask=padding_mask)
        pending, replay.pending_probs = replay.pending_probs, None
        if pending is not None:
            indices, weights = pending
            weights = weights.to(device=probs.device, dtype=probs.dtype)
            replayed = torch.zeros_like(probs).scatter(1, indices.to(probs.device), weights)
            probs = replayed + 0.0 * probs
        elif replay.router_replay_action == RouterReplayAction.RECORD:
            replay.native_topk_probs = probs.detach().gather(1, replay.native_topk_idx)
        return probs, routing_map

    router.routing = routing
