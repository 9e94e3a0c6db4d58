"""The route format shared by the rollout and the training engine (``megatron_gspo/samples/routes.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.rollout import GenerateResult
from megatron_gspo.samples.routes import (
    RouteError,
    balanced_pad_routes,
    check_route_weights,
    check_routes,
    check_routes_of_samples,
    route_dtype,
    route_numpy_dtype,
    route_shape_problem,
    topk_sets_differ,
)


def test_balanced_pad_routes_are_distinct_and_spread_evenly():
    for topk, experts in ((2, 8), (8, 128), (3, 7), (8, 8)):
        pad = balanced_pad_routes(torch.arange(1000), topk, experts)
        assert pad.shape == (1000, topk)
        assert not topk_sets_differ(pad.sort(-1).values, pad).any()
        assert all(len(set(row)) == topk for row in pad.tolist())  # no duplicate in a row
        counts = torch.bincount(pad.view(-1), minlength=experts)
        assert int(counts.max() - counts.min()) <= topk, counts  # no hot expert


def test_topk_sets_differ_ignores_column_order():
    first = torch.tensor([[1, 2], [3, 4], [0, 5]])
    second = torch.tensor([[2, 1], [3, 5], [5, 0]], dtype=torch.uint8)
    assert topk_sets_differ(first, second).tolist() == [False, True, False]


def test_route_dtype():
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16
    assert route_numpy_dtype(256) == np.uint8 and route_numpy_dtype(257) == np.int16
    for experts in (1, 256, 257, 32768):
        stored = torch.from_numpy(np.zeros(1, dtype=route_numpy_dtype(experts)))
        assert stored.dtype == route_dtype(experts)  # the engines' numpy routes convert exactly
    with pytest.raises(ValueError, match="int16"):
        route_dtype(32769)


def test_check_routes_names_the_problem():
    good = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    kwargs = dict(where="sample 7 (group 1)", num_moe_layers=1, topk=2, num_experts=4, source="x")
    assert check_routes(good, num_positions=2, **kwargs) is good
    cases = [
        (None, 2, "missing"),
        (good, 3, "shape"),
        (good.float(), 2, "integer"),
        (good + 2, 2, "outside"),
        (torch.tensor([[[1, 1]], [[2, 3]]]), 2, "repeat"),
    ]
    for routes, positions, fragment in cases:
        with pytest.raises(RouteError, match=fragment) as error:
            check_routes(routes, num_positions=positions, **kwargs)
        assert "sample 7 (group 1)" in str(error.value)


def test_routes_of_many_samples_are_checked_as_each_one_would_be():
    """The batched check accepts what check_routes accepts and reports what it reports, for the
    first faulty sample (the others well formed), whatever the fault."""
    generator = torch.Generator().manual_seed(0)
    good = [
        torch.stack([torch.randperm(6, generator=generator)[:2] for _ in range(n * 3)])
        .reshape(n, 3, 2)
        .to(torch.uint8)
        for n in (4, 1, 6)
    ]
    kwargs = dict(num_moe_layers=3, topk=2, num_experts=6, source="x")
    wheres = [f"sample {index} (group 9)" for index in range(3)]
    positions = [4, 1, 6]
    checked = check_routes_of_samples(good, wheres=wheres, num_positions=positions, **kwargs)
    assert all(a is b for a, b in zip(checked, good))
    assert check_routes_of_samples([], wheres=[], num_positions=[], **kwargs) == []
    repeated = good[2].clone()
    repeated[5, 1] = torch.tensor([4, 4])
    faults = [
        (None, "missing"),
        (good[2][:5], "shape"),
        (good[2].float(), "integer"),
        (good[2] + 6, "outside"),
        (repeated, "repeat"),
    ]
    for faulty, fragment in faults:
        routes = [good[0], good[1], faulty]
        with pytest.raises(RouteError, match=fragment) as batched:
            check_routes_of_samples(routes, wheres=wheres, num_positions=positions, **kwargs)
        with pytest.raises(RouteError) as alone:
            check_routes(faulty, where=wheres[2], num_positions=6, **kwargs)
        assert str(batched.value) == str(alone.value)
        assert "sample 2 (group 9)" in str(batched.value)


def test_route_shape_rule_is_the_rollout_results():
    """A rollout result's routes follow the same ``[L - 1, M, K]`` rule, M and K free."""
    assert route_shape_problem((4, 3, 2), 4) is None
    assert route_shape_problem((4, 3, 2), 4, num_moe_layers=3, topk=2) is None
    assert "expected [4, 2, 2]" in route_shape_problem((4, 3, 2), 4, num_moe_layers=2, topk=2)
    assert "L - 1" in route_shape_problem((5, 3, 2), 4)
    assert route_shape_problem((4, 3), 4) is not None
    result = dict(
        request_id="r",
        output_ids=[5, 6],
        output_log_probs=None,
        finish_reason="stop",
        prompt_length=3,
        weight_version=0,
    )
    GenerateResult(**result, routed_experts=np.zeros((4, 3, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"expected \[4, M, K\]"):
        GenerateResult(**result, routed_experts=np.zeros((5, 3, 2), dtype=np.uint8))


def test_check_route_weights_names_the_problem():
    """Route weights sit beside their ids: float32, the ids' shape, finite and >= 0."""
    routes = torch.tensor([[[0, 1]], [[2, 3]]], dtype=torch.uint8)
    good = torch.tensor([[[0.75, 0.25]], [[0.5, 0.5]]])
    kwargs = dict(where="sample 7 (group 1)", routes=routes, source="x")
    assert check_route_weights(good, **kwargs) is good
    negative = good.clone()
    negative[1, 0, 1] = -0.5
    cases = [
        (None, "missing"),
        (good[:1], "shape"),
        (good.double(), "float32"),
        (good.bfloat16(), "float32"),
        (good.masked_fill(good > 0.6, float("nan")), "token 0, MoE layer 0"),
        (negative, "token 1, MoE layer 0"),
    ]
    for weights, fragment in cases:
        with pytest.raises(RouteError, match=fragment) as error:
            check_route_weights(weights, **kwargs)
        assert "sample 7 (group 1)" in str(error.value)


def test_rollout_results_route_weights_match_their_ids():
    result = dict(
        request_id="r",
        output_ids=[5, 6],
        output_log_probs=None,
        finish_reason="stop",
        prompt_length=3,
        weight_version=0,
        routed_experts=np.zeros((4, 3, 2), dtype=np.uint8),
    )
    GenerateResult(**result, routed_expert_weights=np.zeros((4, 3, 2), dtype=np.float32))
    for weights in (np.zeros((4, 3, 1), np.float32), np.zeros((4, 3, 2), np.float64)):
        with pytest.raises(ValueError, match="do not match the routed experts"):
            GenerateResult(**result, routed_expert_weights=weights)
    with pytest.raises(ValueError, match="do not match the routed experts"):
        GenerateResult(
            **{**result, "routed_experts": None},
            routed_expert_weights=np.zeros((4, 3, 2), np.float32),
        )
