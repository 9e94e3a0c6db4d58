"""The named stages that :mod:`megatron_gspo.loop` calls, one function each.

Stages that touch the rollout engine, rewards or logs run on the driver (global rank 0); stages
that call the training engine run on every rank (they are collective).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_gspo.algo import AdvantageSettings, RunningMoments, compute_advantages, kl_estimate
from megatron_gspo.config import AlgoConfig, ConfigError, TrainConfig
from megatron_gspo.samples import TrainSample

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Old and reference log-probs
# ----------------------------------------------------------------------------------------------


def set_old_log_probs(engine, samples: list[TrainSample], algo: AlgoConfig) -> None:
    """Fill ``old_log_probs`` (and ``ref_log_probs`` when a KL term needs them).

    recompute: one forward of the training engine (R2 records routes there); rollout: the
    inference engine's log-probs; detach: left as None, and the train step uses the current
    log-probs detached (old = current).
    """
    if algo.old_log_prob_source == "recompute":
        # R2 replays, and routing_change_frac compares with, the routes this forward records.
        record = algo.routing_replay == "r2" or algo.log_routing_change
        old = engine.forward_log_probs(samples, record_routes=record)
        for index, (sample, log_probs) in enumerate(zip(samples, old.log_probs)):
            sample.old_log_probs = log_probs
            if old.routes is not None:
                sample.old_routes = old.routes[index]
    elif algo.old_log_prob_source == "rollout":
        for sample in samples:
            if sample.rollout_log_probs is None:
                raise RuntimeError(
                    "old_log_prob_source=rollout but the rollout engine returned no log-probs"
                )
            sample.old_log_probs = sample.rollout_log_probs
    if algo.needs_reference_model:
        reference = engine.forward_log_probs(samples, reference=True)
        for sample, log_probs in zip(samples, reference.log_probs):
            sample.ref_log_probs = log_probs


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def assign_advantages(
    samples: list[TrainSample], settings: AdvantageSettings, moments: RunningMoments
) -> dict[str, float]:
    """Compute advantages from rewards (same on every rank: every rank holds every sample)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    group_ids = torch.tensor([s.group_id for s in samples])
    lengths = torch.tensor([int(s.response_mask().sum()) for s in samples], dtype=torch.float64)
    kl_inputs = _padded_log_probs(samples) if settings.per_token else {}
    advantages, metrics = compute_advantages(
        rewards, group_ids, settings, response_lengths=lengths, running=moments, **kl_inputs
    )
    if settings.per_token:
        for sample, token_advantages in zip(samples, advantages):
            sample.advantages = token_advantages[: sample.response_length].clone()
    else:
        for sample, advantage in zip(samples, advantages):
            sample.advantages = advantage.reshape(())
    values = torch.cat([s.advantages.reshape(-1).float() for s in samples])
    metrics.update({"advantage_mean": values.mean(), "advantage_abs_mean": values.abs().mean()})
    return {name: float(value) for name, value in metrics.items()}


def _padded_log_probs(samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    """Old and reference log-probs and the response mask, ``[B, T]`` padded (KL-in-reward)."""
    width = max(s.response_length for s in samples)
    old = torch.zeros(len(samples), width, dtype=torch.float64)
    ref = old.clone()
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        length = sample.response_length
        old[row, :length] = sample.old_log_probs.double()
        ref[row, :length] = sample.ref_log_probs.double()
        mask[row, :length] = sample.response_mask()
    return {"old_log_probs": old, "ref_log_probs": ref, "response_mask": mask}


# ----------------------------------------------------------------------------------------------
# Policy update
# ----------------------------------------------------------------------------------------------


def mini_batches(
    samples: list[TrainSample], num_mini_batches: int, generator: torch.Generator
) -> list[list[TrainSample]]:
    """A random split of the rollout batch into equal mini-batches (seeded: resumable)."""
    order = torch.randperm(len(samples), generator=generator).tolist()
    size = len(samples) // num_mini_batches
    return [[samples[i] for i in order[k * size : (k + 1) * size]] for k in range(num_mini_batches)]


def update_policy(
    engine, samples: list[TrainSample], algo: AlgoConfig, *, seed: int, step: int
) -> dict[str, float]:
    """``ppo_epochs`` x ``num_mini_batches`` optimizer steps; metrics averaged over the steps
    (``*_max`` take the max, ``skipped`` counts)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    per_step: list[dict[str, float]] = []
    for _ in range(algo.ppo_epochs):
        for batch in mini_batches(samples, algo.num_mini_batches, generator):
            per_step.append(engine.train_step(batch))
    return reduce_step_metrics(per_step)


def reduce_step_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    merged: dict[str, list[float]] = defaultdict(list)
    for metrics in per_step:
        for name, value in metrics.items():
            merged[name].append(float(value))
    reduced = {}
    for name, values in merged.items():
        if name.endswith("_max"):
            reduced[name] = max(values)
        elif name in ("skipped", "num_skipped"):
            reduced[name] = sum(values)
        else:
            finite = [v for v in values if math.isfinite(v)]
            reduced[name] = sum(finite) / len(finite) if finite else float("nan")
    if per_step and "grad_norm" in per_step[0]:
        reduced["grad_norm_max"] = max(float(m["grad_norm"]) for m in per_step)
    reduced["optimizer_steps"] = float(len(per_step))
    return reduced


# ----------------------------------------------------------------------------------------------
# Rollout-side metrics
# ----------------------------------------------------------------------------------------------


def rollout_metrics(samples: list[TrainSample]) -> dict[str, float]:
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    finish = defaultdict(int)
    for sample in samples:
        finish[sample.finish_reason] += 1
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "reward_max": float(rewards.max()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "prompt_len_mean": sum(s.prompt_length for s in samples) / len(samples),
        "num_samples": float(len(samples)),
    }
    for reason, count in finish.items():
        metrics[f"finish_{reason}_frac"] = count / len(samples)
    return metrics


def log_prob_gap_metrics(samples: list[TrainSample]) -> dict[str, float]:
    """Trainer vs rollout log-probs on the same tokens: mean |difference| and k3 KL.

    Available when old log-probs were recomputed by the trainer before any update (the two
    engines then hold the same weights, so the gap is pure train/inference mismatch).
    """
    pairs = [
        (s.old_log_probs, s.rollout_log_probs, s.response_mask())
        for s in samples
        if s.old_log_probs is not None
        and s.rollout_log_probs is not None
        and s.old_log_probs is not s.rollout_log_probs
    ]
    if not pairs:
        return {}
    trainer = torch.cat([p[0][p[2]].double() for p in pairs])
    rollout = torch.cat([p[1][p[2]].double() for p in pairs])
    return {
        "rollout_log_prob_abs_diff": float((trainer - rollout).abs().mean()),
        "rollout_kl_k3": float(kl_estimate(trainer, rollout, "k3").mean()),
    }


def headline_metrics(metrics: dict[str, float], algo: AlgoConfig) -> dict[str, float]:
    """The names every run reports whatever its configuration: ``policy_loss`` and ``kl``.

    ``policy_loss`` is the clipped policy-gradient term (the engine's ``pg_loss``, without the KL
    and entropy terms). ``kl`` is the KL to the reference model when one exists: the train step's
    ``KL(policy || reference)`` (``algo.kl_estimator``, token mean) with ``use_kl_loss``, else the
    old-policy ``token_level_kl`` of ``add_token_level_kl``. Without a reference model it is
    ``rollout_kl_k3``, the k3 estimate between the trainer's recomputed log-probs and the rollout
    engine's on the sampled tokens (train/inference mismatch); the ``rollout`` and ``detach``
    old-log-prob sources measure no trainer log-probs before the update, so ``kl`` is absent there
    rather than a made-up zero.
    """
    headline = {}
    if "pg_loss" in metrics:
        headline["policy_loss"] = metrics["pg_loss"]
    if "kl" not in metrics:
        source = "token_level_kl" if algo.add_token_level_kl else "rollout_kl_k3"
        if source in metrics:
            headline["kl"] = metrics[source]
    return headline


# ----------------------------------------------------------------------------------------------
# Supervised cold start
# ----------------------------------------------------------------------------------------------


def sft_warmup(engine, task: Optional[Task], cfg: TrainConfig, broadcast) -> dict[str, float]:
    """``sft_warmup_steps`` optimizer steps of maximum likelihood on reference answers.

    It reuses the policy update: with advantage 1 and old log-probs equal to the current ones,
    the clipped surrogate's gradient is the log-likelihood gradient (ratio 1 is inside any clip
    range), aggregated like the RL loss. Returns the negative log-likelihood per token before the
    first and the last warm-up step.
    """
    nll = []
    for _ in range(cfg.sft_warmup_steps):
        samples = None
        if task is not None:
            prompts = task.stream.next_batch(cfg.algo.rollout_batch_size)
            samples = [_reference_sample(prompt, task) for prompt in prompts]
        samples = broadcast(samples)
        with engine.native_routing():  # reference answers have no routes to replay
            log_probs = engine.forward_log_probs(samples).log_probs
            for sample, values in zip(samples, log_probs):
                sample.old_log_probs = values
            if cfg.algo.needs_reference_model:  # the KL loss term needs them
                for sample, values in zip(
                    samples, engine.forward_log_probs(samples, reference=True).log_probs
                ):
                    sample.ref_log_probs = values
            nll.append(float(-torch.cat(log_probs).mean()))
            engine.train_step(samples)
    if nll:
        logger.info("SFT warm-up: %d steps, NLL/token %.4f -> %.4f", len(nll), nll[0], nll[-1])
        return {"sft_warmup_nll_first": nll[0], "sft_warmup_nll_last": nll[-1]}
    return {}


def _reference_sample(prompt, task: Task) -> TrainSample:
    if prompt.answer is None:
        raise ValueError(
            f"sft_warmup_steps > 0 but the prompt at {prompt.source} has no answer to imitate; "
            "set sft_warmup_steps=0 or give the data an answer column"
        )
    answer_ids = task.tokenizer.encode(prompt.answer, add_special_tokens=False)
    eos = [task.eos_token_id] if task.eos_token_id is not None else []
    return TrainSample(
        tokens=torch.tensor(list(prompt.prompt_ids) + answer_ids + eos, dtype=torch.long),
        prompt_length=len(prompt.prompt_ids),
        group_id=prompt.group_id,
        advantages=torch.tensor(1.0),
    )


# ----------------------------------------------------------------------------------------------
# Building the driver's pieces
# ----------------------------------------------------------------------------------------------


@dataclass
class Task:
    """Prompts, tokenizer and held-out prompts of a run (the driver's)."""

    tokenizer: Any
    stream: Any
    eval_prompts: list
    eos_token_id: Optional[int]


def build_task(cfg: TrainConfig) -> Task:
    from megatron_gspo.data import build_eval_prompts, build_prompt_stream, build_tokenizer

    tokenizer = build_tokenizer(cfg.data, cfg.model)
    vocab = len(tokenizer)
    if vocab > cfg.model.vocab_size:
        raise ConfigError(
            "model.vocab_size",
            f"the tokenizer has {vocab} tokens but model.vocab_size={cfg.model.vocab_size}",
            "every token id must have an embedding row",
            f"set model.vocab_size >= {vocab}",
        )
    stream = build_prompt_stream(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    eval_prompts = build_eval_prompts(cfg.data, cfg.algo, tokenizer, seed=cfg.seed)
    return Task(tokenizer, stream, eval_prompts, getattr(tokenizer, "eos_token_id", None))


def resolve_model(cfg: TrainConfig) -> TrainConfig:
    """With ``model.hf_path``, complete the model section from its config.json (and check that
    what the user set agrees with it)."""
    if cfg.model.hf_path is None:
        return cfg
    from megatron_gspo.convert.hf_config import resolve_model_config

    return dataclasses.replace(cfg, model=resolve_model_config(cfg.model))


def initial_weights_loader(cfg: TrainConfig):
    """What sets the initial weights after seed initialisation: a Megatron checkpoint
    (``checkpoint.load_path``, any layout), the HF directory (``model.hf_path``, each rank reading
    its own shards), or nothing (the seed alone)."""
    if cfg.checkpoint.load_path is not None:
        from megatron_gspo.engine.checkpoint import load_weights_only

        return lambda chunks: load_weights_only(chunks, cfg.checkpoint.load_path)
    if cfg.model.hf_path is not None:
        from megatron_gspo.engine.hf_weights import load_hf_weights

        return lambda chunks: load_hf_weights(chunks, cfg.model.hf_path, cfg)
    return None


def checkpoint_root(cfg: TrainConfig) -> str:
    return os.path.join(cfg.output_dir, "checkpoints")


def save_checkpoint(engine, cfg: TrainConfig, run_state: dict) -> str:
    from megatron_gspo.engine.checkpoint import save_checkpoint as save

    return save(
        engine,
        checkpoint_root(cfg),
        run_state["step"],
        run_state,
        keep_last=cfg.checkpoint.keep_last,
    )


def resume_checkpoint(engine, cfg: TrainConfig) -> Optional[dict]:
    """The run state of the latest whole checkpoint in ``output_dir`` (None: start fresh)."""
    from megatron_gspo.engine.checkpoint import load_checkpoint, resumable_checkpoint

    path = resumable_checkpoint(checkpoint_root(cfg))  # a damaged newest one: the one before
    if path is None:
        logger.warning(
            "resume=true but %s holds no checkpoint: starting fresh", checkpoint_root(cfg)
        )
        return None
    logger.info("resuming from %s", path)
    # A longer run (more steps) changes the decay horizon of a decaying schedule, which would
    # change the trajectory; a constant schedule does not depend on it, so extending is allowed.
    return load_checkpoint(
        engine, path, allow_schedule_change=cfg.optim.lr_decay_style == "constant"
    )


def build_rollout(cfg: TrainConfig):
    from megatron_gspo.rollout.factory import build_rollout_engine

    return build_rollout_engine(
        cfg.rollout,
        cfg.model,
        seed=cfg.seed,
        enable_routed_experts=cfg.algo.routing_replay == "r3",
        work_dir=os.path.join(cfg.output_dir, "rollout"),
    )


# ----------------------------------------------------------------------------------------------
# Rollout and rewards (driver)
# ----------------------------------------------------------------------------------------------


def generate(
    rollout,
    task: Task,
    prompts: list,
    cfg: TrainConfig,
    step: int,
    *,
    temperature: Optional[float] = None,
    group_size: Optional[int] = None,
    return_routes: Optional[bool] = None,
) -> list[TrainSample]:
    """``num_return_sequences_in_group`` responses per prompt, as :class:`TrainSample`\\ s.

    Sampling seeds derive from (run seed, step, prompt), so a resumed run samples exactly what the
    uninterrupted one would. An aborted request keeps its sample with an empty loss mask and a
    group of its own (advantage 0): it is counted, never trained on. ``temperature`` (0: greedy),
    ``group_size`` and ``return_routes`` override the training settings (evaluation uses them;
    they are arguments, not a modified config, because the config rejects ``temperature=0``).
    """
    if temperature is None:
        temperature = cfg.rollout.temperature
    if group_size is None:
        group_size = cfg.algo.num_return_sequences_in_group
    if return_routes is None:
        return_routes = cfg.algo.routing_replay == "r3"
    from megatron_gspo.rollout import GenerateRequest

    base_seed = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.seed
    requests = [
        GenerateRequest(
            input_ids=prompt.prompt_ids,
            max_new_tokens=cfg.algo.response_length,
            temperature=temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            stop_token_ids=[task.eos_token_id] if task.eos_token_id is not None else [],
            min_new_tokens=cfg.rollout.min_new_tokens,
            seed=(base_seed * 1_000_003 + step) * 100_003 + index,
            return_logprob=True,
            return_routed_experts=return_routes,
        )
        for index, prompt in enumerate(prompts)
    ]
    results = rollout.generate(requests, n=group_size)
    samples = []
    for index, result in enumerate(results):
        prompt = prompts[index // group_size]
        tokens = torch.tensor(list(prompt.prompt_ids) + list(result.output_ids), dtype=torch.long)
        aborted = result.finish_reason == "abort"
        routes = result.routed_experts
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=len(prompt.prompt_ids),
                group_id=-1 - index if aborted else prompt.group_id,
                loss_mask=torch.zeros(len(result.output_ids), dtype=torch.bool)
                if aborted
                else None,
                rollout_log_probs=None
                if result.output_log_probs is None
                else torch.as_tensor(result.output_log_probs, dtype=torch.float32),
                rollout_routes=None if routes is None else torch.from_numpy(routes),
                finish_reason=result.finish_reason,
                weight_version=result.weight_version,
                metadata={"prompt_index": index // group_size},
            )
        )
    if any(s.finish_reason == "abort" for s in samples):
        logger.warning(
            "%d of %d rollout samples were aborted; they are kept out of the loss",
            sum(s.finish_reason == "abort" for s in samples),
            len(samples),
        )
    return samples


def score(samples: list[TrainSample], prompts: list, rewards, task: Task) -> dict[str, float]:
    """Score every sample; failures are counted in the returned metrics and logged by the runner."""
    from megatron_gspo.reward import RewardInput

    inputs = []
    for sample in samples:
        prompt = prompts[sample.metadata["prompt_index"]]
        response_ids = sample.tokens[sample.prompt_length :].tolist()
        inputs.append(
            RewardInput(
                prompt=prompt.prompt_text,
                response=task.tokenizer.decode(response_ids, skip_special_tokens=True),
                answer=prompt.answer,
                metadata=prompt.metadata,
                prompt_ids=list(prompt.prompt_ids),
                response_ids=response_ids,
                finish_reason=sample.finish_reason,
            )
        )
    result = rewards.score(inputs)
    for sample, reward in zip(samples, result.rewards):
        sample.reward = float(reward)
    return {
        k: float(v) for k, v in result.metrics.items() if k not in ("reward_mean", "reward_max")
    }


# ----------------------------------------------------------------------------------------------
# Weight sync and evaluation
# ----------------------------------------------------------------------------------------------


def sync_weights(engine, rollout, *, version: int) -> dict[str, float]:
    """Stream the trainer's weights (HF names, full tensors) into the rollout engine.

    Gathering shards is collective, so every rank drains the iterator; only the driver hands the
    tensors to the engine.
    """
    from megatron_gspo.engine.hf_weights import iter_hf_weights

    named_tensors = iter_hf_weights(engine.policy_chunks, engine.cfg)
    if rollout is None:
        for _ in named_tensors:
            pass
        return {}
    from megatron_gspo.rollout import sync_weights_paused

    stats = sync_weights_paused(rollout, named_tensors, version)
    return {
        "weight_sync_s": stats.seconds,
        "weight_sync_bytes": float(stats.num_bytes),
        "weight_sync_tensors": float(stats.num_tensors),
        "weight_sync_buckets": float(stats.num_buckets),
    }


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(rollout, task: Task, rewards, cfg: TrainConfig) -> dict[str, float]:
    """Held-out prompts: greedy accuracy, mean reward and pass@k of sampled responses.

    A response counts as correct when its reward reaches ``eval.correct_reward``.
    """
    prompts = task.eval_prompts
    if not prompts:
        return {}
    samples_per_prompt = cfg.eval.num_samples
    metrics = {}
    for name, temperature, n in (
        ("greedy", 0.0, 1),
        ("sampled", cfg.eval.temperature, samples_per_prompt),
    ):
        samples = generate(
            rollout,
            task,
            prompts,
            cfg,
            step=-1,
            temperature=temperature,
            group_size=n,
            return_routes=False,
        )
        score(samples, prompts, rewards, task)
        correct = [s.reward >= cfg.eval.correct_reward for s in samples]
        metrics[f"eval/{name}_reward_mean"] = sum(s.reward for s in samples) / len(samples)
        if name == "greedy":
            metrics["eval/greedy_accuracy"] = sum(correct) / len(correct)
        else:
            for k in sorted({1, n}):
                values = [
                    pass_at_k(n, sum(correct[i * n : (i + 1) * n]), k) for i in range(len(prompts))
                ]
                metrics[f"eval/pass@{k}"] = sum(values) / len(values)
    return metrics
