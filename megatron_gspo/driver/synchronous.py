"""The synchronous batch source (``rollout.max_staleness: 0``): a step's prompts are generated and
scored when the step asks for them, with the weights the step trains.

A rollout engine that stops answering during a step's generation or a weight sync is brought
back as in asynchronous training (:mod:`~megatron_gspo.driver.recovery`): restarted or waited
for within ``rollout.engine_restart_timeout_s``, given the newest weights (the transport's copy,
or the trainer's, every rank streaming them), and the step's prompts are generated again with
the step's seeds, so that the batch is the one an uninterrupted run trains (where the engine
is deterministic). If it cannot come back, every rank raises
:class:`~megatron_gspo.runtime.health.RolloutEngineLost` at the rollout and the loop saves a
checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Optional

from megatron_gspo.config import TrainConfig
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.driver.interface import broadcast_samples
from megatron_gspo.driver.ledger import PromptLedger
from megatron_gspo.driver.recovery import (
    TrainerWeights,
    broadcast_failure,
    recover_engine,
    send_trainer_weights,
    sync_recovering,
)
from megatron_gspo.driver.source import BatchSource, StepBatch
from megatron_gspo.production.producer import SampleProducer, ScoredSamples
from megatron_gspo.production.step_batch import collect_step_batch
from megatron_gspo.rollout import RolloutEngine, RolloutEngineError
from megatron_gspo.runtime.health import RolloutEngineLost
from megatron_gspo.weight_sync import SyncStats

logger = logging.getLogger(__name__)


class SynchronousSource(BatchSource):
    """Each step's batch from the ledger's prompts (re-queued ones first), made by the run's
    producer when the step asks: one call, or DAPO dynamic sampling's rounds
    (:func:`~megatron_gspo.production.step_batch.collect_step_batch`, with ``cfg``'s algorithm
    settings). The engine generates nothing between steps, so a sync just pauses it.

    ``weights`` streams the trainer's current weights (collective, as the background
    source's): asked for when a restarted server waits for them and the weight transport
    keeps no copy (``tensor``, ``distributed``)."""

    def __init__(
        self,
        producer: SampleProducer,
        ledger: PromptLedger,
        rollout_engine: RolloutEngine,
        cfg: TrainConfig,
        weights: Optional[TrainerWeights] = None,
    ):
        self.producer = producer
        self.ledger = ledger
        self.rollout_engine = rollout_engine
        self.cfg = cfg
        self.weights = weights
        self.release_memory = cfg.rollout.sglang.release_memory
        self.restart_timeout_s = cfg.rollout.engine_restart_timeout_s
        self.engine_restarts = 0
        """Recoveries that brought a server back (a run total, logged from the first on)."""
        self.error: Optional[RolloutEngineLost] = None
        """A weight sync's engine that could not come back: raised by the next rollout, where
        every rank learns it (the sync itself is not where the other ranks can be told)."""

    def start(self, step: int) -> None:
        pass  # each step draws its own prompts

    def next_batch(self, step: int) -> StepBatch:
        drawn = _DrawnPrompts(self.ledger)
        try:
            produced = self._produce(drawn, step)
        except RolloutEngineLost as lost:
            # The other ranks wait for the batch: they raise the same stop, and the loop saves
            # a checkpoint on every rank. (Other errors stop rank 0 as they always did.)
            broadcast_failure(lost)
            raise
        trained = list(dict.fromkeys(s.group_id for s in produced.samples if s.group_id >= 0))
        # Every prompt drawn for a synchronous step is resolved by it: trained, or dropped by
        # dynamic sampling (its groups all aborted, it was not trained either).
        dropped = [prompt.group_id for prompt in drawn.prompts if prompt.group_id not in trained]
        if self.release_memory:
            # Colocated servers give their GPU memory to the trainer until the weight sync.
            self.rollout_engine.release_memory()
        samples = broadcast_samples(produced.samples)
        return StepBatch(samples, trained, dropped, dict(produced.metrics))

    def _produce(self, drawn: _DrawnPrompts, step: int) -> ScoredSamples:
        """The step's scored samples; after a failed engine is back, the same prompts again
        (the same seeds: derived from the step and each prompt's position in it)."""
        if self.error is not None:
            raise self.error
        while True:
            if self.rollout_engine.needs_full_sync:
                # A restarted server without the trainer's weights: the weights of this step.
                send_trainer_weights(self.weights, step, self.sync_weights)
                if self.error is not None:
                    raise self.error
            try:
                return collect_step_batch(self.producer, drawn, step, self.cfg)
            except RolloutEngineError as error:
                logger.warning(
                    "rollout engine failed (%s): bringing it back, then generating step %d's "
                    "prompts again",
                    error,
                    step,
                )
                self._recover(error)
                drawn.replay()

    def _recover(self, error: Exception) -> Optional[SyncStats]:
        stats, restarted = recover_engine(self.rollout_engine, error, self.restart_timeout_s)
        if restarted:
            self.engine_restarts += 1
        return stats

    def sync_weights(
        self, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> Optional[SyncStats]:
        try:
            return sync_recovering(self.rollout_engine, named_tensors, version, self._recover)
        except RolloutEngineLost as lost:
            self.error = lost
            return None

    def run_totals(self) -> dict[str, float]:
        return {"engine_restarts": float(self.engine_restarts)} if self.engine_restarts else {}

    def stop(self) -> None:
        pass  # nothing runs between steps


class _DrawnPrompts:
    """The prompt source of one synchronous step: the ledger's prompts (re-queued ones first),
    remembering which it served; after :meth:`replay` it serves the same ones again, in the
    same order, before taking more (a step generated again after an engine failure)."""

    def __init__(self, ledger: PromptLedger):
        self.ledger = ledger
        self.prompts: list[Prompt] = []
        self.served = 0
        """How many of ``prompts`` the current attempt has served."""

    def next_batch(self, batch_size: int) -> list[Prompt]:
        prompts = self.prompts[self.served : self.served + batch_size]
        if len(prompts) < batch_size:
            taken = self.ledger.take(batch_size - len(prompts))
            self.prompts += taken
            prompts += taken
        self.served += len(prompts)
        return prompts

    def replay(self) -> None:
        self.served = 0
