r"""Sample production: scored samples from prompts (rank 0, no Megatron).

The unit of production is one batch-level call, :meth:`SampleProducer.produce`: a list of
prompts and the RL step in, their scored :class:`TrainSample`\ s and the metrics of producing
them out. Who calls it decides when and how often: the synchronous driver once per step
(:func:`collect_step_batch`), a wrapper that filters and calls again for more prompts, or a
background producer that runs ahead of training.

Contract of :meth:`SampleProducer.produce`:

- samples are prompt-major: ``group_size`` samples per prompt, in the order of the prompts;
  sample ``j`` of prompt ``i`` is ``samples[i * group_size + j]``;
- every sample is scored (``reward`` set) and carries its prompt's ``group_id``, except an
  aborted one, which keeps an empty loss mask and a group of its own (counted, never trained);
- sampling seeds derive from (run seed, ``step``, ``first_index + i``) for prompt ``i``
  (:meth:`~megatron_gspo.production.sampling.Sampling.prompt_seed`), so the same call gives the
  same samples (and a resumed run samples what the uninterrupted one would);
  ``first_index`` is the position of ``prompts[0]`` among the prompts of the step, which keeps
  a second call of the same step (more prompts for dynamic sampling) from reusing seeds;
- rewards are final: the length shaping and the truncation mask of :func:`finish_samples` are
  applied (when the producer's sampling has finishing rules: training's, not evaluation's);
- the metrics hold ``time/rollout_s`` (generation) and ``time/reward_s`` (scoring) and the
  reward runner's counts (``reward_errors``, ...), never the batch statistics that the caller
  computes on the final batch (``reward_mean``, lengths: :func:`megatron_gspo.metrics.
  rollout_metrics`).

:class:`SingleTurnProducer` is one completion per sample (:func:`generate` then :func:`score`).
:func:`collect_step_batch` makes one step's batch: one call, or with ``algo.dynamic_sampling``
calls for more prompts until the batch holds ``rollout_batch_size`` informative groups.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from megatron_gspo.reward.shaping import overlong_penalty
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt
    from megatron_gspo.production.sampling import FinishSettings


logger = logging.getLogger(__name__)


@dataclass
class ScoredSamples:
    """What one :meth:`SampleProducer.produce` call (or one step's collection) made."""

    samples: list[TrainSample]
    """Prompt-major, ``group_size`` per prompt (module docstring)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``time/rollout_s``, ``time/reward_s``, the reward runner's counts and the producer's own
    metrics (e.g. ``env/...``)."""


class SampleProducer(abc.ABC):
    """Prompts in, scored samples out (the contract of the module docstring)."""

    group_size: int
    """Samples per prompt."""

    @abc.abstractmethod
    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        """The scored samples of ``prompts`` at RL step ``step``."""


def finish_samples(samples: Sequence[TrainSample], settings: FinishSettings) -> dict[str, float]:
    """After scoring: DAPO's over-long penalty added to the rewards (``reward.overlong_buffer``)
    and truncated responses kept out of the loss (``algo.mask_truncated``); their metrics (none
    when both are off). Aborted samples are left as they are (already out of the loss)."""
    metrics: dict[str, float] = {}
    live = [s for s in samples if s.finish_reason != "abort"]
    if settings.overlong_buffer and samples:
        penalties = []
        for sample in live:
            penalty = overlong_penalty(
                sample.response_length,
                settings.response_length,
                settings.overlong_buffer,
                settings.overlong_penalty_factor,
            )
            sample.reward += penalty
            penalties.append(penalty)
        metrics["reward_overlong_penalty_mean"] = sum(penalties) / len(samples)
        metrics["reward_overlong_penalized_frac"] = sum(p < 0 for p in penalties) / len(samples)
    if settings.mask_truncated and samples:
        truncated = [s for s in live if s.finish_reason == "length"]
        for sample in truncated:
            sample.loss_mask = torch.zeros(sample.response_length, dtype=torch.bool)
        metrics["truncated_masked_frac"] = len(truncated) / len(samples)
    return metrics


def aborted_group_id(sample_index: int) -> int:
    """The group of its own of an aborted sample: negative, so it never meets a prompt's group
    (prompt group ids are stream positions, >= 0); ``sample_index`` counts the samples of the
    step."""
    return -1 - sample_index


def count_aborted(samples: Sequence[TrainSample]) -> int:
    """Samples whose generation was aborted (finish reason ``abort``)."""
    return sum(sample.finish_reason == "abort" for sample in samples)


def warn_aborted(
    samples: Sequence[TrainSample],
    what: str = "rollout samples",
    consequence: str = "they are kept out of the loss",
) -> None:
    """Warn that ``samples``, which the caller uses, hold aborted ones (``what`` names them,
    ``consequence`` says what their abort means there).

    Called where samples are used (the driver, for each batch a step trains; evaluation),
    never by the producers: a producer cannot tell whether its samples will be used. The
    background source generates a group with an aborted sample again (``requeued_lost``),
    and the chunk it has in flight when the run stops is aborted and never trained: neither
    is a warning about training."""
    aborted = count_aborted(samples)
    if aborted:
        logger.warning("%d of %d %s were aborted; %s", aborted, len(samples), what, consequence)
