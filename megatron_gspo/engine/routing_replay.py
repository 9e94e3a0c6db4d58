"""MoE Routing Replay (R2 / R3) and expert-volatility metrics on Megatron-Core's ``RouterReplay``.

Terms (``docs/loss-pitfalls.md``, "Routing Replay"): **R2** records every MoE layer's top-k experts
per token in the old-log-prob forward of the training engine and replays them in the training
forwards of the same samples; **R3** replays the rollout engine's routes in the old-log-prob
forward and in the training forwards.

Mechanism. The policy is built with ``moe_enable_routing_replay`` (for any MoE policy: with no
replay action set, Megatron's ``RouterReplay`` computes the native top-k, bit for bit), and
:class:`PolicyRouting` adopts the ``RouterReplay`` of each of the policy's routers, found by
walking the policy's chunks. Megatron's process-global registry
(``RouterReplay.global_router_replay_instances``) is never used to drive replay, so a reference
model (built without replay: its routers have no ``RouterReplay``) or a second engine in the same
process can never replay the policy's routes. The adopted instances are re-classed into
:class:`~megatron_gspo.engine.compat.PolicyRouterReplay` (registered and version-checked with the
other upstream adaptations in ``compat.py``), which counts what each forward consumes and keeps
the native top-k. On replay Megatron gathers the combine weights from the router's dense scores
at the forced indices, so the router keeps its gradient; the load-balancing loss of megatron-core
0.16 uses its own top-k of the router logits, not the replayed one (replayed routes change which
experts compute, not that loss).

Sources. Routes are ``[L - 1, M, K]`` per sample (the format of :mod:`megatron_gspo.samples.routes`).
The sample declares both kinds: ``TrainSample.rollout_routes`` from the rollout engine and
``TrainSample.old_routes``, recorded natively by the old-log-prob forward
(``forward_log_probs(record_routes=True)`` returns them; the stage that calls it stores them). The
replay picks its source by mode, R2 the old routes and R3 the rollout's; nothing is overwritten.

Weights (``algo.routing_replay_weights``). ``recompute``: Megatron's replay, above (the combine
weights of the replayed ids come from the router being trained). ``replayed``: the replaying
forwards use recorded combine weights as constants at the replayed ids
(:func:`~megatron_gspo.engine.compat.replay_combine_weights`; the router then gets no gradient
from the policy loss). Under R2 the old-log-prob forward records them (``TrainSample.
old_route_weights``, gathered like the ids) and the training forwards replay them; under R3 they
are the rollout engine's (``TrainSample.rollout_route_weights``: what the embedded engine's
routers multiplied each expert's output by, reported beside the ids), replayed in the
old-log-prob forward and in the training forwards, so that every forward routes exactly as the
engine did. The weights are the final ones in either convention (after renormalisation and
routed scaling), which the engine's routers (``rollout/route_forcing.py`` has their rules) and
Megatron's share for the supported architectures: in float32 the engine's weights equal
Megatron's recompute at the same ids to rounding. ``routing_replay_weights_replayed`` (1 or 0)
is logged on every replayed training pass.

Layout. The packer feeds exactly the ``L - 1`` input positions (``tokens[:-1]``: the last token
predicts nothing), so the rollout engine's ``L - 1`` rows cover every input position and **no
row is missing**: the last-token problem of verl/slime (they feed all ``L`` tokens) does not arise
here. Only the THD padding of each sequence (to the multiple tp/cp need) and filler micro-batches
have no route; they get the distinct, balanced ids of :func:`~megatron_gspo.samples.routes.
balanced_pad_routes`; their outputs reach no real token (causal attention, padding at sequence
ends) and padding is excluded from the load-balancing statistics. Routes go through the same
steps as the input ids: THD packing (:meth:`PackedSequences.full_row`), the context-parallel
zig-zag (:func:`~megatron_gspo.engine.packing.split_for_context_parallel`), Megatron's
sequence-parallel scatter over tp (hidden states are ``[s / tp, b, h]`` in the router), and
pipeline stages (each chunk sets only its own layers, found by global layer number).

Consumption. Every replaying forward must consume each layer's routes exactly once: a layer that
did not route (or routed twice) raises :class:`RoutingReplayError`. With full activation
recompute the backward recomputation pops the same micro-batch's routes in FIFO order
(``REPLAY_BACKWARD``); routes left unconsumed at the end of the step raise too.

Expert volatility (``routing_change_frac``): the fraction of (loss token, MoE layer) pairs whose
top-k SET under the weights being trained differs from the old policy's. A token counts at the
position that predicts it (``P - 1 + j`` for response token ``j``). The native top-k is exact and
nearly free: under replay Megatron still hands the router scores to ``RouterReplay``, which takes
one extra top-k of them; without replay the forward records its native routes. "The old
policy's routes" are ``TrainSample.old_routes``, those the old-log-prob forward computed
natively (under R3 that forward replays the rollout's routes and records what the trainer would
have chosen, so the metric isolates the drift caused by the updates from train/inference
mismatch). ``routing_change_frac_vs_rollout`` compares the trainer's native routes with the
rollout engine's (whenever the samples carry them), and ``routing_mismatch_vs_rollout`` the
experts the training forward actually used (replayed or native) with the rollout engine's: 0
under R3 by construction on every replayed layer, the old policy's routes against the engine's
under R2 (nonzero with a reduced-precision engine), the native routes without replay. Without
an old-log-prob forward (``old_log_prob_source`` rollout or detach) ``routing_change_frac`` is not
reported.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_gspo.config import TrainConfig
from megatron_gspo.engine.compat import (
    PolicyRouterReplay,
    RoutingReplayError,
    replay_combine_weights,
)
from megatron_gspo.engine.model import unwrap
from megatron_gspo.engine.parallel import ParallelState
from megatron_gspo.samples import TrainSample
from megatron_gspo.samples.routes import (
    balanced_pad_routes,
    check_route_weights,
    check_routes_of_samples,
    route_dtype,
    topk_sets_differ,
)

if TYPE_CHECKING:
    from megatron_gspo.engine.batches import MicroBatch

_TRANSPORT_CHUNK = 1 << 26
"""Elements per all-reduce when gathering recorded routes (bounds the device buffer)."""


# ---------------------------------------------------------------------------------------------
# Per micro-batch layout
# ---------------------------------------------------------------------------------------------


@dataclass
class MicroBatchRoutes:
    """The routes of one micro-batch on this rank, in the router's token order (this cp rank's
    zig-zag part, then this tp rank's sequence-parallel slice): ``T_loc`` tokens."""

    rows: torch.Tensor
    """``[T_loc]`` int64 row of each token in the mini-batch's flat ``[sum(L_i - 1), M, K]``
    routes (sample offset + position); -1 at padding."""
    replay: Optional[torch.Tensor]
    """``[T_loc, M, K]`` expert ids to replay (padding rows balanced), or None."""
    replay_weights: Optional[torch.Tensor]
    """``[T_loc, M, K]`` float32 combine weights to replay with them (padding rows 1/K), or
    None (``algo.routing_replay_weights=recompute``: the current router's)."""
    compare_tokens: torch.Tensor
    """``[n]`` int64 local tokens that predict a loss token."""
    old: Optional[torch.Tensor]
    """``[n, M, K]`` the old policy's routes at ``compare_tokens``."""
    rollout: Optional[torch.Tensor]
    """``[n, M, K]`` the rollout engine's routes at ``compare_tokens``."""


def _row_offsets(samples: Sequence[TrainSample]) -> list[int]:
    offsets = [0]
    for sample in samples:
        offsets.append(offsets[-1] + int(sample.tokens.numel()) - 1)
    return offsets


def micro_batch_routes(
    micro_batch: MicroBatch,
    samples: Sequence[TrainSample],
    row_offsets: Sequence[int],
    *,
    replay: Optional[Sequence[torch.Tensor]],
    old: Optional[torch.Tensor],
    rollout: Optional[torch.Tensor],
    num_moe_layers: int,
    topk: int,
    num_experts: int,
    tp_group: dist.ProcessGroup,
    replay_weights: Optional[Sequence[torch.Tensor]] = None,
) -> MicroBatchRoutes:
    """Pack, zig-zag split and sequence-parallel scatter the routes of ``micro_batch``.

    ``replay``: per-sample ``[L_i - 1, M, K]`` routes of the whole mini-batch (or None);
    ``old`` / ``rollout``: flat ``[sum(L_i - 1), M, K]`` routes to compare with (or None).
    """
    packed = micro_batch.packed
    chosen = micro_batch.sample_indices
    rows = torch.full((packed.num_tokens,), -1, dtype=torch.long)
    loss_position = torch.zeros(packed.num_tokens, dtype=torch.bool)
    offset = 0
    for index, length, padded in zip(chosen, packed.lengths, packed.padded_lengths):
        sample = samples[index]
        rows[offset : offset + length] = row_offsets[index] + torch.arange(length)
        start = offset + sample.prompt_length - 1
        loss_position[start : start + sample.response_length] = sample.response_mask()
        offset += padded

    def local(full_row: torch.Tensor) -> torch.Tensor:
        # The input ids' path: zig-zag over cp, then Megatron's sequence-parallel scatter.
        return tensor_parallel.scatter_to_sequence_parallel_region(
            packed.split(full_row), group=tp_group
        )

    local_rows = local(rows)
    compare_tokens = torch.nonzero(local(loss_position)).squeeze(1)
    replay_local = None
    if replay is not None:
        dtype = route_dtype(num_experts)
        if chosen:
            full = packed.full_row([replay[i].to(dtype) for i in chosen])
        else:  # filler micro-batch: padding only
            full = torch.zeros((packed.num_tokens, num_moe_layers, topk), dtype=dtype)
        padding = rows < 0
        pad = balanced_pad_routes(torch.nonzero(padding).squeeze(1), topk, num_experts)
        full[padding] = pad.unsqueeze(1).to(dtype)
        replay_local = local(full)
    weights_local = None
    if replay_weights is not None:
        if chosen:
            weights = packed.full_row([replay_weights[i].float() for i in chosen])
        else:
            weights = torch.zeros((packed.num_tokens, num_moe_layers, topk), dtype=torch.float32)
        # Padding rows reach no real token; any finite weights do.
        weights[rows < 0] = 1.0 / topk
        weights_local = local(weights)
    compare_rows = local_rows[compare_tokens]
    return MicroBatchRoutes(
        rows=local_rows,
        replay=replay_local,
        replay_weights=weights_local,
        compare_tokens=compare_tokens,
        old=None if old is None else old[compare_rows],
        rollout=None if rollout is None else rollout[compare_rows],
    )


# ---------------------------------------------------------------------------------------------
# The policy's routers and one forward pass over them
# ---------------------------------------------------------------------------------------------


def check_never_replays(chunks: Sequence[torch.nn.Module]) -> None:
    """Raise unless no router of ``chunks`` can replay (a reference model must route natively:
    pitfall 13 of ``docs/loss-pitfalls.md``)."""
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None and router.router_replay is not None:
                raise ValueError(
                    f"decoder layer {layer.layer_number - 1} of the reference model has a "
                    "RouterReplay; build it with build_policy_model(..., routing_replay=False)"
                )


class PolicyRouting:
    """The ``RouterReplay`` of every MoE layer of the policy chunks on this rank, and what the
    old-log-prob and training forwards do with them (see the module docstring)."""

    def __init__(
        self, chunks: Sequence[torch.nn.Module], parallel: ParallelState, cfg: TrainConfig
    ):
        self.parallel = parallel
        self.mode = cfg.algo.routing_replay
        self.measure = cfg.algo.log_routing_change
        self.replay_weights = cfg.algo.routing_replay_weights == "replayed"
        self.moe_layers = list(cfg.model.moe_layer_indices)
        self.topk = cfg.model.moe_router_topk
        self.num_experts = cfg.model.num_experts
        config = chunks[0].config
        self.recompute = config.recompute_granularity == "full"
        if config.moe_router_fusion:
            raise ValueError("moe_router_fusion bypasses RouterReplay; routing replay needs it off")
        self.routers: dict[int, list[PolicyRouterReplay]] = {}
        for chunk in chunks:
            replays = []
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is None:
                    continue  # a dense layer
                where = f"decoder layer {layer.layer_number - 1}"
                if router.router_replay is None:
                    raise ValueError(
                        f"{where} has no RouterReplay: build the policy with "
                        "moe_enable_routing_replay (build_policy_model does for MoE policies)"
                    )
                if router.routing_type == "sinkhorn":
                    raise ValueError(f"{where}: sinkhorn routing bypasses RouterReplay")
                moe_index = self.moe_layers.index(layer.layer_number - 1)
                adopted = PolicyRouterReplay.adopt(
                    router.router_replay, layer.layer_number, moe_index
                )
                if self.replay_weights:
                    replay_combine_weights(router, adopted)
                replays.append(adopted)
            self.routers[id(chunk)] = replays

    @property
    def all_routers(self) -> list[PolicyRouterReplay]:
        return [replay for replays in self.routers.values() for replay in replays]

    def _validated(
        self, samples: Sequence[TrainSample], routes: Sequence[Optional[torch.Tensor]], source: str
    ) -> list[torch.Tensor]:
        return check_routes_of_samples(
            [
                self._filler_routes(sample) if _never_routed(sample, route) else route
                for sample, route in zip(samples, routes)
            ],
            wheres=[f"sample {index} (group {s.group_id})" for index, s in enumerate(samples)],
            num_positions=[int(sample.tokens.numel()) - 1 for sample in samples],
            num_moe_layers=len(self.moe_layers),
            topk=self.topk,
            num_experts=self.num_experts,
            source=source,
        )

    def _filler_routes(self, sample: TrainSample) -> torch.Tensor:
        """Routes for a sample out of the loss that never reached an engine (an episode aborted
        before its first turn: the prompt and one masked token): any distinct experts, which
        train nothing."""
        positions = torch.arange(int(sample.tokens.numel()) - 1)
        rows = balanced_pad_routes(positions, self.topk, self.num_experts)
        layers = rows.unsqueeze(1).expand(-1, len(self.moe_layers), -1)
        return layers.to(route_dtype(self.num_experts)).contiguous()

    def _validated_weights(
        self, samples: Sequence[TrainSample], routes: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The combine weights to replay with ``routes`` (the mode's): R2's recorded by the
        old-log-prob forward, R3's reported by the rollout engine."""
        if self.mode == "r2":
            field = "old_route_weights"
            source = (
                "routing_replay_weights=replayed with r2 replays the weights recorded by "
                "forward_log_probs(record_routes=True)"
            )
        else:
            field = "rollout_route_weights"
            source = (
                "routing_replay_weights=replayed with r3 replays the rollout engine's weights: "
                "request them (GenerateRequest.return_routed_expert_weights, the embedded engine)"
            )
        return [
            check_route_weights(
                # A sample that never reached an engine (filler routes) weighs its experts alike.
                torch.full(route.shape, 1.0 / self.topk)
                if _never_routed(sample, getattr(sample, field))
                else getattr(sample, field),
                where=f"sample {index} (group {sample.group_id}) {field}",
                routes=route,
                source=source,
            )
            for index, (sample, route) in enumerate(zip(samples, routes))
        ]

    @contextmanager
    def old_policy_pass(
        self,
        samples: Sequence[TrainSample],
        micro_batches: Sequence[MicroBatch],
        *,
        record: bool,
    ) -> Iterator[Optional[RoutingPass]]:
        """The old-log-prob forward: replays the rollout's routes under R3 (with the engine's
        combine weights when they are replayed), records the native routes when ``record``
        (``RoutingPass.recorded`` once the pass has ended; under R2 with replayed weights also
        their weights, ``RoutingPass.recorded_weights``)."""
        replay = replay_weights = None
        if self.mode == "r3":
            replay = self._validated(
                samples,
                [s.rollout_routes for s in samples],
                "routing_replay=r3 replays the rollout engine's routes: request them "
                "(GenerateRequest.return_routed_experts; SGLang --enable-return-routed-experts)",
            )
            if self.replay_weights:
                replay_weights = self._validated_weights(samples, replay)
        if replay is None and not record:
            yield None
            return
        with RoutingPass(
            self,
            samples,
            micro_batches,
            replay=replay,
            replay_weights=replay_weights,
            record=record,
            # R2 replays the weights this forward gives; R3 the engine's, which need no record.
            record_weights=record and self.replay_weights and self.mode == "r2",
            backward=False,
        ) as routing_pass:
            yield routing_pass

    @contextmanager
    def training_pass(
        self, samples: Sequence[TrainSample], micro_batches: Sequence[MicroBatch], *, backward: bool
    ) -> Iterator[Optional[RoutingPass]]:
        """A training forward (and backward): replays the old policy's routes under R2
        (``TrainSample.old_routes``) and the rollout's under R3 (``rollout_routes``); with
        ``algo.log_routing_change``, measures the routing change against both, where the samples
        carry them (``RoutingPass.metrics``)."""
        old_routes = [s.old_routes for s in samples]
        rollout_routes = [s.rollout_routes for s in samples]
        replay = None
        if self.mode == "r2":
            replay = self._validated(
                samples,
                old_routes,
                "routing_replay=r2 replays the routes recorded by "
                "forward_log_probs(record_routes=True) (TrainSample.old_routes)",
            )
        elif self.mode == "r3":
            replay = self._validated(
                samples, rollout_routes, "routing_replay=r3 replays the rollout's routes"
            )
        replay_weights = None
        if replay is not None and self.replay_weights:
            replay_weights = self._validated_weights(samples, replay)
        old = rollout = None
        if self.measure:
            if self.mode == "r2":
                old = replay
            elif all(routes is not None for routes in old_routes):
                old = self._validated(samples, old_routes, "old-policy routes")
            if self.mode == "r3":
                rollout = replay
            elif all(routes is not None for routes in rollout_routes):
                rollout = self._validated(samples, rollout_routes, "rollout routes")
        if replay is None and old is None and rollout is None:
            yield None
            return
        with RoutingPass(
            self,
            samples,
            micro_batches,
            replay=replay,
            replay_weights=replay_weights,
            old=old,
            rollout=rollout,
            backward=backward,
        ) as routing_pass:
            yield routing_pass


class RoutingPass:
    """One schedule's forwards (and backwards) over the policy routers: ``before_forward`` /
    ``after_forward`` bracket each chunk forward of each micro-batch; leaving the ``with`` block
    checks consumption, gathers what was recorded (collective: every rank) and resets the
    routers (also on error)."""

    def __init__(
        self,
        routing: PolicyRouting,
        samples: Sequence[TrainSample],
        micro_batches: Sequence[MicroBatch],
        *,
        replay: Optional[Sequence[torch.Tensor]] = None,
        replay_weights: Optional[Sequence[torch.Tensor]] = None,
        old: Optional[Sequence[torch.Tensor]] = None,
        rollout: Optional[Sequence[torch.Tensor]] = None,
        record: bool = False,
        record_weights: bool = False,
        backward: bool,
    ):
        self.routing = routing
        self.replay = replay is not None
        self.replayed_weights = replay_weights is not None
        self.record = record
        self.record_weights = record_weights
        self.compare_old = old is not None
        self.compare_rollout = rollout is not None
        # Full activation recompute re-runs each layer in the backward: it must replay the same
        # routes (FIFO per router), so they stay queued until then.
        self.recompute_in_backward = backward and routing.recompute and self.replay
        parallel = routing.parallel
        self.device = parallel.device
        self.row_offsets = _row_offsets(samples)
        self.samples = samples
        num_layers = len(routing.moe_layers)

        def flat(routes):
            return None if routes is None else torch.cat([r.to(torch.int32) for r in routes])

        old_flat, rollout_flat = flat(old), flat(rollout)
        for micro_batch in micro_batches:
            micro_batch.routes = micro_batch_routes(
                micro_batch,
                samples,
                self.row_offsets,
                replay=replay,
                old=old_flat,
                rollout=rollout_flat,
                num_moe_layers=num_layers,
                topk=routing.topk,
                num_experts=routing.num_experts,
                tp_group=parallel.tp_group,
                replay_weights=replay_weights,
            )
        self.recorded: Optional[list[torch.Tensor]] = None
        self.recorded_weights: Optional[list[torch.Tensor]] = None
        self._weight_buffer = None
        if record_weights:
            # One writer per entry (as the ids): the world sum below is an exact gather.
            self._weight_buffer = torch.zeros(
                (self.row_offsets[-1], num_layers, routing.topk), dtype=torch.float32
            )
        self.metrics: dict[str, float] = {}
        self._buffer = None
        if record:
            # Expert id + 1, so that a (position, layer) nobody wrote reads 0 after the sum.
            dtype = torch.uint8 if routing.num_experts < 256 else torch.int32
            self._buffer = torch.zeros(
                (self.row_offsets[-1], num_layers, routing.topk), dtype=dtype
            )
        # Rows: native vs old, native vs rollout, loss pairs, used (replayed or native) vs rollout.
        self._counts = torch.zeros((4, num_layers), dtype=torch.float64, device=self.device)

    # -- per forward ------------------------------------------------------------------------

    def _routers(self, chunk: torch.nn.Module) -> list[PolicyRouterReplay]:
        return self.routing.routers[id(unwrap(chunk))]

    def before_forward(self, chunk: torch.nn.Module, micro_batch: MicroBatch) -> None:
        routes = micro_batch.routes
        for replay in self._routers(chunk):
            replay.forward_uses = 0
            replay.native_topk_idx = None
            replay.record_native = self.record or self.compare_old or self.compare_rollout
            if self.replay:
                target = routes.replay[:, replay.moe_index].to(self.device, torch.long)
                replay.set_target_indices(target)
                if self.replayed_weights:
                    weights = routes.replay_weights[:, replay.moe_index].to(self.device)
                    replay.set_target_probs(weights)
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif replay.record_native:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                replay.clear_router_replay_action()

    def after_forward(self, chunk: torch.nn.Module, micro_batch: MicroBatch) -> None:
        routes = micro_batch.routes
        for replay in self._routers(chunk):
            where = f"decoder layer {replay.layer_number - 1}"
            if self.replay and replay.forward_uses != 1:
                raise RoutingReplayError(
                    f"{where} did not consume its replayed routes in this forward (a router "
                    "path that bypasses RouterReplay, e.g. moe_router_fusion or sinkhorn?)"
                )
            native = replay.native_topk_idx
            if replay.record_native and native is None:
                raise RoutingReplayError(f"{where} did not route in this forward")
            if self.record:
                real = routes.rows >= 0
                self._buffer[routes.rows[real], replay.moe_index] = (
                    native[real.to(native.device)].to("cpu", self._buffer.dtype) + 1
                )
            if self.record_weights:
                real = routes.rows >= 0
                weights = replay.native_topk_probs
                if weights is None:
                    raise RoutingReplayError(f"{where} recorded no combine weights")
                self._weight_buffer[routes.rows[real], replay.moe_index] = weights[
                    real.to(weights.device)
                ].to("cpu", torch.float32)
            if self.compare_old or self.compare_rollout:
                chosen = native[routes.compare_tokens.to(native.device)]
                m = replay.moe_index
                if self.compare_old:
                    changed = topk_sets_differ(chosen, routes.old[:, m])
                    self._counts[0, m] += changed.sum().to(self._counts)
                if self.compare_rollout:
                    changed = topk_sets_differ(chosen, routes.rollout[:, m])
                    self._counts[1, m] += changed.sum().to(self._counts)
                    used = replay.used_topk_idx[routes.compare_tokens.to(native.device)]
                    differs = topk_sets_differ(used, routes.rollout[:, m])
                    self._counts[3, m] += differs.sum().to(self._counts)
                self._counts[2, m] += chosen.shape[0]
            replay.native_topk_idx = replay.recorded_topk_idx = replay.target_topk_idx = None
            replay.used_topk_idx = replay.native_topk_probs = replay.target_topk_probs = None
            replay.record_native = False
            if self.recompute_in_backward:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            else:
                replay.clear_router_replay_action()
                replay.replay_backward_list.clear()
                replay.replay_backward_probs.clear()

    # -- end of the schedule ---------------------------------------------------------------

    def __enter__(self) -> RoutingPass:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            for replay in self.routing.all_routers:
                replay.reset()

    def _finish(self) -> None:
        for replay in self.routing.all_routers:
            if replay.replay_backward_list or replay.replay_backward_probs:
                raise RoutingReplayError(
                    f"decoder layer {replay.layer_number - 1}: "
                    f"{len(replay.replay_backward_list)} replayed route sets were not consumed by "
                    "the backward recomputation"
                )
        world = self.routing.parallel.world_group
        if self.compare_old or self.compare_rollout:
            # Each (token, layer) pair lives on exactly one rank (tp/cp/dp split tokens, pp
            # layers), so a world sum counts every pair once.
            dist.all_reduce(self._counts, group=world)
            self.metrics = self._change_metrics(self._counts.cpu())
        if self.record:
            self.recorded = self._gather_recorded(world)
        if self.record_weights:
            self.recorded_weights = self._gather_weights(world)
        if self.replay:
            # Which weights the replayed routes were combined with (docs/glm4-moe.md).
            self.metrics["routing_replay_weights_replayed"] = float(self.replayed_weights)

    def _change_metrics(self, counts: torch.Tensor) -> dict[str, float]:
        metrics = {}
        total = counts[2]
        if float(total.sum()) == 0:
            return metrics
        for row, name in (
            (0, "routing_change_frac"),
            (1, "routing_change_frac_vs_rollout"),
            (3, "routing_mismatch_vs_rollout"),
        ):
            if (row == 0 and not self.compare_old) or (row != 0 and not self.compare_rollout):
                continue
            metrics[name] = float(counts[row].sum() / total.sum())
            for m, layer in enumerate(self.routing.moe_layers):
                if total[m] > 0:
                    metrics[f"{name}/layer_{layer}"] = float(counts[row, m] / total[m])
        return metrics

    def _gather_weights(self, world: dist.ProcessGroup) -> list[torch.Tensor]:
        """The recorded combine weights, summed over the world like the ids, per sample."""
        flat = self._weight_buffer.view(-1)
        for start in range(0, flat.numel(), _TRANSPORT_CHUNK):
            part = flat[start : start + _TRANSPORT_CHUNK].to(self.device)
            dist.all_reduce(part, group=world)
            flat[start : start + _TRANSPORT_CHUNK] = part.cpu()
        return [
            self._weight_buffer[self.row_offsets[i] : self.row_offsets[i + 1]].clone()
            for i in range(len(self.samples))
        ]

    def _gather_recorded(self, world: dist.ProcessGroup) -> list[torch.Tensor]:
        """Every rank's recorded ids summed over the world (each entry written by one rank,
        others 0), split per sample, checked and stored compactly on CPU."""
        flat = self._buffer.view(-1)
        for start in range(0, flat.numel(), _TRANSPORT_CHUNK):
            part = flat[start : start + _TRANSPORT_CHUNK].to(self.device)
            dist.all_reduce(part, group=world)
            flat[start : start + _TRANSPORT_CHUNK] = part.cpu()
        routing = self.routing
        if self._buffer.numel() and int(self._buffer.min()) == 0:
            row = int((self._buffer == 0).any(-1).any(-1).nonzero()[0])
            raise RoutingReplayError(
                f"recorded routes are incomplete: flat row {row} has a layer no rank recorded "
                "(a layer did not run, or the token layout differs between ranks)"
            )
        everything = (self._buffer.long() - 1).to(route_dtype(routing.num_experts))
        # A copy per sample: a view would keep (and pickle) the whole batch's buffer.
        recorded = [
            everything[self.row_offsets[index] : self.row_offsets[index + 1]].clone()
            for index in range(len(self.samples))
        ]
        return check_routes_of_samples(
            recorded,
            wheres=[f"sample {index} (group {s.group_id})" for index, s in enumerate(self.samples)],
            num_positions=[routes.shape[0] for routes in recorded],
            num_moe_layers=len(routing.moe_layers),
            topk=routing.topk,
            num_experts=routing.num_experts,
            source="recorded by the training engine",
        )


def _never_routed(sample: TrainSample, recorded: Optional[torch.Tensor]) -> bool:
    """A sample without recorded routes (or route weights) and without a token in the loss: an
    episode aborted before the engine ran any of it, whose rows replay nothing that matters."""
    return recorded is None and not bool(sample.loss_mask.any())
