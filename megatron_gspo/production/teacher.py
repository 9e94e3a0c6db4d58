r"""On-policy distillation's teacher scores: a producer whose samples carry the teacher's
log-probs of their response tokens.

The student samples as in RL (any :class:`~megatron_gspo.production.producer.SampleProducer`);
then the teacher, behind its own engine (:mod:`megatron_gspo.rollout.roles`), scores every
sample's response teacher-forced (:meth:`RolloutEngine.score`: SGLang's prompt log-probs or the
embedded forward), in one call for the batch, at the student's sampling temperature, so that
both log-probs are of the same tempered distributions. The samples leave the producer with
``teacher_log_probs`` set, before the batch source broadcasts them, and the advantages stage
turns them into the reverse-KL term (:mod:`megatron_gspo.algo.distillation`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from megatron_gspo.production.producer import SampleProducer, ScoredSamples
from megatron_gspo.rollout import RolloutEngine
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.data.prompts import Prompt


class TeacherScoredProducer(SampleProducer):
    """``inner``'s samples, each with ``teacher_log_probs`` from ``teacher`` (module
    docstring). Metrics: ``time/teacher_s``, the teacher's scoring time."""

    def __init__(self, inner: SampleProducer, teacher: RolloutEngine, temperature: float):
        self.inner, self.teacher, self.temperature = inner, teacher, temperature
        self.group_size = inner.group_size

    def produce(
        self, prompts: Sequence[Prompt], step: int, *, first_index: int = 0
    ) -> ScoredSamples:
        produced = self.inner.produce(prompts, step, first_index=first_index)
        started = time.perf_counter()
        score_with_teacher(self.teacher, produced.samples, self.temperature)
        return ScoredSamples(
            produced.samples,
            {**produced.metrics, "time/teacher_s": time.perf_counter() - started},
        )


def score_with_teacher(
    teacher: RolloutEngine, samples: Sequence[TrainSample], temperature: float
) -> None:
    """Set every sample's ``teacher_log_probs`` (``[R]`` float32) from one scoring call of
    ``teacher``. A sample without response tokens gets an empty tensor."""
    if not samples:
        return
    prompts = [sample.tokens[: sample.prompt_length].tolist() for sample in samples]
    responses = [sample.tokens[sample.prompt_length :].tolist() for sample in samples]
    scores = teacher.score(prompts, responses, temperature=temperature)
    for sample, log_probs, response in zip(samples, scores, responses):
        if len(log_probs) != len(response):
            raise RuntimeError(
                f"the teacher returned {len(log_probs)} log-probs for a response of "
                f"{len(response)} tokens"
            )
        sample.teacher_log_probs = torch.as_tensor(log_probs, dtype=torch.float32)
