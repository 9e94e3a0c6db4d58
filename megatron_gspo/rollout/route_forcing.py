"""Forcing a transformers MoE model's routers to given experts (routing replay inside an engine).

A :class:`RouteForcer` holds a forward hook on every MoE layer's ``mlp.gate``. While it is
armed with routes (``[tokens, K]`` expert ids per MoE layer), each router's output
``(router_logits, top_k_weights, top_k_indices)`` is replaced: the indices by the forced ones,
the weights recomputed from the router's own logits over the forced ids, by the router's own
rule, as Megatron's routing replay recomputes them (the replayed ids, this model's scores). The
router still computes its logits in the model's dtype: only the choice is taken from elsewhere.

The rules, one per transformers 5.23 router class (read from their ``forward``):

* ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``: softmax in float32 over all experts, the
  forced experts' probabilities, renormalised when ``norm_topk_prob``, cast to the logits' dtype;
* ``MixtralTopKRouter``: the same, always renormalised, left in float32;
* ``Glm4MoeTopkRouter``, ``DeepseekV3TopkRouter``: sigmoid scores (of float32 logits), the
  forced experts' scores, renormalised (``+ 1e-20``) when ``norm_topk_prob``, times
  ``routed_scaling_factor``. The correction bias and the expert groups only select experts;
  they never enter the weights, so a forced choice needs neither (the experts that chose it
  obeyed them).

Forcing a router's own choice gives its own output bit for bit (the same operations on the same
values; tests/rollout/test_route_twin.py checks it on every architecture), so forcing is exact. A
router class not listed is refused when the forcer is built: its rule is unknown, and a guessed
one would silently change the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch

from megatron_gspo.rollout.hf_model import decoder_layers, moe_layer_indices


def _softmax_weights(gate: Any, router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``Qwen3MoeTopKRouter`` and ``Qwen2MoeTopKRouter``."""
    probabilities = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights = probabilities.gather(1, ids)
    if gate.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def _mixtral_weights(gate: Any, router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``MixtralTopKRouter``: always renormalised, the weights stay float32."""
    probabilities = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    weights = probabilities.gather(1, ids)
    weights /= weights.sum(dim=-1, keepdim=True)
    return weights


def _sigmoid_weights(gate: Any, router_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``Glm4MoeTopkRouter`` and ``DeepseekV3TopkRouter`` (their logits are float32)."""
    weights = router_logits.sigmoid().gather(1, ids)
    if gate.norm_topk_prob:
        denominator = weights.sum(dim=-1, keepdim=True) + 1e-20
        weights /= denominator
    return weights * gate.routed_scaling_factor


WEIGHT_RULES: dict[str, Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Qwen3MoeTopKRouter": _softmax_weights,
    "Qwen2MoeTopKRouter": _softmax_weights,
    "MixtralTopKRouter": _mixtral_weights,
    "Glm4MoeTopkRouter": _sigmoid_weights,
    "DeepseekV3TopkRouter": _sigmoid_weights,
}
"""Router class name -> its top-k weights over given expert ids (see the module docstring)."""


class RouteForcer:
    """Forces the routers of ``hf_model`` to the experts given to :meth:`forcing`.

    The hooks run before any other hook of the gates (a :class:`RouteRecorder` then records the
    forced ids). Outside :meth:`forcing` the routers choose for themselves. Callers serialise
    forwards (the embedded engine's model lock): the armed routes belong to one forward.

    Raises ``ValueError`` for a model without MoE layers or with a router whose weight rule is
    not in :data:`WEIGHT_RULES`.
    """

    def __init__(self, hf_model: Any):
        self.layer_indices = moe_layer_indices(hf_model)
        if not self.layer_indices:
            raise ValueError(
                f"route forcing: {type(hf_model).__name__} has no MoE layer, so there are no "
                "routes to force; use it on a Mixture-of-Experts model"
            )
        layers = decoder_layers(hf_model)
        self._gates = [layers[index].mlp.gate for index in self.layer_indices]
        unknown = sorted({type(g).__name__ for g in self._gates} - set(WEIGHT_RULES))
        if unknown:
            raise ValueError(
                f"route forcing: router {', '.join(unknown)} has no known weight rule (known: "
                f"{', '.join(WEIGHT_RULES)}); forcing it would guess how its weights are "
                "computed. Add its rule to megatron_gspo/rollout/route_forcing.py, checked "
                "against its own choice bit for bit (tests/rollout/test_route_twin.py)"
            )
        self._forced: Optional[list[torch.Tensor]] = None
        self._handles = [
            gate.register_forward_hook(self._hook(slot), prepend=True)
            for slot, gate in enumerate(self._gates)
        ]

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def forcing(self, routes: Optional[Sequence[torch.Tensor]]) -> Iterator[None]:
        """Force ``routes`` (per MoE layer, ``[..., K]`` ids of the next forward's tokens in
        their row-major order, e.g. a :class:`RouteRecorder`'s ``[B, S, K]``) in the forward
        run inside; ``None`` forces nothing."""
        if routes is not None and len(routes) != len(self._gates):
            raise ValueError(
                f"route forcing: {len(routes)} layers of routes for {len(self._gates)} MoE layers"
            )
        self._forced = (
            None if routes is None else [r.reshape(-1, r.shape[-1]).long() for r in routes]
        )
        try:
            yield
        finally:
            self._forced = None

    def _hook(self, slot: int):
        def force(module: Any, inputs: Any, output: Any) -> Optional[tuple]:
            if self._forced is None:
                return None
            router_logits, _, own_ids = output
            ids = self._forced[slot]
            if ids.shape != own_ids.shape:
                raise RuntimeError(
                    f"route forcing: MoE layer {self.layer_indices[slot]} routes "
                    f"{tuple(own_ids.shape)} (tokens, top-k) ids, the forced ones are "
                    f"{tuple(ids.shape)}"
                )
            weights = WEIGHT_RULES[type(module).__name__](module, router_logits, ids)
            return router_logits, weights, ids

        return force
