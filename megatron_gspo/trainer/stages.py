"""The policy-side stages of an RL step: old and reference log-probs, advantages, the update,
and the supervised warm-up.

They run on every rank with the whole rollout batch: the calls into the training engine are
collective, and advantages come out the same everywhere without communication.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from megatron_gspo.algo import (
    AdvantageSettings,
    DistillationSettings,
    RunningMoments,
    compute_advantages,
    distillation_advantages,
)
from megatron_gspo.config import AlgoConfig, TrainConfig
from megatron_gspo.metrics.step import reduce_step_metrics
from megatron_gspo.runtime.seeds import step_seed
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.driver.interface import Driver
    from megatron_gspo.engine.train_step import TrainEngine

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Old and reference log-probs
# ----------------------------------------------------------------------------------------------


def set_old_log_probs(engine: TrainEngine, samples: list[TrainSample], algo: AlgoConfig) -> None:
    """Fill ``old_log_probs`` (and ``ref_log_probs`` when a KL term needs them).

    recompute: one forward of the training engine (R2 records routes there); rollout: the
    inference engine's log-probs; detach: left as None, and the train step uses the current
    log-probs detached (old = current).
    """
    if algo.old_log_prob_source == "recompute":
        # R2 replays, and routing_change_frac compares with, the routes this forward records.
        record = algo.routing_replay == "r2" or algo.log_routing_change
        recompute_old_log_probs(engine, samples, record_routes=record)
    elif algo.old_log_prob_source == "rollout":
        for sample in samples:
            if sample.rollout_log_probs is None:
                raise RuntimeError(
                    "old_log_prob_source=rollout but the rollout engine returned no log-probs"
                )
            sample.old_log_probs = sample.rollout_log_probs
    if algo.needs_reference_model:
        set_reference_log_probs(engine, samples)


def recompute_old_log_probs(
    engine: TrainEngine, samples: list[TrainSample], *, record_routes: bool
) -> None:
    """``old_log_probs`` from one forward of the training engine (and, when ``record_routes``,
    the policy's native routes as ``old_routes``)."""
    old = engine.forward_log_probs(samples, record_routes=record_routes)
    for index, (sample, log_probs) in enumerate(zip(samples, old.log_probs)):
        sample.old_log_probs = log_probs
        if old.routes is not None:
            sample.old_routes = old.routes[index]
        if old.route_weights is not None:
            sample.old_route_weights = old.route_weights[index]


def set_reference_log_probs(engine: TrainEngine, samples: list[TrainSample]) -> None:
    """``ref_log_probs`` from one forward of the frozen reference model."""
    reference = engine.forward_log_probs(samples, reference=True)
    for sample, log_probs in zip(samples, reference.log_probs):
        sample.ref_log_probs = log_probs


# ----------------------------------------------------------------------------------------------
# Advantages
# ----------------------------------------------------------------------------------------------


def assign_advantages(
    samples: list[TrainSample],
    settings: AdvantageSettings,
    moments: RunningMoments,
    distillation: Optional[DistillationSettings] = None,
) -> dict[str, float]:
    """Compute advantages from rewards (same on every rank: every rank holds every sample),
    with the distillation teacher's term when ``distillation`` is set (the samples then carry
    ``teacher_log_probs``, and ``old_log_probs`` are the student's).

    Per-turn samples of one episode (an agent's, ``metadata["episode"]``) count as that one
    episode: their advantages are computed on its view (:func:`_episode_views`) and split back,
    so an episode of K turns weighs in its group as one episode, not K."""
    if any("episode" in sample.metadata for sample in samples):
        views, parts = _episode_views(samples)
        metrics = assign_advantages(views, settings, moments, distillation)
        for view, members in zip(views, parts):
            offset = 0
            for sample in members:
                if view.advantages.dim() == 0:
                    sample.advantages = view.advantages.clone()
                else:
                    length = sample.response_length
                    sample.advantages = view.advantages[offset : offset + length].clone()
                    offset += length
        return metrics
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    group_ids = torch.tensor([s.group_id for s in samples])
    lengths = torch.tensor([int(s.response_mask().sum()) for s in samples], dtype=torch.float64)
    if settings.per_turn:
        kl_inputs = _padded_turns(samples)
    elif settings.per_token:
        kl_inputs = _padded_log_probs(samples)
    else:
        kl_inputs = {}
    advantages, metrics = compute_advantages(
        rewards, group_ids, settings, response_lengths=lengths, running=moments, **kl_inputs
    )
    if distillation is not None:
        advantages, distillation_metrics = distillation_advantages(
            advantages, **_padded_teacher_inputs(samples), settings=distillation
        )
        metrics.update(distillation_metrics)
    if advantages.dim() == 2:
        for sample, token_advantages in zip(samples, advantages):
            sample.advantages = token_advantages[: sample.response_length].clone()
    else:
        for sample, advantage in zip(samples, advantages):
            sample.advantages = advantage.reshape(())
    values = torch.cat([s.advantages.reshape(-1).float() for s in samples])
    metrics.update({"advantage_mean": values.mean(), "advantage_abs_mean": values.abs().mean()})
    return {name: float(value) for name, value in metrics.items()}


def _episode_views(
    samples: list[TrainSample],
) -> tuple[list[TrainSample], list[list[TrainSample]]]:
    """One sample per episode: per-turn samples with the same ``metadata["episode"]`` become one
    view whose response is their responses one after another (masks, turns, log-probs
    likewise), with the episode's reward, turn rewards and group; other samples are their own
    view. Returns the views and, per view, the samples it stands for (in order)."""
    members: dict[object, list[TrainSample]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(sample.metadata.get("episode", ("sample", index)), []).append(sample)
    views = []
    for parts in members.values():
        if len(parts) == 1 and "episode" not in parts[0].metadata:
            views.append(parts[0])
            continue

        def joined(name: str, parts: list[TrainSample] = parts) -> Optional[torch.Tensor]:
            values = [getattr(part, name, None) for part in parts]
            return None if any(v is None for v in values) else torch.cat(values)

        view = TrainSample(
            tokens=torch.cat([part.tokens[part.prompt_length :] for part in parts]),
            prompt_length=0,
            group_id=parts[0].group_id,
            loss_mask=torch.cat([part.response_mask() for part in parts]),
            old_log_probs=joined("old_log_probs"),
            ref_log_probs=joined("ref_log_probs"),
            turns=joined("turns"),
            turn_rewards=parts[0].turn_rewards,
            reward=parts[0].reward,
        )
        teacher = joined("teacher_log_probs")
        if teacher is not None:
            view.teacher_log_probs = teacher
        views.append(view)
    return views, list(members.values())


def _padded_turns(samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    """The inputs of per-turn advantages, padded: ``turn_rewards``, ``turn_mask`` ``[B, K]``,
    ``token_turns``, ``response_mask`` ``[B, T]``. The part of a sample's reward that no turn
    holds (reward functions, length shaping) counts at its last turn; a sample without turns
    (one completion) is one turn."""
    turn_counts = [1 if s.turn_rewards is None else max(1, len(s.turn_rewards)) for s in samples]
    width = max(s.response_length for s in samples)
    turn_rewards = torch.zeros(len(samples), max(turn_counts), dtype=torch.float64)
    turn_mask = torch.zeros(len(samples), max(turn_counts), dtype=torch.bool)
    token_turns = torch.full((len(samples), width), -1, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, (sample, count) in enumerate(zip(samples, turn_counts)):
        parts = torch.zeros(count, dtype=torch.float64)
        if sample.turn_rewards is not None and len(sample.turn_rewards):
            parts[:] = sample.turn_rewards.double()
        parts[-1] += sample.reward - float(parts.sum())
        turn_rewards[row, :count] = parts
        turn_mask[row, :count] = True
        length = sample.response_length
        token_turns[row, :length] = 0 if sample.turns is None else sample.turns.long()
        mask[row, :length] = sample.response_mask()
    return {
        "turn_rewards": turn_rewards,
        "turn_mask": turn_mask,
        "token_turns": token_turns,
        "response_mask": mask,
    }


def _padded_teacher_inputs(samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    """The student's (old) and the teacher's log-probs and the response mask, ``[B, T]``
    padded (distillation)."""
    width = max(s.response_length for s in samples)
    student = torch.zeros(len(samples), width, dtype=torch.float64)
    teacher = student.clone()
    mask = torch.zeros(len(samples), width, dtype=torch.bool)
    for row, sample in enumerate(samples):
        if sample.teacher_log_probs is None or sample.old_log_probs is None:
            raise RuntimeError(
                "distillation needs every sample's teacher_log_probs (scored by the teacher's "
                "engine in the driver) and old_log_probs (the student's)"
            )
        length = sample.response_length
        student[row, :length] = sample.old_log_probs.double()
        teacher[row, :length] = sample.teacher_log_probs.double()
        mask[row, :length] = sample.response_mask()
    return {"student_log_probs": student, "teacher_log_probs": teacher, "response_mask": mask}


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
    engine: TrainEngine, samples: list[TrainSample], algo: AlgoConfig, *, seed: int, step: int
) -> dict[str, float]:
    """``ppo_epochs`` x ``num_mini_batches`` optimizer steps; metrics averaged over the steps
    (``*_max`` take the max, ``skipped`` counts)."""
    generator = torch.Generator().manual_seed(step_seed(seed, step))
    per_step: list[dict[str, float]] = []
    for _ in range(algo.ppo_epochs):
        for batch in mini_batches(samples, algo.num_mini_batches, generator):
            per_step.append(engine.train_step(batch))
    return reduce_step_metrics(per_step)


# ----------------------------------------------------------------------------------------------
# Supervised cold start
# ----------------------------------------------------------------------------------------------


def sft_warmup(engine: TrainEngine, driver: Driver, cfg: TrainConfig) -> dict[str, float]:
    """``sft_warmup_steps`` optimizer steps of maximum likelihood on reference answers.

    It reuses the policy update: with advantage 1 and old log-probs equal to the current ones,
    the clipped surrogate's gradient is the log-likelihood gradient (ratio 1 is inside any clip
    range), aggregated like the RL loss. Old log-probs are always recomputed (reference answers
    have no rollout log-probs). Returns the negative log-likelihood per token before the first
    and the last warm-up step (``sft_warmup_nll_first``, ``sft_warmup_nll_last``).
    """
    nll = []
    for _ in range(cfg.sft_warmup_steps):
        samples = driver.supervised_batch()
        # Reference answers have no routes to replay and no behaviour log-probs to correct by.
        with engine.native_routing(), engine.uncorrected(), engine.fixed_lr(cfg.sft_warmup_lr):
            recompute_old_log_probs(engine, samples, record_routes=False)
            if cfg.algo.needs_reference_model:  # the KL loss term needs them
                set_reference_log_probs(engine, samples)
            nll.append(float(-torch.cat([s.old_log_probs for s in samples]).mean()))
            engine.train_step(samples)
    if nll:
        logger.info("SFT warm-up: %d steps, NLL/token %.4f -> %.4f", len(nll), nll[0], nll[-1])
        return {"sft_warmup_nll_first": nll[0], "sft_warmup_nll_last": nll[-1]}
    return {}
