"""What the rollout driver asks of its batch source: each step's scored samples, and the part of
a weight sync that depends on how they are made.

The :class:`~megatron_gspo.driver.rollout_driver.RolloutDriver` (global rank 0) owns the task,
the rollout engine, the rewards and the logs, and takes each step's batch from one of two
sources:

- :class:`~megatron_gspo.driver.synchronous.SynchronousSource` (``rollout.max_staleness: 0``):
  the step's prompts are generated and scored when the step asks for them, with its weights;
- :class:`~megatron_gspo.driver.background.BackgroundSource` (``max_staleness >= 1``): a
  background thread generates ahead of training within the staleness bound (docs/async.md).

A source is built with what it uses (the run's sample producer, the prompt ledger, the rollout
engine, its settings), never with the driver, and runs on global rank 0 only. The driver calls
it in the loop's order: :meth:`~BatchSource.start`, then :meth:`~BatchSource.sync_weights`
(the initial weights), then per step :meth:`~BatchSource.next_batch`, :meth:`~BatchSource.sync_weights` and
:meth:`~BatchSource.run_totals`; :meth:`~BatchSource.stop` from the run's exit stack.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_gspo.driver.ledger import PromptLedger
from megatron_gspo.production.producer import SampleProducer
from megatron_gspo.rollout import RolloutEngine
from megatron_gspo.samples import TrainSample
from megatron_gspo.weight_sync import SyncStats


@dataclass
class StepBatch:
    """One step's batch as its source made it."""

    samples: list[TrainSample]
    """The step's scored samples, prompt-major (already sent to the other ranks)."""
    trained_prompts: list[int]
    """Stream ids (``Prompt.group_id``) of the prompts whose samples these are."""
    dropped_prompts: list[int] = field(default_factory=list)
    """Stream ids of prompts the step consumed without training them (the uninformative groups
    of DAPO's dynamic sampling)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The source's metrics of making the batch; the driver adds the batch's rollout metrics
    and the prompt stream's."""


class BatchSource(abc.ABC):
    """How global rank 0's driver gets each step's batch (see the module docstring)."""

    @abc.abstractmethod
    def start(self, step: int) -> None:
        """The run begins at RL step ``step``; the ledger is loaded (a resumed run's pending
        prompts re-queued). Nothing may be generated before the first :meth:`sync_weights` has
        given the engine the trainer's weights."""

    @abc.abstractmethod
    def next_batch(self, step: int) -> StepBatch:
        """Rank 0's side of the collective rollout of RL step ``step``: the step's batch, its
        samples sent to the other ranks, which wait in
        :func:`~megatron_gspo.driver.interface.broadcast_samples` (and stream the trainer's
        weights when they receive :data:`~megatron_gspo.driver.interface.WEIGHTS_WANTED`
        instead). Every prompt of ``trained_prompts`` and ``dropped_prompts`` was served by the
        ledger and is resolved once the step is marked trained."""

    @abc.abstractmethod
    def sync_weights(
        self, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> Optional[SyncStats]:
        """Hand the trainer's weight stream (Hugging Face names, full tensors) to the rollout
        engine as weight version ``version``, with whatever the source's requests in flight
        need (waited for, or paused in place). The sync's stats; None when no sync reached the
        engine (it failed and comes back without them: sent later)."""

    @abc.abstractmethod
    def run_totals(self) -> dict[str, float]:
        """The source's counts over the whole run (engine restarts, prompts generated again),
        read when a step's metrics line is written: a restart during the step's weight sync,
        after its batch was made, is in that step's line."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop what the source runs; called once, from the run's exit stack (registered after
        the rollout engine and the reward workers, so it runs before they stop)."""


BatchSourceFactory = Callable[
    [Optional[SampleProducer], PromptLedger, Optional[RolloutEngine]], BatchSource
]
"""Builds the driver's batch source from the run's sample producer, prompt ledger and rollout
engine (which the driver builds; :func:`~megatron_gspo.driver.build.build_rollout_driver`). A
replayed run (``rollout.replay_dir``) builds no producer and no engine: None."""
