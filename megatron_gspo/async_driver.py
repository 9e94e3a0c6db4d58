"""Asynchronous training: the rollout engine generates the next steps' samples while the trainer
updates, within a staleness bound (``rollout.max_staleness``, docs/async.md).

The loop does not change: it asks the :class:`AsyncRolloutDriver` for a step's batch, trains on
it and hands it the new weights, as it does the synchronous driver. Behind that interface:

- a :class:`BackgroundProducer` thread takes prompts from the :class:`~megatron_gspo.ledger.
  PromptLedger` (re-queued ones first) in chunks of ``rollout_batch_size``, generates and scores
  them and puts the groups into a :class:`StalenessBuffer`. It may start a chunk only while
  ``trained + buffered + in flight + chunk <= (engine version + max_staleness + 1) * batch``
  (AReaL's capacity rule, in groups), so a chunk started at engine version ``w`` is trained at
  step ``<= w + max_staleness``;
- ``rollout(v)`` takes ``rollout_batch_size`` groups whose every token was sampled by weights of
  version ``>= v - max_staleness``; older groups go back to the ledger (re-queued, counted), so
  nothing is trained stale and nothing is dropped;
- ``sync_weights`` does not wait for the requests in flight (``rollout.partial_rollouts``):
  they are paused in place, the weights swapped between two decode steps, and they continue;
  every token keeps the version and log-prob that sampled it (``TrainSample.
  rollout_weight_versions`` / ``rollout_log_probs``) and, for R3, the routes of the forward that
  processed it;
- a rollout engine that stops answering is brought back (:meth:`RolloutEngine.recover`:
  restarted or waited for, then given the newest weights) and the prompts of the lost requests
  are generated again; if it cannot come back within ``rollout.engine_restart_timeout_s`` every
  rank raises :class:`~megatron_gspo.health.RolloutEngineLost` and the loop saves a checkpoint.

With ``max_staleness: 0`` the synchronous :class:`~megatron_gspo.driver.RolloutDriver` runs;
this driver with a bound of 0 produces exactly its batches (tests/async_training/).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from megatron_gspo.config import TrainConfig
from megatron_gspo.driver import (
    WEIGHTS_WANTED,
    RolloutBatch,
    RolloutDriver,
    broadcast_samples,
)
from megatron_gspo.health import RolloutEngineLost, RunStopped
from megatron_gspo.metrics import rollout_metrics, staleness_metrics
from megatron_gspo.production import merge_round_metrics
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from contextlib import ExitStack

    from megatron_gspo.data.prompts import Prompt

logger = logging.getLogger(__name__)


@dataclass
class ScoredGroup:
    """The scored samples of one prompt (its GRPO group), as the producer made them."""

    prompt: Prompt
    samples: list[TrainSample]
    chunk: int
    """Index of the producer chunk that generated it (its sampling seeds derive from it)."""

    @property
    def oldest_version(self) -> int:
        """The oldest weight version that sampled a token of the group."""
        return min(sample.weight_version for sample in self.samples)


class StalenessBuffer:
    """Generated groups waiting to be trained, oldest first (no locking: the producer's).

    ``take(version, count)`` hands out ``count`` groups whose every token was sampled by weights
    ``>= version - max_staleness`` and removes the groups that can no longer meet the bound (the
    caller re-queues their prompts): versions only grow, so a group too old now stays too old.
    """

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness
        self.groups: list[ScoredGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def put(self, groups: list[ScoredGroup]) -> None:
        self.groups.extend(groups)

    def take(
        self, version: int, count: int
    ) -> tuple[Optional[list[ScoredGroup]], list[ScoredGroup]]:
        """``(batch or None when fewer than count fresh groups wait, stale groups removed)``."""
        oldest_allowed = version - self.max_staleness
        stale = [group for group in self.groups if group.oldest_version < oldest_allowed]
        self.groups = [group for group in self.groups if group.oldest_version >= oldest_allowed]
        if len(self.groups) < count:
            return None, stale
        batch, self.groups = self.groups[:count], self.groups[count:]
        return batch, stale


@dataclass
class _Chunk:
    """What one :meth:`~megatron_gspo.production.SampleProducer.produce` call made."""

    groups: list[ScoredGroup]
    lost: list[Prompt]
    """Prompts with an aborted sample: generated again."""
    metrics: dict[str, float]
    """The producer's metrics (``time/rollout_s``, ``time/reward_s``, reward counts)."""
    num_samples: int


@dataclass
class _Window:
    """The producer's busy intervals, to measure overlap with training (monotonic seconds)."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    busy_since: Optional[float] = None

    def busy_within(self, start: float, end: float) -> float:
        """Seconds the producer was generating or scoring within ``[start, end]``."""
        spans = list(self.intervals)
        if self.busy_since is not None:
            spans.append((self.busy_since, end))
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)

    def forget_before(self, moment: float) -> None:
        self.intervals = [(a, b) for a, b in self.intervals if b > moment]


class BackgroundProducer:
    """The background thread that keeps the rollout engine busy (see the module docstring).

    All shared state lives under one condition variable; the thread never touches
    ``torch.distributed`` (only global rank 0 runs it, and the collectives are the loop's).
    """

    def __init__(self, driver: AsyncRolloutDriver):
        cfg = driver.cfg
        self.driver = driver
        self.batch_size = cfg.algo.rollout_batch_size
        self.max_staleness = cfg.rollout.max_staleness
        self.restart_timeout_s = cfg.rollout.engine_restart_timeout_s
        self.buffer = StalenessBuffer(self.max_staleness)
        self.condition = threading.Condition()
        self.generating = threading.RLock()
        """Held during a produce call: a sync without partial rollouts takes it to wait for the
        requests in flight, and a recovery started by the trainer's thread to keep the producer
        off a restarted server until it has the newest weights again."""
        self.window = _Window()
        self.engine_version: Optional[int] = None
        self.steps_taken = 0
        """Batches the trainer has taken (its weight version when it takes the next)."""
        self.in_flight = 0
        self.next_chunk = 0
        self.error: Optional[BaseException] = None
        self.stopping = False
        self.counts = {"requeued_stale": 0, "requeued_lost": 0, "engine_restarts": 0}
        self.pending_metrics: list[_Chunk] = []
        """Chunks made since the trainer last took a batch (their reward and time metrics)."""
        self.thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the trainer's side

    def start(self, step: int, version: int) -> None:
        """Begin producing for RL step ``step`` with the engine at weight ``version``."""
        self.steps_taken = self.next_chunk = step
        self.engine_version = version
        self.thread = threading.Thread(target=self._run, name="sample-producer", daemon=True)
        self.thread.start()

    def set_engine_version(self, version: int) -> None:
        with self.condition:
            self.engine_version = version
            self.condition.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.condition:
            if self.error is None:
                self.error = error
            self.condition.notify_all()

    def take(
        self, version: int, resync: Callable[[], None]
    ) -> tuple[list[ScoredGroup], float, list[_Chunk]]:
        """Block until ``batch_size`` groups fresh enough for weight ``version`` wait; returns
        them, the seconds waited and the chunks made since the last take. ``resync`` sends the
        trainer's weights, for a restarted server that waits for them (the producer cannot
        generate until then)."""
        started = time.monotonic()
        with self.condition:
            while True:
                if self.error is not None:
                    raise self.error
                batch, stale = self.buffer.take(version, self.batch_size)
                if stale:
                    self._requeue([group.prompt for group in stale], "requeued_stale")
                    self.condition.notify_all()  # room for the producer to make fresh ones
                if batch is not None:
                    self.steps_taken += 1
                    chunks, self.pending_metrics = self.pending_metrics, []
                    self.condition.notify_all()
                    return batch, time.monotonic() - started, chunks
                if self.driver.rollout_engine.needs_full_sync and self.in_flight == 0:
                    self.condition.release()
                    try:
                        resync()
                    finally:
                        self.condition.acquire()
                    continue
                self.condition.wait(timeout=1.0)

    def stop(self) -> None:
        from megatron_gspo.rollout import RolloutEngineError

        with self.condition:
            self.stopping = True
            generating = self.in_flight > 0
            self.condition.notify_all()
        if self.thread is None or not self.thread.is_alive():
            return
        if generating:
            try:
                self.driver.rollout_engine.abort()  # the call in flight returns at its next token
            except RolloutEngineError as error:  # the run is over either way
                logger.warning("could not abort the generation in flight: %s", error)
        self.thread.join(timeout=60)

    # ------------------------------------------------------------------ the producer's side

    def _may_start_chunk(self) -> bool:
        if self.driver.rollout_engine.needs_full_sync:
            return False  # a restarted server without weights: the trainer's sync comes first
        ahead = len(self.buffer) + self.in_flight
        capacity = (self.engine_version + self.max_staleness + 1 - self.steps_taken) * (
            self.batch_size
        )
        return ahead + self.batch_size <= capacity

    def _requeue(self, prompts: list[Prompt], reason: str) -> None:
        if prompts:
            self.driver.ledger.requeue(prompts)
            self.counts[reason] += len(prompts)
            logger.info("%d prompts re-queued (%s)", len(prompts), reason.replace("_", " "))

    def _run(self) -> None:
        try:
            while True:
                with self.condition:
                    while not self.stopping and not self._may_start_chunk():
                        self.condition.wait(timeout=1.0)
                    if self.stopping:
                        return
                    chunk_index = self.next_chunk
                    self.next_chunk += 1
                    prompts = self.driver.ledger.take(self.batch_size)
                    self.in_flight = len(prompts)
                    self.window.busy_since = time.monotonic()
                chunk = self._produce(prompts, chunk_index)
                with self.condition:
                    self.in_flight = 0
                    self.window.intervals.append((self.window.busy_since, time.monotonic()))
                    self.window.busy_since = None
                    if self.stopping:
                        return
                    if chunk is not None:
                        self.buffer.put(chunk.groups)
                        self._requeue(chunk.lost, "requeued_lost")
                        self.pending_metrics.append(chunk)
                    self.condition.notify_all()
        except RunStopped as error:  # its message is the whole story: printed by the trainer
            self.fail(error)
        except BaseException as error:  # noqa: BLE001 - handed to the trainer's thread
            logger.exception("the sample producer failed")
            self.fail(error)

    def _produce(self, prompts: list[Prompt], chunk_index: int) -> Optional[_Chunk]:
        """Generate and score one chunk; a dead engine is recovered and the chunk re-queued
        (None)."""
        from megatron_gspo.rollout import RolloutEngineError

        try:
            with self.generating:
                return self.driver.produce_chunk(prompts, chunk_index)
        except RolloutEngineError as error:
            if self.stopping:
                return None
            logger.warning("rollout engine failed (%s): bringing it back", error)
            with self.condition:
                self._requeue(prompts, "requeued_lost")
            self.recover(error)
            return None

    def recover(self, error: Exception) -> Any:
        """Bring the engine back with the newest weights it was sent (their stats; None when
        nothing had to be sent again), or stop the run."""
        from megatron_gspo.rollout import RolloutEngineError

        try:
            stats = self.driver.rollout_engine.recover(self.restart_timeout_s)
        except RolloutEngineError as failure:
            raise self.lost(error, failure) from None
        if stats is not None or self.driver.rollout_engine.needs_full_sync:
            # A server came back and took the newest weights again, or waits for the trainer's.
            with self.condition:
                self.counts["engine_restarts"] += 1
        return stats

    def lost(self, error: Exception, failure: Exception) -> RolloutEngineLost:
        return RolloutEngineLost(
            f"the rollout engine failed ({error}) and did not come back within "
            f"rollout.engine_restart_timeout_s={self.restart_timeout_s:.0f}s: {failure}",
            "without an engine no samples can be generated",
            "check the rollout server's log; the checkpoint saved now resumes the run with "
            "resume=true (its untrained prompts are generated again)",
        )


class AsyncRolloutDriver(RolloutDriver):
    """Global rank 0 with ``rollout.max_staleness >= 1`` (see the module docstring).

    ``weights`` streams the trainer's current weights (a collective: every rank's driver calls
    it at the same point); the driver asks for them when a restarted server waits for the
    trainer's weights and the transport keeps no copy (``tensor``, ``distributed``)."""

    def __init__(
        self,
        cfg: TrainConfig,
        resources: ExitStack,
        weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None,
    ):
        super().__init__(cfg, resources)
        self.weights = weights
        self.background = BackgroundProducer(self)
        # Stopped before the rollout engine and the reward workers (the exit stack is LIFO).
        resources.callback(self.background.stop)
        self._start_step = 0
        self._last_return: Optional[float] = None

    def start(self, step: int, data_state: Optional[dict]) -> None:
        super().start(step, data_state)
        self._start_step = step

    # ------------------------------------------------------------------ producing

    def produce_chunk(self, prompts: list[Prompt], chunk_index: int) -> _Chunk:
        """One chunk from the run's sample producer (in the background thread), as groups.
        Sampling seeds derive from the chunk index as the synchronous driver's from the step:
        with a bound of 0 chunk ``k`` is step ``k`` and the samples are the synchronous ones."""
        scored = self.producer.produce(prompts, chunk_index)
        size = self.producer.group_size
        groups, lost = [], []
        for index, prompt in enumerate(prompts):
            members = scored.samples[index * size : (index + 1) * size]
            if any(sample.finish_reason == "abort" for sample in members):
                lost.append(prompt)  # never trained with a hole: generated again
            else:
                groups.append(ScoredGroup(prompt, members, chunk_index))
        return _Chunk(groups, lost, scored.metrics, len(scored.samples))

    # ------------------------------------------------------------------ the loop's calls

    def rollout(self, step: int) -> RolloutBatch:
        called = time.monotonic()
        try:
            groups, waited, chunks = self.background.take(step, lambda: self._resync(step))
        except BaseException as error:
            _broadcast_failure(error)
            raise
        samples = [sample for group in groups for sample in group.samples]
        self._batch_prompts = ([group.prompt.group_id for group in groups], [])
        samples = broadcast_samples(samples)
        returned = time.monotonic()
        metrics = {
            **rollout_metrics(samples),
            **_chunk_metrics(chunks),
            **self.task.stream.stats(),
            **staleness_metrics(samples, step, self.cfg.rollout.max_staleness),
            **{name: float(count) for name, count in self.background.counts.items()},
            "trainer_wait_s": waited,
            "time/rollout_s": returned - called,
        }
        metrics.update(self._overlap_metrics(called, returned))
        return RolloutBatch(samples, metrics)

    def _resync(self, version: int) -> None:
        """Send the trainer's current weights (``version``) to servers that came back without
        them; every rank takes part (the stream is collective), told so by the broadcast."""
        if self.weights is None:
            raise RolloutEngineLost(
                "a restarted rollout server waits for the trainer's weights, and this driver "
                "was given no way to ask for them",
                "the weight transport keeps no copy to send again",
                "use rollout.weight_transport=disk, or resume from the checkpoint saved now",
            )
        logger.warning("sending weight version %d to the restarted rollout servers", version)
        broadcast_samples(WEIGHTS_WANTED)
        self.sync_weights(self.weights(), version)

    def _overlap_metrics(self, called: float, returned: float) -> dict[str, float]:
        """Overlap of generation with the trainer's work since the last batch: between the
        previous ``rollout`` and this one the trainer worked (update, sync, checkpoint, log),
        then waited here."""
        window = self.background.window
        with self.background.condition:
            start = self._last_return
            self._last_return = returned
            if start is None:
                return {}
            generating = window.busy_within(start, returned)
            overlapped = window.busy_within(start, called)
            window.forget_before(start)
        training = called - start
        return {
            "engine_idle_s": max(0.0, (returned - start) - generating),
            "overlap_frac": overlapped / training if training > 0 else 0.0,
        }

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        from megatron_gspo.rollout import RolloutEngineError, sync_weights_paused

        partial = self.cfg.rollout.partial_rollouts
        started = time.perf_counter()
        # Without partial rollouts the sync waits for the chunk in flight to finish.
        waiting = contextlib.nullcontext() if partial else self.background.generating
        stream = _CountedStream(named_tensors)
        stats = None
        with waiting:
            try:
                stats = sync_weights_paused(
                    self.rollout_engine, stream.pairs(), version, pause_mode="in_place"
                )
            except RolloutEngineError as error:
                # The other ranks gather the whole stream: drain it, whatever this rank does;
                # kept when the engine failed before taking any of it (sent after the restart).
                untouched = stream.taken == 0
                remaining = list(named_tensors)
                stats = self._sync_after_recovery(error, version, remaining if untouched else None)
        if stats is not None:
            self.background.set_engine_version(version)
        if self.background.thread is None:
            # The first sync gives the engine the trainer's weights: now it may generate.
            self.background.start(self._start_step, version)
        if stats is None:
            return {"weight_sync_s": time.perf_counter() - started}
        return {
            "weight_sync_s": stats.seconds,
            "weight_sync_bytes": float(stats.num_bytes),
            "weight_sync_tensors": float(stats.num_tensors),
            "weight_sync_buckets": float(stats.num_buckets),
        }

    def _sync_after_recovery(
        self, error: Exception, version: int, weights: Optional[list[tuple[str, Any]]]
    ) -> Any:
        """After a failed sync: bring the engine back and give it weight ``version``, from the
        transport's copy or ``weights``; the stats, or None when the run has to stop (every rank
        then stops at the next rollout). The producer waits meanwhile, so that nothing is
        generated by a restarted server before it has the newest weights."""
        from megatron_gspo.rollout import RolloutEngineError, SyncStats, sync_weights_paused
        from megatron_gspo.rollout.types import StableTensorStream

        logger.warning("weight sync failed (%s): bringing the engine back", error)
        try:
            with self.background.generating:
                stats = self.background.recover(error)
                if self.rollout_engine.weight_version == version:
                    # The transport's copy was this version's: resent, or every server had it.
                    return stats if stats is not None else SyncStats(version, 0, 0, 0.0)
                if weights is None and self.rollout_engine.needs_full_sync:
                    # The trainer's next rollout sends its weights (take's resync), or its next
                    # step's sync does; nothing is generated until then.
                    return None
                if weights is None:
                    raise RolloutEngineLost(
                        f"the rollout engine failed during the sync of weight version {version} "
                        f"({error}) after taking part of it, and its transport keeps no copy",
                        "the engine would generate with older weights than the trainer's",
                        "resume from the checkpoint saved now (resume=true)",
                    )
                return sync_weights_paused(
                    self.rollout_engine, StableTensorStream(weights), version, "in_place"
                )
        except RolloutEngineError as failure:
            self.background.fail(self.background.lost(error, failure))
        except RolloutEngineLost as lost:
            self.background.fail(lost)
        return None


class _CountedStream:
    """A weight stream that counts the pairs taken from it (a stable stream stays stable)."""

    def __init__(self, named_tensors: Iterator[tuple[str, Any]]):
        self.named_tensors = named_tensors
        self.taken = 0

    def pairs(self) -> Iterator[tuple[str, Any]]:
        from megatron_gspo.rollout.types import StableTensorStream

        def counted() -> Iterator[tuple[str, Any]]:
            for pair in self.named_tensors:
                self.taken += 1
                yield pair

        stable = isinstance(self.named_tensors, StableTensorStream)
        return StableTensorStream(counted()) if stable else counted()


def _chunk_metrics(chunks: list[_Chunk]) -> dict[str, float]:
    """The producer's metrics of the chunks made since the last batch, merged (counts and times
    summed, the rest averaged); its generation time as ``generation_s`` (``time/rollout_s`` is
    the trainer's wait)."""
    if not chunks:
        return {}
    metrics = merge_round_metrics([(chunk.metrics, chunk.num_samples) for chunk in chunks])
    if "time/rollout_s" in metrics:
        metrics["generation_s"] = metrics.pop("time/rollout_s")
    return metrics


def _broadcast_failure(error: BaseException) -> None:
    """Tell the other ranks, waiting in the batch broadcast, that rank 0 stops (they raise the
    same lost-engine stop, or a RuntimeError naming rank 0's error)."""
    if isinstance(error, RolloutEngineLost):
        broadcast_samples(error)
    else:
        broadcast_samples(RuntimeError(f"rank 0's rollout failed: {type(error).__name__}: {error}"))
