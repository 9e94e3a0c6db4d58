"""One-process checks of TrainEngine behaviour (run in a fresh process by test_engine.py).

Prints one JSON object ``{check: "ok" | failure text}``.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from layout_worker import VOCAB, make_config, make_samples  # noqa: E402
from worker_launch import run_checks  # noqa: E402

from megatron_gspo.engine.sharding import gather_full_state  # noqa: E402
from megatron_gspo.engine.train_step import NonFiniteStepsError, TrainEngine  # noqa: E402
from megatron_gspo.samples import TrainSample  # noqa: E402


def _engine(case: str = "moe", micro_batch_tokens: int = 10_000, **overrides) -> TrainEngine:
    cfg = make_config(case, "", micro_batch_tokens)
    for path, value in overrides.items():
        section, name = path.split("__")
        setattr(getattr(cfg, section), name, value)
    return TrainEngine(cfg)


def check_next_token_alignment_and_temperature() -> None:
    """forward_log_probs == float64 log_softmax(h W^T / T)[next token] at response positions."""
    engine = _engine()
    sample = make_samples()[3]
    chunk = engine.policy_chunks[0]
    captured = {}
    handle = chunk.decoder.final_layernorm.register_forward_hook(
        lambda module, inputs, output: captured.__setitem__("hidden", output.detach())
    )
    (log_probs,) = engine.forward_log_probs([sample]).log_probs
    handle.remove()
    hidden = captured["hidden"].squeeze(1).double()  # [L - 1, h]
    logits = hidden @ chunk.output_weight.detach().double().T / engine.cfg.rollout.temperature
    reference = torch.log_softmax(logits, -1)
    positions = torch.arange(sample.prompt_length - 1, sample.tokens.numel() - 1)
    expected = reference[positions, sample.tokens[positions + 1]]
    error = (log_probs.double() - expected).abs().max().item()
    assert error < 1e-5, error


def check_packing_isolates_sequences() -> None:
    """Log-probs of samples packed together equal those of each sample alone."""
    samples = make_samples()
    packed = _engine(micro_batch_tokens=10_000).forward_log_probs(samples).log_probs
    alone = _engine(micro_batch_tokens=1).forward_log_probs(samples).log_probs
    error = max((a - b).abs().max().item() for a, b in zip(packed, alone))
    assert error < 1e-5, error


def check_recomputed_old_log_probs_give_ratio_one() -> None:
    """Old log-probs from forward_log_probs match the training forward bit for bit."""
    engine = _engine()
    samples = make_samples()
    for sample, old in zip(samples, engine.forward_log_probs(samples).log_probs):
        sample.old_log_probs = old
    metrics = engine.forward_backward(samples)
    assert metrics["seq_log_ratio_abs_max"] == 0.0, metrics["seq_log_ratio_abs_max"]
    assert metrics["clip_frac_token"] == 0.0


def check_non_finite_steps_are_skipped_then_stop_the_run() -> None:
    engine = _engine(optim__max_consecutive_skips=2)
    good = make_samples()
    bad = make_samples()
    bad[0].advantages = torch.tensor(float("nan"))
    before = gather_full_state(engine.model)
    lr_before = engine.optimizer.param_groups[0]["lr"]
    metrics = engine.train_step(bad)
    assert metrics["skipped"] == 1.0 and not math.isfinite(metrics["loss"]), metrics
    after = gather_full_state(engine.model)
    assert all(torch.equal(before[n], after[n]) for n in before), "weights changed"
    assert engine.optimizer.param_groups[0]["lr"] == lr_before
    assert metrics["skipped_total"] == 1.0
    assert engine.train_step(good)["skipped"] == 0.0  # resets the consecutive count
    assert engine.train_step(bad)["skipped"] == 1.0
    try:
        engine.train_step(bad)
    except NonFiniteStepsError as error:
        assert "consecutive" in str(error)
    else:
        raise AssertionError("two consecutive skips did not stop the run")


def check_lr_warmup() -> None:
    engine = _engine(optim__lr_warmup_steps=2)
    lrs = [engine.train_step(make_samples())["lr"] for _ in range(3)]
    assert [round(lr / 1e-3, 6) for lr in lrs] == [0.5, 1.0, 1.0], lrs


def check_fixed_lr_overrides_the_schedule_inside_its_block() -> None:
    """sft_warmup_lr's mechanism: inside ``fixed_lr`` every step applies that lr (the warm-up
    schedule still advances), after it the schedule's own lr; a skipped step inside leaves the
    schedule's lr in place; ``fixed_lr(None)`` changes nothing."""
    engine = _engine(optim__lr_warmup_steps=5)  # lr 1e-3 (k + 1) / 5 at optimizer step k
    bad = make_samples()
    bad[0].advantages = torch.tensor(float("nan"))
    with engine.fixed_lr(None):
        lrs = [engine.train_step(make_samples())["lr"]]
    with engine.fixed_lr(7e-3):
        lrs += [engine.train_step(make_samples())["lr"] for _ in range(2)]
        assert engine.train_step(bad)["skipped"] == 1.0
        lr_after_skip = engine.optimizer.param_groups[0]["lr"]
        assert round(lr_after_skip / 1e-3, 6) == 0.8, lr_after_skip  # the schedule's, not 7e-3
    lrs += [engine.train_step(make_samples())["lr"] for _ in range(2)]
    assert [round(lr / 1e-3, 6) for lr in lrs] == [0.2, 7.0, 7.0, 0.8, 1.0], lrs


def check_load_balancing_loss_reaches_the_router() -> None:
    grads = {}
    for coef in (0.0, 0.01):
        engine = _engine(model__moe_aux_loss_coef=coef)
        metrics = engine.forward_backward(make_samples())
        grads[coef] = gather_full_state(engine.model, grads=True)
    name = "decoder.layers.0.mlp.router.weight"
    difference = (grads[0.01][name] - grads[0.0][name]).norm().item()
    assert difference > 1e-6 * grads[0.0][name].norm().item(), difference
    assert math.isfinite(metrics["loss"])


def check_auto_dispatcher_is_allgather_alone_and_exact() -> None:
    """``parallel.moe_token_dispatcher=auto`` on one process builds Megatron's allgather
    dispatcher, whose training (log-probs, loss, gradient norm, weights after two optimizer
    steps, the load-balancing loss included) equals the alltoall dispatcher's bit for bit."""
    engines = {
        kind: _engine(parallel__moe_token_dispatcher=kind, model__moe_aux_loss_coef=0.01)
        for kind in ("auto", "alltoall")
    }
    kinds = {
        kind: {
            type(module.token_dispatcher).__name__
            for module in engine.policy_chunks[0].modules()
            if hasattr(module, "token_dispatcher")
        }
        for kind, engine in engines.items()
    }
    assert kinds == {
        "auto": {"MoEAllGatherTokenDispatcher"},
        "alltoall": {"MoEAlltoAllTokenDispatcher"},
    }, kinds
    samples = make_samples()
    results = {}
    for kind, engine in engines.items():
        log_probs = engine.forward_log_probs(samples).log_probs
        steps = [engine.train_step(samples) for _ in range(2)]
        results[kind] = (log_probs, steps, gather_full_state(engine.model))
    (auto_lp, auto_steps, auto_state), (a2a_lp, a2a_steps, a2a_state) = results.values()
    assert all(torch.equal(a, b) for a, b in zip(auto_lp, a2a_lp))
    for auto_metrics, a2a_metrics in zip(auto_steps, a2a_steps):
        for name in ("loss", "grad_norm", "moe_load_balancing_loss"):
            assert auto_metrics[name] == a2a_metrics[name], (name, auto_metrics, a2a_metrics)
    assert all(torch.equal(auto_state[name], a2a_state[name]) for name in a2a_state)


def check_one_micro_batch_metrics_reduce_like_several() -> None:
    """``reduce_loss_metrics`` of one micro-batch (its shortcut) equals the general reduction of
    that micro-batch and a neutral one (+0 sums, -inf maxima, +inf minima), signed zeros and
    NaN included."""
    from megatron_gspo.engine.step_metrics import reduce_loss_metrics

    parallel = _engine().parallel
    values = {
        "negative_zero": -0.0,
        "plain": 2.5,
        "not_a_number": float("nan"),
        "ratio_max": -0.0,
        "ratio_min": 0.0,
        "gap_max": 3.0,
        "gap_min": float("nan"),
    }
    only = {name: torch.tensor(value) for name, value in values.items()}
    neutral = {
        name: torch.tensor(
            float("-inf")
            if name.endswith("_max")
            else float("inf")
            if name.endswith("_min")
            else 0.0
        )
        for name in values
    }
    alone = reduce_loss_metrics([only], parallel)
    general = reduce_loss_metrics([only, neutral], parallel)
    assert {k: repr(v) for k, v in alone.items()} == {k: repr(v) for k, v in general.items()}, (
        alone,
        general,
    )
    assert repr(alone["negative_zero"]) == "0.0", alone  # a sum, as the general path gives


def check_routing_replay_is_settable() -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.global_router_replay_instances.clear()
    engine = _engine(algo__routing_replay="r2")
    routers = [r for r in RouterReplay.global_router_replay_instances]
    assert len(routers) == 4, len(routers)  # one per MoE layer of the policy
    assert all(
        layer.mlp.router.router_replay is not None
        for layer in engine.policy_chunks[0].decoder.layers
    )
    engine.forward_log_probs(make_samples()[:2])
    RouterReplay.global_router_replay_instances.clear()


def check_reference_model_is_frozen_copy() -> None:
    engine = _engine(algo__use_kl_loss=True)
    samples = make_samples()
    policy = engine.forward_log_probs(samples).log_probs
    reference = engine.forward_log_probs(samples, reference=True).log_probs
    assert all(torch.equal(a, b) for a, b in zip(policy, reference))
    for sample, ref in zip(samples, reference):
        sample.ref_log_probs = ref
    metrics = engine.train_step(samples)
    assert metrics["kl"] == 0.0 and metrics["kl_loss"] == 0.0, metrics
    moved = engine.forward_log_probs(samples).log_probs
    still = engine.forward_log_probs(samples, reference=True).log_probs
    assert any(not torch.equal(a, b) for a, b in zip(moved, policy))
    assert all(torch.equal(a, b) for a, b in zip(still, reference))


def check_bad_samples_are_rejected_with_the_field_named() -> None:
    engine = _engine()
    samples = make_samples()
    samples[4].old_log_probs = torch.zeros(1)
    try:
        engine.train_step(samples)
    except ValueError as error:
        assert "sample 4" in str(error) and "old_log_probs" in str(error), error
    else:
        raise AssertionError("a wrong old_log_probs shape was accepted")
    lonely = TrainSample(tokens=torch.tensor([1, 2]), prompt_length=2)
    try:
        engine.forward_log_probs([lonely])
    except ValueError as error:
        assert "response" in str(error)
    else:
        raise AssertionError("a sample without response was accepted")
    assert VOCAB == 64


CHECKS = {name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")}


def main() -> None:
    print(json.dumps(run_checks(CHECKS)))


if __name__ == "__main__":
    sys.exit(main())
