"""One step's batch from a producer: one call, or DAPO dynamic sampling's rounds."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_gspo.config import TrainConfig
from megatron_gspo.production.producer import SampleProducer, ScoredSamples
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.stream import PromptStream


logger = logging.getLogger(__name__)


def collect_step_batch(
    producer: SampleProducer, stream: PromptStream, step: int, cfg: TrainConfig
) -> ScoredSamples:
    """The scored samples of RL step ``step``: ``algo.rollout_batch_size`` prompts from
    ``stream``, produced once; with ``algo.dynamic_sampling``, :func:`collect_informative_groups`.
    """
    if cfg.algo.dynamic_sampling:
        return collect_informative_groups(
            producer,
            stream,
            step,
            num_groups=cfg.algo.rollout_batch_size,
            max_rounds=cfg.algo.dynamic_sampling_max_rounds,
        )
    prompts = stream.next_batch(cfg.algo.rollout_batch_size)
    return producer.produce(prompts, step)


def is_informative(group: Sequence[TrainSample]) -> bool:
    """Whether a group carries signal: the rewards of its samples (aborted ones have groups of
    their own and are left out) are not all equal, and some sample is trained on. Otherwise
    every group-relative advantage of it is 0."""
    members = [s for s in group if s.finish_reason != "abort"]
    trained = any(bool(s.response_mask().any()) for s in members)
    return trained and len({s.reward for s in members}) > 1


def collect_informative_groups(
    producer: SampleProducer,
    stream: PromptStream,
    step: int,
    *,
    num_groups: int,
    max_rounds: int,
) -> ScoredSamples:
    """DAPO dynamic sampling: ``num_groups`` informative groups (:func:`is_informative`).

    Round 1 produces ``num_groups`` prompts; each further round produces the missing number of
    groups divided by the share kept so far (at most ``num_groups``, at least the number
    missing). Informative groups are kept in the order they were produced; once there are
    enough, the surplus of the last round is dropped. Every prompt drawn from ``stream`` is
    consumed, kept or not (the stream's position moves past it, so a resumed run never serves it
    again). After ``max_rounds`` a short batch is filled with the latest dropped groups.

    Metrics (``dynamic_sampling/``): ``rounds``, ``prompts_consumed``, ``kept_group_frac`` (kept
    informative groups / groups produced), ``informative_group_frac`` (informative / produced),
    ``filled_groups``, ``reward_mean_produced`` (the mean reward before filtering: the batch's
    ``reward_mean`` is of the kept groups only). The producers' metrics are merged over rounds
    (:func:`merge_round_metrics`).
    """
    group_size = producer.group_size
    kept: list[list[TrainSample]] = []
    dropped: list[list[TrainSample]] = []
    parts: list[tuple[dict[str, float], int]] = []
    produced_groups = informative_groups = 0
    reward_sum = 0.0
    rounds = 0
    while len(kept) < num_groups and rounds < max_rounds:
        missing = num_groups - len(kept)
        if rounds == 0:
            count = num_groups
        else:
            share = max(informative_groups / produced_groups, 1.0 / num_groups)
            count = min(num_groups, max(missing, math.ceil(missing / share)))
        prompts = stream.next_batch(count)
        scored = producer.produce(prompts, step, first_index=produced_groups)
        rounds += 1
        parts.append((scored.metrics, len(scored.samples)))
        reward_sum += sum(s.reward for s in scored.samples)
        for index in range(len(prompts)):
            group = scored.samples[index * group_size : (index + 1) * group_size]
            if is_informative(group):
                informative_groups += 1
                (kept if len(kept) < num_groups else dropped).append(group)
            else:
                dropped.append(group)
        produced_groups += len(prompts)
    filled = 0
    while len(kept) < num_groups:
        kept.append(dropped.pop())
        filled += 1
    if filled:
        logger.warning(
            "dynamic sampling: only %d of %d groups were informative after %d rounds (%d prompts); "
            "filled the batch with %d groups whose rewards are all equal (advantage 0). Raise "
            "algo.dynamic_sampling_max_rounds, or check that the task is neither too hard nor "
            "too easy for the policy",
            num_groups - filled,
            num_groups,
            rounds,
            produced_groups,
            filled,
        )
    metrics = merge_round_metrics(parts)
    metrics.update(
        {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/prompts_consumed": float(produced_groups),
            "dynamic_sampling/kept_group_frac": (num_groups - filled) / produced_groups,
            "dynamic_sampling/informative_group_frac": informative_groups / produced_groups,
            "dynamic_sampling/filled_groups": float(filled),
            "dynamic_sampling/reward_mean_produced": reward_sum / (produced_groups * group_size),
        }
    )
    return ScoredSamples([sample for group in kept for sample in group], metrics)


_SUMMED_SUFFIXES = (
    "_errors",
    "_failures",
    "_timeouts",
    "_seconds",
    "_s",
    "_count",
    "_all_failed",
)


def merge_round_metrics(parts: Sequence[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of several :meth:`SampleProducer.produce` calls as one: counts and times
    (names ending in ``_errors``, ``_failures``, ``_timeouts``, ``_seconds``, ``_s``,
    ``_count``, ``_all_failed``) summed, ``*_min`` / ``*_max`` the extreme, the rest averaged weighted by
    each call's samples."""
    if len(parts) == 1:
        return dict(parts[0][0])
    names = list(dict.fromkeys(name for metrics, _ in parts for name in metrics))
    merged: dict[str, float] = {}
    for name in names:
        present = [(metrics[name], weight) for metrics, weight in parts if name in metrics]
        values = [value for value, _ in present]
        if name.endswith(_SUMMED_SUFFIXES):
            merged[name] = float(sum(values))
        elif name.endswith("_min"):
            merged[name] = float(min(values))
        elif name.endswith("_max"):
            merged[name] = float(max(values))
        else:
            total = sum(weight for _, weight in present)
            merged[name] = float(sum(v * w for v, w in present) / total) if total else 0.0
    return merged
