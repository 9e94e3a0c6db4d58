"""Worker of ``test_routing_replay.py``.

``--checks``: one-process checks, printed as one JSON object ``{check: "ok" | failure text}``.
``--reference DIR``: one-process results of the layout runs. ``--runs mode:layout ...`` (under
torchrun): the same steps in parallel layouts; each rank writes its errors to ``DIR/rank{r}.json``.

What the router really used is read from Megatron's own router output (the ``routing_map`` that
the token dispatcher consumes); the native routing from an independent top-k of the router
logits (``router.gating``), never from the code under test.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from layout_worker import (  # noqa: E402
    make_config,
    make_samples,
    relative_error,
    set_expert_bias,
)
from worker_launch import run_checks  # noqa: E402

from megatron_gspo.engine.parallel import destroy_parallel  # noqa: E402
from megatron_gspo.engine.routing_replay import RoutingReplayError  # noqa: E402
from megatron_gspo.engine.routing_replay import (  # noqa: E402
    check_never_replays as assert_reference_cannot_replay,
)
from megatron_gspo.engine.sharding import gather_full_state  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402
from megatron_gspo.samples import TrainSample  # noqa: E402
from megatron_gspo.samples.routes import RouteError, topk_sets_differ  # noqa: E402

NUM_EXPERTS, TOPK, MOE_LAYERS = 8, 2, 4
MICRO_BATCH_TOKENS = 60
"""Two micro-batches per step in every layout (as in layout_worker)."""


def _config(mode: str, layout: str = "", micro_batch_tokens: int = 10_000, **overrides):
    recompute = "recompute" in layout.split(".")
    layout = ".".join(p for p in layout.split(".") if p != "recompute")
    cfg = make_config("moe", layout, micro_batch_tokens)
    # r2w: R2 replaying the recorded combine weights with the ids (routing_replay_weights).
    cfg.algo.routing_replay = "r2" if mode == "r2w" else mode
    if mode == "r2w":
        cfg.algo.routing_replay_weights = "replayed"
    cfg.model.recompute_activations = recompute
    for path, value in overrides.items():
        section, name = path.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _engine(mode: str, micro_batch_tokens: int = 10_000, **overrides) -> TrainEngine:
    if dist.is_initialized():
        destroy_parallel(destroy_process_group=False)
    return TrainEngine(_config(mode, "", micro_batch_tokens, **overrides))


def random_routes(samples: list[TrainSample], seed: int = 1) -> list[torch.Tensor]:
    """Per sample ``[L - 1, M, K]`` uint8: K distinct experts per row, uniformly random (far from
    the native routing, so misplaced routes change the numbers)."""
    generator = torch.Generator().manual_seed(seed)
    routes = []
    for sample in samples:
        scores = torch.rand(sample.tokens.numel() - 1, MOE_LAYERS, NUM_EXPERTS, generator=generator)
        routes.append(scores.argsort(-1)[..., :TOPK].to(torch.uint8))
    return routes


def _routers(engine: TrainEngine) -> list:
    return [layer.mlp.router for chunk in engine.policy_chunks for layer in chunk.decoder.layers]


@contextmanager
def capture_routing(engine: TrainEngine):
    """Per MoE layer, the list of ``(routing_map [T, E], native ids [T, K])`` of every router
    call: what the dispatcher used, and an independent native top-k of the router logits."""
    calls: dict[int, list] = {m: [] for m in range(MOE_LAYERS)}
    handles = []
    for index, router in enumerate(_routers(engine)):

        def hook(module, inputs, output, index=index):
            with torch.no_grad():
                logits = module.gating(inputs[0]).view(-1, NUM_EXPERTS)
                native = logits.topk(TOPK, dim=-1).indices
            calls[index].append((output[1].detach().clone(), native))

        handles.append(router.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _as_map(ids: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` ids -> ``[T, E]`` bool routing map."""
    return torch.zeros(ids.shape[0], NUM_EXPERTS).scatter(1, ids.long(), 1.0).bool()


def _loss_rows(samples: list[TrainSample]) -> torch.Tensor:
    """Rows of the one-micro-batch packed row (no padding in one process) that predict a loss
    token: position ``P - 1 + j`` of each sample for the unmasked response tokens ``j``."""
    rows, offset = [], 0
    for sample in samples:
        positions = torch.arange(sample.response_length) + sample.prompt_length - 1
        rows.append(offset + positions[sample.response_mask()])
        offset += sample.tokens.numel() - 1
    return torch.cat(rows)


def _perturb_routers(engine: TrainEngine, scale: float = 0.2) -> None:
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for router in _routers(engine):
            noise = torch.randn(router.weight.shape, generator=generator)
            router.weight.add_(scale * noise * router.weight.std())


def _prepare(engine: TrainEngine, samples: list[TrainSample], record: bool = True) -> None:
    """What the old-log-prob stage does: old log-probs and the recorded routes on the samples."""
    old = engine.forward_log_probs(samples, record_routes=record)
    assert (old.routes is not None) == record
    for index, (sample, log_probs) in enumerate(zip(samples, old.log_probs)):
        sample.old_log_probs = log_probs
        if record:
            sample.old_routes = old.routes[index]
        if old.route_weights is not None:
            sample.old_route_weights = old.route_weights[index]


def rollout_samples(requests: list, results: list) -> list[TrainSample]:
    """Train samples of the embedded engine's answers: its log-probs and routes as the rollout's."""
    return [
        TrainSample(
            tokens=torch.tensor(list(request.input_ids) + result.output_ids),
            prompt_length=len(request.input_ids),
            advantages=torch.tensor(1.0),
            rollout_log_probs=torch.from_numpy(result.output_log_probs),
            rollout_routes=torch.from_numpy(result.routed_experts),
        )
        for request, result in zip(requests, results)
    ]


def _expect_error(function, *fragments: str) -> None:
    try:
        function()
    except (RoutingReplayError, RouteError, ValueError) as error:
        text = str(error)
        assert all(f in text for f in fragments), (fragments, text)
    else:
        raise AssertionError(f"no error mentioning {fragments}")


# ---------------------------------------------------------------------------------------------
# One-process checks
# ---------------------------------------------------------------------------------------------


def check_recorded_routes_are_the_routes_used() -> None:
    """R2 records ``[L - 1, M, K]`` uint8 per sample: exactly the experts the routers used."""
    engine = _engine("r2")
    samples = make_samples()
    with capture_routing(engine) as calls:
        _prepare(engine, samples)
    flat = torch.cat([s.old_routes for s in samples])
    for sample in samples:
        routes = sample.old_routes
        assert routes.dtype == torch.uint8, routes.dtype
        assert routes.shape == (sample.tokens.numel() - 1, MOE_LAYERS, TOPK), routes.shape
        assert sample.rollout_routes is None  # R2 records beside, never over, the rollout's
    for m in range(MOE_LAYERS):
        ((used, native),) = calls[m]
        assert torch.equal(used, _as_map(flat[:, m])), m
        assert torch.equal(used, _as_map(native)), m


def check_r2_replays_recorded_routes_after_router_perturbation() -> None:
    """After perturbing every router, R2 training forwards still use the recorded experts, and
    routing_change_frac is the exact share of loss (token, layer) pairs whose native top-k set
    moved (independent top-k of the router logits)."""
    engine = _engine("r2")
    samples = make_samples()
    _prepare(engine, samples)
    unchanged = engine.forward_backward(samples)
    assert unchanged["routing_change_frac"] == 0.0, unchanged["routing_change_frac"]
    assert unchanged["seq_log_ratio_abs_max"] == 0.0
    _perturb_routers(engine)
    with capture_routing(engine) as calls:
        metrics = engine.forward_backward(samples)
    flat = torch.cat([s.old_routes for s in samples])
    rows = _loss_rows(samples)
    changed = 0
    for m in range(MOE_LAYERS):
        ((used, native),) = calls[m]
        assert torch.equal(used, _as_map(flat[:, m])), f"layer {m} did not use the recorded routes"
        moved = topk_sets_differ(native[rows], flat[rows, m])
        changed += int(moved.sum())
        expected = float(moved.double().mean())
        assert abs(metrics[f"routing_change_frac/layer_{m}"] - expected) < 1e-12, (m, expected)
    expected = changed / (rows.numel() * MOE_LAYERS)
    assert expected > 0.05, expected
    assert abs(metrics["routing_change_frac"] - expected) < 1e-12, (metrics, expected)
    assert "routing_change_frac_vs_rollout" not in metrics


def check_without_replay_perturbed_router_changes_routes() -> None:
    """routing_replay=none: the perturbed routers route natively (away from the recorded
    routes) and routing_change_frac sees exactly that share."""
    engine = _engine("none")
    samples = make_samples()
    _prepare(engine, samples)
    assert samples[0].rollout_routes is None
    old = torch.cat([s.old_routes for s in samples])
    _perturb_routers(engine)
    with capture_routing(engine) as calls:
        metrics = engine.forward_backward(samples)
    rows = _loss_rows(samples)
    changed = 0
    for m in range(MOE_LAYERS):
        ((used, native),) = calls[m]
        assert torch.equal(used, _as_map(native)), m
        changed += int(topk_sets_differ(native[rows], old[rows, m]).sum())
    expected = changed / (rows.numel() * MOE_LAYERS)
    assert expected > 0.05, expected
    assert abs(metrics["routing_change_frac"] - expected) < 1e-12, (metrics, expected)


def check_r3_replay_forces_the_given_routes() -> None:
    """R3 with random routes: the old-log-prob and training forwards use exactly those experts;
    the log-probs differ from native routing; the training metrics compare with them."""
    engine = _engine("r3")
    samples = make_samples()
    routes = random_routes(samples)
    for sample, route in zip(samples, routes):
        sample.rollout_routes = route
    with capture_routing(engine) as calls:
        _prepare(engine, samples)
    flat = torch.cat(routes)
    for m in range(MOE_LAYERS):
        ((used, _),) = calls[m]
        assert torch.equal(used, _as_map(flat[:, m])), m
    native = _engine("none").forward_log_probs(samples).log_probs
    gap = max(
        (a - b).abs().max().item() for a, b in zip(native, [s.old_log_probs for s in samples])
    )
    assert gap > 1e-3, gap
    with capture_routing(engine) as calls:
        metrics = engine.forward_backward(samples)
    for m in range(MOE_LAYERS):
        ((used, _),) = calls[m]
        assert torch.equal(used, _as_map(flat[:, m])), m
    assert metrics["seq_log_ratio_abs_max"] == 0.0
    assert metrics["routing_change_frac"] == 0.0  # same weights: same native routes as the old
    assert metrics["routing_change_frac_vs_rollout"] > 0.5, metrics  # random vs native


def check_r3_log_probs_match_the_embedded_engine() -> None:
    """Embedded engine with the trainer's weights (iter_hf_weights): under R3 the trainer's
    recomputed log-probs equal the engine's to fp32 tolerance, and the trainer's native routes
    agree with the rollout's."""
    engine = _engine("r3", model__init_std=0.2)
    rollout = _embedded_engine_with_trainer_weights(engine)
    samples = _recomputed_r3_samples(engine, rollout, count=6)
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] == 0.0
    assert metrics["routing_change_frac"] == 0.0
    assert metrics["routing_change_frac_vs_rollout"] < 0.01


def check_bf16_engine_gap_r3_below_r2() -> None:
    """A bfloat16 embedded engine (``rollout.dtype``) loaded with the trainer's weights samples
    with its own routes. R3 replays them in the old-log-prob forward, R2 routes natively there:
    the trainer-vs-engine log-prob gap is smaller under R3, and the experts the training forward
    uses differ from the engine's on no (loss token, layer) pair under R3 but on some under R2."""
    from megatron_gspo.engine.hf_import_export import iter_hf_weights
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.rollout.types import GenerateRequest

    results = {}
    for mode in ("r3", "r2"):
        engine = _engine(mode, model__init_std=0.2)
        cfg = engine.cfg
        if mode == "r3":  # the same seed gives both trainers the same weights: sample once
            rollout = EmbeddedEngine(cfg.model, seed=0, dtype=torch.bfloat16)
            rollout.sync_weights(iter_hf_weights(engine.policy_chunks, cfg), version=1)
            requests = [
                GenerateRequest(
                    input_ids=[(7 * i + 3 * j) % 60 + 1 for j in range(3 + i)],
                    max_new_tokens=16,
                    temperature=cfg.rollout.temperature,
                    seed=200 + i,
                    return_routed_experts=True,
                )
                for i in range(8)
            ]
            results_of_engine = rollout.generate(requests)
            rollout.close()
        samples = rollout_samples(requests, results_of_engine)
        _prepare(engine, samples)
        gap = torch.cat([(s.old_log_probs - s.rollout_log_probs).abs() for s in samples])
        metrics = engine.forward_backward(samples)
        results[mode] = (float(gap.mean()), metrics)
    (gap_r3, metrics_r3), (gap_r2, metrics_r2) = results["r3"], results["r2"]
    assert gap_r3 < gap_r2, (gap_r3, gap_r2)
    assert metrics_r3["routing_mismatch_vs_rollout"] == 0.0, metrics_r3
    for layer in range(MOE_LAYERS):
        assert metrics_r3[f"routing_mismatch_vs_rollout/layer_{layer}"] == 0.0
    assert metrics_r2["routing_mismatch_vs_rollout"] > 0.0, metrics_r2
    # R2 replays the trainer's own routes: only the comparison with the engine's shows them.
    assert metrics_r2["routing_change_frac"] == 0.0


def check_activation_recompute_replays_in_backward() -> None:
    """Full recompute: the backward recomputation replays the same micro-batch's routes (FIFO),
    so gradients equal those without recompute; native routing would differ."""
    samples = make_samples()
    for sample, route in zip(samples, random_routes(samples)):
        sample.rollout_routes = route
    grads = {}
    for name, mode, recompute in (
        ("plain", "r3", False),
        ("recompute", "r3", True),
        ("native", "none", True),
    ):
        engine = _engine(mode, MICRO_BATCH_TOKENS, model__recompute_activations=recompute)
        metrics = engine.forward_backward(samples)
        assert metrics["num_micro_batches"] == 2.0
        grads[name] = gather_full_state(engine.model, grads=True)
        for replay in engine.routing.all_routers:
            assert not replay.replay_backward_list and replay.router_replay_action is None
    same = max(relative_error(grads["recompute"][n], grads["plain"][n]) for n in grads["plain"])
    assert same < 1e-6, same
    router = "decoder.layers.0.mlp.router.weight"
    native = relative_error(grads["native"][router], grads["plain"][router])
    assert native > 1e-2, native


def check_reference_forward_never_replays() -> None:
    """The KL reference model has no RouterReplay; its forward routes natively even while the
    policy replays; Megatron's registry holds only the policy's instances."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    engine = _engine("r3", algo__use_kl_loss=True)
    registry = RouterReplay.global_router_replay_instances
    assert [id(r) for r in registry] == [id(r) for r in engine.routing.all_routers]
    assert_reference_cannot_replay(engine.reference_model)
    _expect_error(lambda: assert_reference_cannot_replay(engine.policy_chunks), "reference model")
    samples = make_samples()
    for sample, route in zip(samples, random_routes(samples)):
        sample.rollout_routes = route
    reference = engine.forward_log_probs(samples, reference=True).log_probs
    replayed = engine.forward_log_probs(samples).log_probs
    native = _engine("none").forward_log_probs(samples).log_probs
    assert all(torch.equal(a, b) for a, b in zip(reference, native))
    assert any(not torch.equal(a, b) for a, b in zip(reference, replayed))
    _expect_error(
        lambda: engine.forward_log_probs(samples, reference=True, record_routes=True),
        "record_routes",
    )


def check_missing_or_malformed_routes_are_rejected() -> None:
    engine = _engine("r3")
    samples = make_samples()
    routes = random_routes(samples)

    def attempt(index: int, value) -> None:
        for sample, route in zip(samples, routes):
            sample.rollout_routes = route
        samples[index].rollout_routes = value
        engine.forward_log_probs(samples)

    _expect_error(lambda: attempt(3, None), "sample 3", "missing", "return_routed_experts")
    longer = torch.cat([routes[2], routes[2][:1]])
    _expect_error(lambda: attempt(2, longer), "sample 2", "shape", "L - 1")
    out_of_range = routes[4].clone()
    out_of_range[1, 2, 0] = NUM_EXPERTS
    _expect_error(lambda: attempt(4, out_of_range), "sample 4", "outside")
    duplicate = routes[5].clone()
    duplicate[0, 1] = duplicate[0, 1, 0]
    _expect_error(lambda: attempt(5, duplicate), "sample 5", "repeat", "token 0, MoE layer 1")
    for replay in engine.routing.all_routers:
        assert replay.router_replay_action is None and replay.target_topk_idx is None
    attempt(0, routes[0])  # everything valid again: works
    r2 = _engine("r2")
    samples = make_samples()
    _expect_error(lambda: r2.forward_backward(samples), "sample 0", "missing", "record_routes")


def check_routes_not_consumed_exactly_once_raise() -> None:
    """A layer that did not route, routed twice, or left routes for a backward recomputation that
    never came: each raises, and the routers are reset afterwards."""
    engine = _engine("r3", model__recompute_activations=True)
    samples = make_samples()
    for sample, route in zip(samples, random_routes(samples)):
        sample.rollout_routes = route

    def micro_batches():
        return engine._micro_batches(samples, with_loss_inputs=False)[1]

    chunk = engine.model[0]
    router = engine.policy_chunks[0].decoder.layers[1].mlp.router

    def not_consumed():
        batch = micro_batches()
        with engine.routing.old_policy_pass(samples, batch, record=False) as routing:
            routing.before_forward(chunk, batch[0])
            routing.after_forward(chunk, batch[0])

    _expect_error(not_consumed, "decoder layer 0", "did not consume")

    def twice():
        batch = micro_batches()
        hidden = torch.randn(batch[0].packed.num_tokens, 1, 64)
        with engine.routing.old_policy_pass(samples, batch, record=False) as routing:
            routing.before_forward(chunk, batch[0])
            router(hidden)
            router(hidden)

    _expect_error(twice, "decoder layer 1", "routed twice")

    def backward_never_ran():
        batch = micro_batches()
        with (
            engine.routing.training_pass(samples, batch, backward=True) as routing,
            torch.no_grad(),
        ):
            engine._run_schedule(
                engine.model,
                batch,
                lambda micro_batch, hidden: (hidden.sum() * 0.0, {}),
                forward_only=True,
                routing=routing,
            )

    _expect_error(backward_never_ran, "not consumed by the backward recomputation")

    def recompute_without_routes():
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        try:
            router(torch.randn(5, 1, 64))
        finally:
            router.router_replay.reset()

    _expect_error(recompute_without_routes, "decoder layer 1", "no replayed routes left")
    for replay in engine.routing.all_routers:
        assert replay.router_replay_action is None and not replay.replay_backward_list
    metrics = engine.forward_backward(samples)  # and the engine still trains
    assert metrics["seq_log_ratio_abs_max"] >= 0.0


# ---------------------------------------------------------------------------------------------
# GLM-4.5: group-limited sigmoid routing with a correction bias, both weight modes of R2
# ---------------------------------------------------------------------------------------------

GLM4_ROUTER = "decoder.layers.1.mlp.router.weight"


def _glm4_engine(weights: str, mode: str = "r2") -> TrainEngine:
    """The layout test's GLM-4.5 case (layer 1 routes: 8 experts in 2 groups, top-1 group,
    top-2 scaled by 2.5) with its non-zero correction bias."""
    if dist.is_initialized():
        destroy_parallel(destroy_process_group=False)
    cfg = make_config("glm4", "", 10_000)
    cfg.algo.routing_replay = mode
    cfg.algo.routing_replay_weights = weights
    engine = TrainEngine(cfg)
    set_expert_bias(engine)
    return engine


def _glm4_router(engine: TrainEngine):
    return engine.policy_chunks[0].decoder.layers[1].mlp.router


@contextmanager
def _router_inputs(engine: TrainEngine):
    """The hidden states each call of the GLM-4.5 router sees (one micro-batch, no padding)."""
    inputs = []
    handle = _glm4_router(engine).register_forward_hook(
        lambda module, args, output: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))
    )
    try:
        yield inputs
    finally:
        handle.remove()


def glm4_reference(hidden: torch.Tensor, router) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 GLM-4.5 routing from its definition (docs/glm4-moe.md, "Routing"): sorted ids
    ``[T, 2]`` and their combine weights."""
    scores = torch.sigmoid(hidden.double() @ router.weight.double().T)
    choice = scores + router.expert_bias.double()
    tokens, experts = choice.shape
    groups = choice.view(tokens, 2, experts // 2).topk(2, dim=-1).values.sum(-1)
    allowed = torch.zeros(tokens, 2, dtype=torch.bool)
    allowed.scatter_(1, groups.topk(1, dim=-1).indices, True)
    masked = choice.masked_fill(~allowed.repeat_interleave(experts // 2, dim=1), float("-inf"))
    ids = masked.topk(2, dim=-1).indices.sort(-1).values
    weights = scores.gather(1, ids)
    return ids, weights / weights.sum(-1, keepdim=True) * 2.5


def _by_sorted_ids(ids: torch.Tensor, weights: torch.Tensor):
    order = ids.long().argsort(-1)
    return ids.long().gather(1, order), weights.double().gather(1, order)


def _perturb_glm4(engine: TrainEngine, *, router: bool, bias: bool) -> None:
    generator = torch.Generator().manual_seed(5)
    module = _glm4_router(engine)
    with torch.no_grad():
        if router:
            noise = torch.randn(module.weight.shape, generator=generator)
            module.weight.add_(0.5 * noise * module.weight.std())
        if bias:
            module.expert_bias.copy_(
                0.05 * torch.randn(module.expert_bias.shape, generator=generator)
            )


def check_glm4_r2_replayed_weights_reproduce_the_old_forward() -> None:
    """routing_replay_weights=replayed: the old-log-prob forward records, beside each token's
    experts, the combine weights it gave them; both equal a float64 evaluation of GLM-4.5's
    routing (biased group-limited selection; weights from the unbiased sigmoid, renormalised,
    scaled). After perturbing the router and the bias, R2 replays ids and weights: the training
    forward computes the old log-probs bit for bit (ratio exactly 1), the router gets no gradient
    from the loss, and the metrics say the weights were replayed."""
    engine = _glm4_engine("replayed")
    samples = make_samples()
    with _router_inputs(engine) as inputs:
        _prepare(engine, samples)
    ((hidden,),) = [inputs]
    ids, weights = glm4_reference(hidden, _glm4_router(engine))
    recorded_ids = torch.cat([s.old_routes[:, 0] for s in samples])
    recorded = torch.cat([s.old_route_weights[:, 0] for s in samples])
    recorded_ids, recorded = _by_sorted_ids(recorded_ids, recorded)
    assert torch.equal(recorded_ids, ids), "recorded experts differ from the float64 routing"
    error = (recorded - weights).abs().max().item()
    assert error < 1e-6, error
    _perturb_glm4(engine, router=True, bias=True)
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] == 0.0, metrics["seq_log_ratio_abs_max"]
    assert metrics["routing_replay_weights_replayed"] == 1.0
    assert metrics["routing_change_frac"] > 0.05, metrics["routing_change_frac"]
    grads = gather_full_state(engine.model, grads=True)
    assert float(grads[GLM4_ROUTER].abs().max()) == 0.0


def check_glm4_r2_recomputed_weights_follow_the_router_not_the_bias() -> None:
    """routing_replay_weights=recompute (the default): R2 replays the ids and takes their
    weights from the current router. Moving only the correction bias, which selects experts but
    never weighs them, leaves the replayed forward bit for bit unchanged, while routing natively
    it changes the experts and the log-probs; moving the router changes the replayed forward's
    weights (ratio != 1) and the router gets a gradient."""
    engine = _glm4_engine("recompute")
    samples = make_samples()
    _prepare(engine, samples)
    assert samples[0].old_route_weights is None  # nothing recorded that nobody replays
    _perturb_glm4(engine, router=False, bias=True)
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] == 0.0, metrics["seq_log_ratio_abs_max"]
    assert metrics["routing_replay_weights_replayed"] == 0.0
    assert metrics["routing_change_frac"] > 0.05, metrics["routing_change_frac"]
    native = engine.forward_log_probs(samples, record_routes=True)
    moved = torch.cat(
        [topk_sets_differ(n, s.old_routes).view(-1) for n, s in zip(native.routes, samples)]
    )
    assert moved.any()
    gap = max((a - s.old_log_probs).abs().max().item() for a, s in zip(native.log_probs, samples))
    assert gap > 1e-6, gap
    _perturb_glm4(engine, router=True, bias=False)
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] > 1e-6, metrics["seq_log_ratio_abs_max"]
    grads = gather_full_state(engine.model, grads=True)
    assert float(grads[GLM4_ROUTER].abs().max()) > 0.0


def check_glm4_r3_log_probs_match_the_embedded_engine() -> None:
    """GLM-4.5 end to end in one process: the embedded engine, loaded with the trainer's weights
    and correction bias (iter_hf_weights), samples with routes; R3 replays them and the
    trainer's recomputed log-probs equal the engine's to fp32 tolerance, the training forward's
    ratio is exactly 1 and it used the engine's experts everywhere."""
    engine = _glm4_engine("recompute", mode="r3")
    rollout = _embedded_engine_with_trainer_weights(engine)
    bias = rollout.hf_model.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, _glm4_router(engine).expert_bias) and bias.abs().max() > 0
    samples = _recomputed_r3_samples(engine, rollout, count=4)
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] == 0.0
    assert metrics["routing_mismatch_vs_rollout"] == 0.0
    assert metrics["routing_replay_weights_replayed"] == 0.0


def _embedded_engine_with_trainer_weights(engine):
    """An embedded rollout engine loaded with ``engine``'s weights, as a weight sync loads them
    (iter_hf_weights)."""
    from megatron_gspo.engine.hf_import_export import iter_hf_weights
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    rollout = EmbeddedEngine(engine.cfg.model, seed=0)
    rollout.sync_weights(iter_hf_weights(engine.policy_chunks, engine.cfg), version=1)
    return rollout


def _recomputed_r3_samples(engine, rollout, count: int) -> list:
    """``count`` samples of ``rollout`` (closed afterwards) with their routes, their old log-probs
    recomputed by ``engine`` under R3: equal to the engine's to fp32 tolerance, and the trainer's
    native routes agree with the rollout's (fewer than 1% of top-k sets differ)."""
    from megatron_gspo.rollout.types import GenerateRequest

    requests = [
        GenerateRequest(
            input_ids=[(5 * i + 3 * j) % 60 + 1 for j in range(2 + i)],
            max_new_tokens=6 + i,
            temperature=engine.cfg.rollout.temperature,
            seed=100 + i,
            return_routed_experts=True,
        )
        for i in range(count)
    ]
    samples = rollout_samples(requests, rollout.generate(requests))
    rollout.close()
    _prepare(engine, samples)
    gap = max((s.old_log_probs - s.rollout_log_probs).abs().max().item() for s in samples)
    assert gap < 2e-5, gap
    moved = torch.cat([topk_sets_differ(s.old_routes, s.rollout_routes).view(-1) for s in samples])
    assert float(moved.float().mean()) < 0.01, float(moved.float().mean())
    return samples


# ---------------------------------------------------------------------------------------------
# R3 replaying the engine's combine weights (routing_replay_weights=replayed)
# ---------------------------------------------------------------------------------------------


@contextmanager
def capture_combine_weights(engine: TrainEngine):
    """Per MoE layer, the list of ``(probs [T, E], native weights [T, E])`` of every router call:
    the combine weights Megatron's router handed the dispatcher (zero off the chosen experts),
    and an independent softmax (Qwen3-MoE's rule, float64) of the router logits."""
    routers = [
        layer.mlp.router
        for chunk in engine.policy_chunks
        for layer in chunk.decoder.layers
        if hasattr(layer.mlp, "router")
    ]
    calls: dict[int, list] = {m: [] for m in range(len(routers))}
    handles = []
    for index, router in enumerate(routers):

        def hook(module, inputs, output, index=index):
            with torch.no_grad():
                logits = module.gating(inputs[0]).view(-1, module.weight.shape[0])
            calls[index].append((output[0].detach().clone(), logits.double().softmax(-1)))

        handles.append(router.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _samples_with_engine_weights(engine: TrainEngine, rollout, count: int) -> list[TrainSample]:
    """``count`` samples of ``rollout`` (closed afterwards) with its routes and the combine
    weights its routers gave them (``return_routed_expert_weights``)."""
    from megatron_gspo.rollout.types import GenerateRequest

    requests = [
        GenerateRequest(
            input_ids=[(5 * i + 3 * j) % 60 + 1 for j in range(2 + i)],
            max_new_tokens=6 + i,
            temperature=engine.cfg.rollout.temperature,
            seed=100 + i,
            return_routed_experts=True,
            return_routed_expert_weights=True,
        )
        for i in range(count)
    ]
    results = rollout.generate(requests)
    rollout.close()
    samples = rollout_samples(requests, results)
    for sample, result in zip(samples, results):
        assert result.routed_expert_weights.dtype == np.float32
        sample.rollout_route_weights = torch.from_numpy(result.routed_expert_weights)
    return samples


def _flat(samples: list[TrainSample], field: str) -> torch.Tensor:
    return torch.cat([getattr(sample, field) for sample in samples])


def _r3_replayed_equals_recompute(make_engine) -> None:
    """float32 trainer and embedded engine with the same weights. (1) The engine's weights equal
    Megatron's recomputed combine weights at the same ids (R3 + recompute's old-log-prob forward,
    read from the router's output) to fp32 rounding; (2) R3 + replayed and R3 + recompute give
    the same old log-probs and loss to fp32 rounding, and the same gradients where the router's
    path does not reach (the last MoE layer's experts, the final norm, the output layer): with
    replayed weights, constants, the loss's gradient no longer flows through the routers' logits
    into the router weights and the hidden states that feed them; the metric says which weights
    were used."""
    recompute = make_engine("recompute")
    rollout = _embedded_engine_with_trainer_weights(recompute)
    samples = _samples_with_engine_weights(recompute, rollout, count=4)
    twins = copy.deepcopy(samples)
    with capture_combine_weights(recompute) as calls:
        _prepare(recompute, samples)
    ids, weights = _flat(samples, "rollout_routes").long(), _flat(samples, "rollout_route_weights")
    assert len(calls) == ids.shape[1]
    for m in range(ids.shape[1]):
        ((probs, _),) = calls[m]
        megatron = probs.gather(1, ids[:, m])
        assert float(megatron.sum()) > 0.5 * ids.shape[0]  # the ids are the routed ones
        error = (megatron - weights[:, m]).abs().max().item()
        assert error < 2e-6, (m, error)
    metrics = recompute.forward_backward(samples)
    grads = gather_full_state(recompute.model, grads=True)
    replayed = make_engine("replayed")
    _prepare(replayed, twins)
    gap = max(
        (a.old_log_probs - b.old_log_probs).abs().max().item() for a, b in zip(samples, twins)
    )
    assert gap < 1e-5, gap
    replayed_metrics = replayed.forward_backward(twins)
    replayed_grads = gather_full_state(replayed.model, grads=True)
    assert metrics["routing_replay_weights_replayed"] == 0.0
    assert replayed_metrics["routing_replay_weights_replayed"] == 1.0
    assert replayed_metrics["routing_mismatch_vs_rollout"] == 0.0
    loss, replayed_loss = float(metrics["loss"]), float(replayed_metrics["loss"])
    assert abs(loss - replayed_loss) <= 1e-5 * max(abs(loss), 1e-3), (loss, replayed_loss)
    last = max(int(name.split(".")[2]) for name in grads if name.endswith("mlp.router.weight"))
    downstream = (
        f"decoder.layers.{last}.mlp.experts.",
        f"decoder.layers.{last}.mlp.shared",
        "decoder.final_layernorm",
        "output_layer",
    )
    compared = 0
    for name, grad in grads.items():
        if name.startswith(downstream):
            error = relative_error(replayed_grads[name], grad)
            assert error < 1e-5, (name, error)
            compared += 1
    assert compared >= 10, compared


def check_r3_replayed_engine_weights_equal_recompute_qwen3_moe() -> None:
    _r3_replayed_equals_recompute(
        lambda weights: _engine("r3", model__init_std=0.2, algo__routing_replay_weights=weights)
    )


def check_r3_replayed_engine_weights_equal_recompute_glm4() -> None:
    """GLM-4.5's family: sigmoid scores, a non-zero correction bias, groups, routed scaling."""
    _r3_replayed_equals_recompute(lambda weights: _glm4_engine(weights, mode="r3"))


def check_r3_replays_a_bf16_engines_weights() -> None:
    """A bfloat16 embedded engine: its combine weights are bf16 values, which differ from the
    float32 trainer's recomputed ones at the same ids (a float64 evaluation of Qwen3-MoE's rule
    on the trainer's router logits) by bf16 rounding, not more; under R3 + replayed the trainer's routers
    hand exactly the engine's weights to the dispatcher (zero off its ids), in the old-log-prob
    and training forwards, and the loss depends on them: the same samples with one expert's
    weight scaled by 0.8 on every row give a different ratio."""
    from megatron_gspo.engine.hf_import_export import iter_hf_weights
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    engine = _engine("r3", model__init_std=0.2, algo__routing_replay_weights="replayed")
    rollout = EmbeddedEngine(engine.cfg.model, seed=0, dtype=torch.bfloat16)
    rollout.sync_weights(iter_hf_weights(engine.policy_chunks, engine.cfg), version=1)
    samples = _samples_with_engine_weights(engine, rollout, count=6)
    ids, weights = _flat(samples, "rollout_routes").long(), _flat(samples, "rollout_route_weights")
    assert torch.equal(weights, weights.bfloat16().float())  # Qwen3's router casts to bf16
    with capture_combine_weights(engine) as calls:
        _prepare(engine, samples)
    recompute_gap = 0.0
    for m in range(MOE_LAYERS):
        ((probs, native),) = calls[m]
        assert torch.equal(probs.gather(1, ids[:, m]), weights[:, m]), m
        assert float(probs.sum()) == float(probs.gather(1, ids[:, m]).sum())  # zero elsewhere
        # Float64 Qwen3-MoE rule at the engine's ids from the trainer's own router logits.
        own = native.gather(1, ids[:, m])
        own = own / own.sum(-1, keepdim=True)
        recompute_gap = max(recompute_gap, (own - weights[:, m].double()).abs().max().item())
    # Different (bf16 rounding moved them), yet the same routing's weights (not other ids').
    assert 1e-4 < recompute_gap < 0.1, recompute_gap
    with capture_combine_weights(engine) as calls:
        metrics = engine.forward_backward(samples)
    for m in range(MOE_LAYERS):
        ((probs, _),) = calls[m]
        assert torch.equal(probs.gather(1, ids[:, m]), weights[:, m]), m
    assert metrics["routing_replay_weights_replayed"] == 1.0
    assert metrics["seq_log_ratio_abs_max"] == 0.0, metrics["seq_log_ratio_abs_max"]
    perturbed = copy.deepcopy(samples)
    for sample in perturbed:
        sample.rollout_route_weights[..., 0] *= 0.8
    metrics = engine.forward_backward(perturbed)
    assert metrics["seq_log_ratio_abs_max"] > 1e-4, metrics["seq_log_ratio_abs_max"]


CHECKS = {name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")}


def checks_mode() -> None:
    print(json.dumps(run_checks(CHECKS, traceback_limit=6)))


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def run_layout(mode: str, layout: str) -> dict:
    """Old-log-prob forward (R2: record; R3: replay random routes and record), then a training
    forward/backward that replays random routes, then one with a single sample (a filler
    micro-batch on the other data-parallel ranks)."""
    if dist.is_initialized():
        destroy_parallel(destroy_process_group=False)
    engine = TrainEngine(_config(mode, layout, MICRO_BATCH_TOKENS))
    samples = make_samples()
    routes = random_routes(samples)
    if mode == "r3":
        for sample, route in zip(samples, routes):
            sample.rollout_routes = route
    _prepare(engine, samples)
    recorded = [s.old_routes for s in samples]
    recorded_weights = [s.old_route_weights for s in samples]
    log_probs = [s.old_log_probs for s in samples]
    if mode in ("r2", "r2w"):
        for sample, route in zip(samples, routes):
            sample.old_routes = route  # R2 replays the old routes: make them far from native
    metrics = engine.forward_backward(samples)
    grads = gather_full_state(engine.model, grads=True)
    single = engine.forward_backward(samples[:1])
    return dict(
        recorded=recorded,
        recorded_weights=recorded_weights,
        log_probs=log_probs,
        metrics=metrics,
        grads=grads,
        single=single,
    )


def compare_layout(result: dict, reference: dict) -> dict:
    report = {}
    report["recorded_equal"] = all(
        torch.equal(a, b) for a, b in zip(result["recorded"], reference["recorded"])
    )
    if reference["recorded_weights"][0] is not None:
        report["recorded_weights_max_abs"] = max(
            (a - b).abs().max().item()
            for a, b in zip(result["recorded_weights"], reference["recorded_weights"])
        )
    report["log_probs_max_abs"] = max(
        (a - b).abs().max().item() for a, b in zip(result["log_probs"], reference["log_probs"])
    )
    report["grad_max_rel"] = max(
        relative_error(result["grads"][n], reference["grads"][n]) for n in result["grads"]
    )
    names = [
        n
        for n in reference["metrics"]
        if n.startswith(("routing_change", "routing_replay_weights")) or n == "loss"
    ]
    report["metric_abs"] = {
        n: abs(result["metrics"].get(n, float("nan")) - reference["metrics"][n]) for n in names
    }
    report["metrics"] = {n: result["metrics"].get(n) for n in names}
    report["single_loss_rel"] = abs(result["single"]["loss"] - reference["single"]["loss"]) / abs(
        reference["single"]["loss"]
    )
    return report


def reference_mode(out: Path, modes: list[str]) -> None:
    for mode in modes:
        torch.save(run_layout(mode, ""), out / f"reference_{mode}.pt")


def layout_mode(out: Path, runs: list[str]) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    reports = {}
    for run in runs:
        mode, layout = run.split(":")
        reference = torch.load(out / f"reference_{mode}.pt", weights_only=False)
        reports[run] = compare_layout(run_layout(mode, layout), reference)
    (out / f"rank{rank}.json").write_text(json.dumps(reports, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checks", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--reference", nargs="*", default=None, help="modes to compute")
    parser.add_argument("--runs", nargs="*", default=[], help="mode:layout to compare")
    args = parser.parse_args()
    if args.checks:
        checks_mode()
    elif args.reference is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        reference_mode(args.out, args.reference)
    else:
        layout_mode(args.out, args.runs)
    if dist.is_initialized():
        destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
