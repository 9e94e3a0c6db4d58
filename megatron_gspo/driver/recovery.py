"""Bringing back a rollout engine that stopped answering, for both batch sources.

A killed or crashed server surfaces as :class:`~megatron_gspo.rollout.RolloutEngineError`
during a generation or a weight sync. Both sources (synchronous and background) then do the
same (docs/async.md, "A rollout engine that dies"):

- :func:`recover_engine`: :meth:`RolloutEngine.recover` within
  ``rollout.engine_restart_timeout_s`` (restart the servers this run launched, wait for the
  others, send the transport's copy of the newest weights again), or
  :class:`~megatron_gspo.runtime.health.RolloutEngineLost`;
- a sync that failed: :func:`sync_recovering` drains the trainer's stream (the other ranks
  gather all of it, whatever rank 0 does), recovers, and gives the engine the sync's version:
  the transport's copy, the stream's pairs when the engine failed before taking any, or, when
  neither exists, nothing yet: the engine then waits for the trainer's weights
  (:attr:`RolloutEngine.needs_full_sync`);
- :func:`send_trainer_weights`: a restarted server that waits for them gets the trainer's
  current weights at the next rollout, every rank streaming them (rank 0 broadcasts
  :data:`~megatron_gspo.driver.interface.WEIGHTS_WANTED` instead of a batch);
- :func:`broadcast_failure`: when the run has to stop, the other ranks, waiting for the batch,
  raise the same stop.

Which samples are generated again is the source's: the synchronous one generates the step's
prompts again with the step's seeds, the background one re-queues the lost chunk's prompts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

from megatron_gspo.driver.interface import WEIGHTS_WANTED, broadcast_samples
from megatron_gspo.rollout import RolloutEngine, RolloutEngineError, sync_weights_paused
from megatron_gspo.runtime.health import RolloutEngineLost
from megatron_gspo.weight_sync import StableTensorStream, SyncStats

logger = logging.getLogger(__name__)

TrainerWeights = Callable[[], Iterator[tuple[str, Any]]]
"""Streams the trainer's current weights (Hugging Face names, full tensors); collective: every
rank calls it at the same point (the training engine's ``hf_weights``)."""


def engine_lost(error: Exception, failure: Exception, timeout_s: float) -> RolloutEngineLost:
    """The stop of a run whose engine failed with ``error`` and could not be brought back
    (``failure``) within ``timeout_s``."""
    return RolloutEngineLost(
        f"the rollout engine failed ({error}) and did not come back within "
        f"rollout.engine_restart_timeout_s={timeout_s:.0f}s: {failure}",
        "without an engine no samples can be generated",
        "check the rollout server's log; the checkpoint saved now resumes the run with "
        "resume=true (its untrained prompts are generated again)",
    )


def recover_engine(
    engine: RolloutEngine, error: Exception, timeout_s: float
) -> tuple[Optional[SyncStats], bool]:
    """Bring ``engine`` back after ``error`` with the newest weights it was sent: the stats of
    the weights sent again (None when nothing was sent) and whether a server came back (it
    took the newest weights again, or waits for the trainer's). Raises
    :class:`RolloutEngineLost` when the engine cannot come back within ``timeout_s``."""
    try:
        stats = engine.recover(timeout_s)
    except RolloutEngineError as failure:
        raise engine_lost(error, failure, timeout_s) from None
    return stats, stats is not None or engine.needs_full_sync


class CountedStream:
    """A weight stream that counts the pairs taken from it (a stable stream stays stable)."""

    def __init__(self, named_tensors: Iterator[tuple[str, Any]]):
        self.named_tensors = named_tensors
        self.taken = 0

    def pairs(self) -> Iterator[tuple[str, Any]]:
        def counted() -> Iterator[tuple[str, Any]]:
            for pair in self.named_tensors:
                self.taken += 1
                yield pair

        stable = isinstance(self.named_tensors, StableTensorStream)
        return StableTensorStream(counted()) if stable else counted()


def sync_recovering(
    engine: RolloutEngine,
    named_tensors: Iterator[tuple[str, Any]],
    version: int,
    recover: Callable[[Exception], Optional[SyncStats]],
    *,
    pause_mode: str = "abort",
    recovering: Optional[contextlib.AbstractContextManager] = None,
) -> Optional[SyncStats]:
    """:func:`sync_weights_paused`, and after a :class:`RolloutEngineError` the recovery: the
    engine brought back (``recover``, inside ``recovering``: the background source keeps its
    producer off the engine meanwhile) and given weight ``version``. The sync's stats, or None
    when the engine waits for the trainer's weights (its transport keeps no copy and it had
    taken part of the stream: :func:`send_trainer_weights` at the next rollout). Raises
    :class:`RolloutEngineLost` when the engine cannot come back."""
    stream = CountedStream(named_tensors)
    try:
        return sync_weights_paused(engine, stream.pairs(), version, pause_mode=pause_mode)
    except RolloutEngineError as error:
        # The other ranks gather the whole stream: drain it, whatever this rank does; kept when
        # the engine failed before taking any of it (sent after the restart).
        untouched = stream.taken == 0
        remaining = list(named_tensors)
        logger.warning("weight sync failed (%s): bringing the engine back", error)
        with recovering or contextlib.nullcontext():
            return _weights_after_recovery(
                engine, error, version, remaining if untouched else None, recover, pause_mode
            )


def _weights_after_recovery(
    engine: RolloutEngine,
    error: Exception,
    version: int,
    weights: Optional[list[tuple[str, Any]]],
    recover: Callable[[Exception], Optional[SyncStats]],
    pause_mode: str,
) -> Optional[SyncStats]:
    stats = recover(error)
    if engine.weight_version == version:
        # The transport's copy was this version's: resent, or every server had it.
        return stats if stats is not None else SyncStats(version, 0, 0, 0.0)
    if weights is None and engine.needs_full_sync:
        # The trainer's next rollout sends its weights (send_trainer_weights); nothing is
        # generated until then.
        return None
    if weights is None:
        raise RolloutEngineLost(
            f"the rollout engine failed during the sync of weight version {version} "
            f"({error}) after taking part of it, and its transport keeps no copy",
            "the engine would generate with older weights than the trainer's",
            "resume from the checkpoint saved now (resume=true)",
        )
    try:
        return sync_weights_paused(engine, StableTensorStream(weights), version, pause_mode)
    except RolloutEngineError as failure:
        raise RolloutEngineLost(
            f"the rollout engine failed during the sync of weight version {version} ({error}) "
            f"and again when it was sent after the recovery: {failure}",
            "the engine would generate with older weights than the trainer's",
            "check the rollout server's log; resume from the checkpoint saved now (resume=true)",
        ) from None


def send_trainer_weights(
    weights: Optional[TrainerWeights],
    version: int,
    sync: Callable[[Iterator[tuple[str, Any]], int], Any],
) -> None:
    """Send the trainer's current weights (``version``) to servers that came back without them,
    through ``sync`` (the source's own weight sync); every rank takes part (the stream is
    collective), told so by the broadcast. Rank 0 calls it where the other ranks wait for a
    batch (``DriverFollower.rollout``)."""
    if weights is None:
        raise RolloutEngineLost(
            "a restarted rollout server waits for the trainer's weights, and this driver "
            "was given no way to ask for them",
            "the weight transport keeps no copy to send again",
            "use rollout.weight_transport=disk, or resume from the checkpoint saved now",
        )
    logger.warning("sending weight version %d to the restarted rollout servers", version)
    broadcast_samples(WEIGHTS_WANTED)
    sync(weights(), version)


def broadcast_failure(error: BaseException) -> None:
    """Tell the other ranks, waiting in the batch broadcast, that rank 0 stops (they raise the
    same lost-engine stop, or a RuntimeError naming rank 0's error)."""
    if isinstance(error, RolloutEngineLost):
        broadcast_samples(error)
    else:
        broadcast_samples(RuntimeError(f"rank 0's rollout failed: {type(error).__name__}: {error}"))
