"""The route format: which experts each token of a sample was routed to (torch and numpy only).

Rollout engines produce routes (R3, ``rollout/``), the training engine records and replays them
(R2 / R3, ``engine/routing_replay.py``); both speak this format, defined here once.

A sample of ``L`` tokens has routes ``[L - 1, M, K]``: row ``t`` holds the experts of token ``t``
as an input (the last token is never run forward, so it has no row), column ``m`` the ``m``-th MoE
layer (dense layers have no column), ``K`` the top-k expert ids, which are *logical* (before any
expert-placement remap) and distinct within a row; their order within a row does not matter (the
combine sums over experts). Ids are stored compactly: uint8 up to 256 experts, int16 above.

Routes stay a per-sample tensor assembled by concatenating rows along the token axis, so routes
that come from several engine calls (segments of a partial rollout, turns of a conversation) join
into the same ``[L - 1, M, K]`` contract.

Route weights (R3 with ``algo.routing_replay_weights=replayed``): beside the ids, float32
``[L - 1, M, K]`` holding, at each id, the combine weight the engine's router gave that expert
(after its renormalisation and scaling: what multiplied the expert's output), in the same order as
the ids. They travel exactly as the ids do (rows joined along the token axis) and are checked
against them by :func:`check_route_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch

_ID_DTYPES = ((256, torch.uint8, np.uint8), (32768, torch.int16, np.int16))
"""(most experts, torch dtype, numpy dtype) of stored expert ids, smallest first."""


class RouteError(ValueError):
    """Routes that break the format: missing, wrong shape or dtype, ids out of range or repeated.
    The message names the sample and where the routes came from."""


def route_dtype(num_experts: int) -> torch.dtype:
    """Storage dtype of expert ids ``0 .. num_experts - 1``: uint8 up to 256 experts, int16
    above."""
    for most, dtype, _ in _ID_DTYPES:
        if num_experts <= most:
            return dtype
    raise ValueError(f"{num_experts} experts do not fit in int16 expert ids")


def route_numpy_dtype(num_experts: int) -> np.dtype:
    """:func:`route_dtype` as a numpy dtype (what rollout engines return)."""
    for most, _, dtype in _ID_DTYPES:
        if num_experts <= most:
            return np.dtype(dtype)
    raise ValueError(f"{num_experts} experts do not fit in int16 expert ids")


def route_shape_problem(
    shape: tuple[int, ...],
    num_positions: int,
    num_moe_layers: Optional[int] = None,
    topk: Optional[int] = None,
) -> Optional[str]:
    """What is wrong with routes of ``shape`` for a sample with ``num_positions = L - 1`` input
    positions (None: nothing). ``num_moe_layers`` / ``topk`` None: any."""
    expected = (
        num_positions,
        "M" if num_moe_layers is None else num_moe_layers,
        "K" if topk is None else topk,
    )
    matches = len(shape) == 3 and all(
        isinstance(want, str) or got == want for got, want in zip(shape, expected)
    )
    if matches:
        return None
    described = ", ".join(str(value) for value in expected)
    return (
        f"routed experts have shape {tuple(shape)}, expected [{described}] (one row per input "
        "token = L - 1, one column per MoE layer, top-k ids)"
    )


def _route_form_problem(
    routes: Optional[torch.Tensor], num_positions: int, num_moe_layers: int, topk: int, source: str
) -> Optional[str]:
    """What is wrong with the form of one sample's routes (present, shape, integer dtype), before
    their ids are looked at; None: nothing."""
    if routes is None:
        return f"routed experts are missing ({source})"
    problem = route_shape_problem(tuple(routes.shape), num_positions, num_moe_layers, topk)
    if problem is not None:
        return f"{problem} ({source})"
    if routes.is_floating_point() or routes.dtype == torch.bool:
        return f"routed experts must be integer ids, got {routes.dtype}"
    return None


def check_routes(
    routes: Optional[torch.Tensor],
    *,
    where: str,
    num_positions: int,
    num_moe_layers: int,
    topk: int,
    num_experts: int,
    source: str,
) -> torch.Tensor:
    """Validate one sample's routes ``[L - 1, M, K]``: integer ids in ``[0, E)``, no duplicate
    expert within a row. Returns them; raises :class:`RouteError` naming ``where`` and
    ``source`` (where the routes should have come from)."""
    problem = _route_form_problem(routes, num_positions, num_moe_layers, topk, source)
    if problem is not None:
        raise RouteError(f"{where}: {problem}")
    if routes.numel() == 0:
        return routes
    low, high = int(routes.min()), int(routes.max())
    if low < 0 or high >= num_experts:
        raise RouteError(
            f"{where}: routed experts hold expert id {low if low < 0 else high}, outside "
            f"[0, num_experts={num_experts}); ids must be logical (before any expert-placement "
            f"remap) ({source})"
        )
    ordered = routes.long().sort(dim=-1).values
    duplicate = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if bool(duplicate.any()):
        token, layer = (int(i) for i in duplicate.nonzero()[0])
        raise RouteError(
            f"{where}: routed experts repeat an expert at token {token}, MoE layer {layer}: "
            f"{routes[token, layer].tolist()}; each token routes to K distinct experts ({source})"
        )
    return routes


def check_routes_of_samples(
    routes: Sequence[Optional[torch.Tensor]],
    *,
    wheres: Sequence[str],
    num_positions: Sequence[int],
    num_moe_layers: int,
    topk: int,
    num_experts: int,
    source: str,
) -> list[torch.Tensor]:
    """:func:`check_routes` of many samples' routes, their ids checked in one pass over all of
    them: a training pass checks every sample of its mini-batch, and one by one the checks'
    small tensor operations took a tenth of the trainer's step at the CPU demo's size
    (benchmarks/README.md, "Asynchronous training overlap"). A problem is reported as
    :func:`check_routes` reports it, for the first faulty sample (``wheres[i]``)."""

    def one_by_one() -> list[torch.Tensor]:
        return [
            check_routes(
                sample_routes,
                where=where,
                num_positions=positions,
                num_moe_layers=num_moe_layers,
                topk=topk,
                num_experts=num_experts,
                source=source,
            )
            for sample_routes, where, positions in zip(routes, wheres, num_positions)
        ]

    if not routes or any(
        _route_form_problem(sample_routes, positions, num_moe_layers, topk, source) is not None
        for sample_routes, positions in zip(routes, num_positions)
    ):
        return one_by_one()  # raises, naming the sample
    # The id rules hold per (token, layer) row: every row of every sample as one sample's rows.
    rows = torch.cat([sample_routes.reshape(-1, 1, topk) for sample_routes in routes])
    try:
        check_routes(
            rows,
            where="all samples",
            num_positions=rows.shape[0],
            num_moe_layers=1,
            topk=topk,
            num_experts=num_experts,
            source=source,
        )
    except RouteError:
        return one_by_one()  # raises, naming the sample
    return list(routes)


ROUTE_WEIGHT_DTYPE = torch.float32
"""Storage dtype of route weights: a bf16 / fp16 engine's weights convert to it exactly."""


def check_route_weights(
    weights: Optional[torch.Tensor],
    *,
    where: str,
    routes: torch.Tensor,
    source: str,
) -> torch.Tensor:
    """Validate one sample's route weights against its (checked) ``routes``: float32, the
    routes' shape ``[L - 1, M, K]``, finite and non-negative (every supported router gives
    softmax or sigmoid weights). Returns them; raises :class:`RouteError` naming ``where`` and
    ``source`` (where the weights should have come from)."""
    if weights is None:
        raise RouteError(f"{where}: route weights are missing ({source})")
    if tuple(weights.shape) != tuple(routes.shape):
        raise RouteError(
            f"{where}: route weights have shape {tuple(weights.shape)}, the routes "
            f"{tuple(routes.shape)}; each expert id has its weight, in the same order ({source})"
        )
    if weights.dtype != ROUTE_WEIGHT_DTYPE:
        raise RouteError(f"{where}: route weights must be float32, got {weights.dtype} ({source})")
    if weights.numel() and not bool((torch.isfinite(weights) & (weights >= 0)).all()):
        bad = (~(torch.isfinite(weights) & (weights >= 0))).nonzero()[0].tolist()
        raise RouteError(
            f"{where}: route weight at token {bad[0]}, MoE layer {bad[1]} is "
            f"{float(weights[bad[0], bad[1], bad[2]])}; combine weights are finite and >= 0 "
            f"({source})"
        )
    return weights


def balanced_pad_routes(positions: torch.Tensor, topk: int, num_experts: int) -> torch.Tensor:
    """``[n, K]`` int64 expert ids for rows without a route (packing padding, filler
    micro-batches): the row at packed position ``p`` gets ``(p K + [0, K)) mod E``, distinct
    within the row (K <= E) and spread evenly over experts (hence over expert-parallel ranks)
    across rows. Never duplicates such as all zeros: they break top-k and pile padding onto one
    expert-parallel rank."""
    steps = torch.arange(topk, dtype=torch.long, device=positions.device)
    return (positions.long().unsqueeze(1) * topk + steps) % num_experts


def topk_sets_differ(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: whether rows of two ``[n, K]`` id tensors hold different SETS of experts
    (top-k column order is irrelevant: the combine sums over experts)."""
    first = first.long().sort(dim=-1).values
    second = second.to(first.device).long().sort(dim=-1).values
    return (first != second).any(dim=-1)
