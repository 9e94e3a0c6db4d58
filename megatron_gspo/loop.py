"""The RL loop. One step, top to bottom (docs/architecture.md):

    prompts -> rollout -> rewards -> old / reference log-probs -> advantages -> policy update
            -> weight sync -> evaluate, log, checkpoint

Every rank runs this file (SPMD under torchrun) and speaks to two actors: the training engine,
whose calls are collective, and the driver (``driver/``), which on global rank 0 owns the
rollout engine, the reward functions and the logs, generates and scores the samples and
broadcasts them, so that every rank holds the whole rollout batch.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import torch

from megatron_gspo import algo
from megatron_gspo.config import TrainConfig
from megatron_gspo.driver import build_driver
from megatron_gspo.metrics.step import headline_metrics, log_prob_gap_metrics
from megatron_gspo.runtime.health import CollapseGuard, RolloutEngineLost, raise_if_interrupted
from megatron_gspo.trainer.setup import (
    RunState,
    initial_weights_loader,
    resolve_model,
    resume_checkpoint,
    save_checkpoint,
    save_checkpoint_unless_saved,
)
from megatron_gspo.trainer.stages import (
    assign_advantages,
    set_old_log_probs,
    sft_warmup,
    update_policy,
)


def run(cfg: TrainConfig) -> list[dict]:
    """Train ``cfg.steps`` RL steps; returns the driver's metric records (empty on other ranks)."""
    # Imported here, not above: the loop's module stays importable without Megatron (its types
    # and the CLI's --cfg / --help; tests/config/test_light_imports.py).
    from megatron_gspo.engine import TrainEngine

    torch.manual_seed(cfg.seed)
    if not torch.cuda.is_available():
        # Subnormal floats (weights and Adam moments decaying towards 0, e.g. of rarely routed
        # experts) make x86 CPUs 10-100x slower (a GRPO demo step went from 0.4 s to 40 s);
        # flushing them to zero only changes values below 1.2e-38.
        torch.set_flush_denormal(True)
    cfg = resolve_model(cfg)
    # One exit stack: what the run starts (reward workers, the rollout engine and its servers,
    # log sinks, the checkpoint writer's queue process) is registered as it starts and stopped on
    # any exit, newest first: the last step, an exception, Ctrl-C, a guard's stop.
    with ExitStack() as resources:
        engine = resources.enter_context(TrainEngine(cfg, load_weights=initial_weights_loader(cfg)))
        driver = build_driver(
            cfg, rank=engine.parallel.rank, resources=resources, weights=engine.hf_weights
        )
        advantage_settings = algo.advantage_settings(cfg.algo)
        distillation_settings = algo.distillation_settings(cfg.algo)
        collapse = CollapseGuard(
            cfg.optim.max_collapsed_steps, vocab_size=cfg.model.vocab_size, lr=cfg.optim.lr
        )
        state = RunState()
        resumed = resume_checkpoint(engine, cfg) if cfg.resume else None
        if resumed is not None:
            state.load_state_dict(resumed)
        warmup_stats = {}  # logged with the first RL step
        if state.step == 0 and cfg.sft_warmup_steps:
            warmup_stats = sft_warmup(engine, driver, cfg)
        # After the warm-up: the progress bar and its time estimate count RL steps only.
        driver.start(state.step, None if resumed is None else state.data)
        driver.sync_weights(engine.hf_weights(), version=state.step)
        for step in range(state.step, cfg.steps):
            started = time.perf_counter()
            timings: dict[str, float] = {}

            try:
                batch = driver.rollout(step)  # generated and scored on rank 0, on every rank
            except RolloutEngineLost:  # keep what was trained; its untrained prompts are pending
                save_checkpoint_unless_saved(engine, cfg, state.state_dict())
                raise
            samples = batch.samples
            with _timed(timings, "old_log_probs"):
                set_old_log_probs(engine, samples, cfg.algo)
            with _timed(timings, "advantages"):
                advantage_stats = assign_advantages(
                    samples, advantage_settings, state.reward_moments, distillation_settings
                )
            with _timed(timings, "update"):
                update_stats = update_policy(engine, samples, cfg.algo, seed=cfg.seed, step=step)
            with _timed(timings, "weight_sync"):
                sync_stats = driver.sync_weights(engine.hf_weights(), version=step + 1)

            driver.mark_trained(step)  # trained_prompts.jsonl, before the step's checkpoint
            state.step = step + 1
            state.data = driver.state_dict()
            metrics = {
                **warmup_stats,
                **batch.metrics,
                **advantage_stats,
                **log_prob_gap_metrics(samples),
                **update_stats,
                **sync_stats,
                **{f"time/{name}_s": seconds for name, seconds in timings.items()},
                "step_time_s": time.perf_counter() - started,
            }
            metrics.update(headline_metrics(metrics, cfg.algo))
            collapse.check(metrics)  # stops a policy that no longer responds to the loss
            if cfg.eval.interval and (step + 1) % cfg.eval.interval == 0:
                metrics.update(driver.evaluate())
            # The step's metrics line, like its trained_prompts.jsonl line, before its checkpoint:
            # a kill in between leaves lines of steps the resumed run trains again, and its
            # driver.start drops them, so each trained step keeps exactly one line.
            driver.log(step, metrics)
            if cfg.checkpoint.interval and (
                (step + 1) % cfg.checkpoint.interval == 0 or step + 1 == cfg.steps
            ):
                save_checkpoint(engine, cfg, state.state_dict())
            raise_if_interrupted()  # a Ctrl-C that Python dropped inside a finalizer
            warmup_stats = {}
        return driver.records


class _timed:
    """Adds the wall time of a ``with`` block to ``timings[name]``."""

    def __init__(self, timings: dict[str, float], name: str):
        self.timings, self.name = timings, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.timings[self.name] = (
            self.timings.get(self.name, 0.0) + time.perf_counter() - self.start
        )
