"""Sample production: scored samples from prompts (rank 0, no Megatron).

One batch-level call, :meth:`SampleProducer.produce` (:mod:`~megatron_gspo.production.producer`,
which states the contract): prompts and the RL step in, scored samples and the metrics of making
them out. :class:`SingleTurnProducer` makes one completion per sample; :class:`EnvironmentProducer`
runs an environment's episodes (:mod:`~megatron_gspo.production.episodes`, within the limits of
an :class:`EpisodeSettings`). How they sample (every request parameter, the seeds, and the
:class:`FinishSettings` applied to the scored samples) is a :class:`Sampling`; what they sample
from is the run's :class:`Task`; one step's batch, with DAPO dynamic sampling, is
:func:`collect_step_batch`. Producers take these, never the run's configuration: each is built
from it once.
"""

from megatron_gspo.production.episodes import EnvironmentProducer, EpisodeSettings
from megatron_gspo.production.producer import SampleProducer, ScoredSamples
from megatron_gspo.production.sampling import FinishSettings, Sampling
from megatron_gspo.production.single_turn import SingleTurnProducer
from megatron_gspo.production.step_batch import collect_step_batch
from megatron_gspo.production.task import Task, build_task

__all__ = [
    "EnvironmentProducer",
    "EpisodeSettings",
    "FinishSettings",
    "SampleProducer",
    "Sampling",
    "ScoredSamples",
    "SingleTurnProducer",
    "Task",
    "build_task",
    "collect_step_batch",
]
