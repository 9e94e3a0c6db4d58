"""The batch source of ``rollout.replay_dir``: each step trains the batch a run recorded
(``rollout.save_rollouts``) instead of generating one (docs/rollout-replay.md).

Nothing is generated or scored, so a training bug can be bisected without the engine's
randomness: the same samples fed to another loss, layout or precision. With the recording's own
settings the replayed run's metrics are the recording's, bit for bit (the recorded metrics of the
rollout, the prompt stream's statistics among them, are the step's; what the loop computes from
the samples is computed again). The weight syncs go nowhere: the trainer's weight stream is
drained, as every rank streams it collectively, and no engine takes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from megatron_gspo.driver.interface import broadcast_samples
from megatron_gspo.driver.ledger import PromptLedger
from megatron_gspo.driver.recovery import broadcast_failure
from megatron_gspo.driver.source import BatchSource, BatchSourceFactory, StepBatch
from megatron_gspo.samples.recorded_batch import read_recorded_batch
from megatron_gspo.weight_sync import SyncStats


class ReplaySource(BatchSource):
    """Step ``s``'s batch is the recorded file ``step_<s>`` of ``directory``; its prompts are
    marked pending in ``ledger`` (not served by this run's stream) so that the step's line of
    ``trained_prompts.jsonl`` is the recording's."""

    def __init__(self, ledger: PromptLedger, *, directory: Path):
        self.ledger = ledger
        self.directory = directory

    @classmethod
    def factory(cls, directory: Path) -> BatchSourceFactory:
        """The driver's source factory: the replay needs neither producer nor engine."""
        return lambda producer, ledger, rollout_engine: cls(ledger, directory=directory)

    def start(self, step: int) -> None:
        pass  # each step reads its own file

    def next_batch(self, step: int) -> StepBatch:
        started = time.monotonic()
        try:
            recorded = read_recorded_batch(self.directory, step)
            self.ledger.take_recorded([*recorded.trained_prompts, *recorded.dropped_prompts])
        except BaseException as error:
            broadcast_failure(error)  # the other ranks wait for the batch: they stop too
            raise
        samples = broadcast_samples(recorded.samples)
        metrics = {**recorded.metrics, "replay_read_s": time.monotonic() - started}
        return StepBatch(samples, recorded.trained_prompts, recorded.dropped_prompts, metrics)

    def sync_weights(
        self, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> Optional[SyncStats]:
        for _ in named_tensors:  # every rank streams its part; nothing takes it
            pass
        return None

    def run_totals(self) -> dict[str, float]:
        return {}  # nothing is generated again

    def stop(self) -> None:
        pass
