"""What the RL loop asks of the driver, the actor that generates and scores samples.

The RL loop speaks to two actors. The training engine runs on every rank and its calls are
collective. The driver owns the task (prompts, tokenizer, held-out prompts), the rollout engine,
the reward functions and the logs; it generates and scores each step's samples and broadcasts
them, so that every rank holds the whole rollout batch. Every rank holds a :class:`Driver`:
global rank 0 the :class:`~megatron_gspo.driver.rollout_driver.RolloutDriver`, the others a
:class:`~megatron_gspo.driver.follower.DriverFollower` that takes its part in the driver's
collectives (the broadcast, draining the weight stream) and has nothing else to do. The loop
therefore never tests the rank.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch.distributed as dist

from megatron_gspo.samples import TrainSample


@dataclass
class RolloutBatch:
    """One step's scored samples (the same on every rank) and the driver's metrics of them."""

    samples: list[TrainSample]
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout, reward and data metrics and the driver's ``time/rollout_s``, ``time/reward_s``
    (empty on the other ranks, which log nothing)."""


class Driver(abc.ABC):
    """What the RL loop asks of the sample producer. Every rank calls every method in the same
    order; methods marked collective must be called by every rank."""

    @abc.abstractmethod
    def start(self, step: int, data_state: Optional[dict]) -> None:
        """Begin at RL step ``step``, after the supervised warm-up (which needs only
        :meth:`supervised_batch`); ``data_state`` is the :meth:`state_dict` saved in the
        checkpoint a resumed run starts from (None: a fresh run). Opens the log sinks (a resumed
        run drops the records from ``step`` on: they belong to the run that was interrupted)."""

    @abc.abstractmethod
    def rollout(self, step: int) -> RolloutBatch:
        """Collective: the scored samples of RL step ``step``, on every rank."""

    @abc.abstractmethod
    def mark_trained(self, step: int) -> None:
        """Step ``step`` trained the batch :meth:`rollout` gave it: its prompts are no longer
        pending, and ``trained_prompts.jsonl`` gets the step's line (see ``ledger.py``). Called
        before the step's checkpoint."""

    @abc.abstractmethod
    def supervised_batch(self) -> list[TrainSample]:
        """Collective: the next prompts with their reference answers as samples of advantage 1
        (the supervised warm-up), on every rank."""

    @abc.abstractmethod
    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        """Collective: hand the trainer's weight stream (Hugging Face names, full tensors) to the
        rollout engine as weight version ``version``. Every rank drains the stream (gathering
        shards is collective). Returns the sync metrics."""

    @abc.abstractmethod
    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (``eval/...``) of the current weights (empty on the other ranks)."""

    @abc.abstractmethod
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record a step's metrics (metrics.jsonl, TensorBoard, progress bar)."""

    @property
    @abc.abstractmethod
    def records(self) -> list[dict]:
        """Every metric record logged so far (empty on the other ranks)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """What a checkpoint must hold to resume the data where it stopped: the stream's position
        and the prompts served but not yet trained."""


class WeightsWanted:
    """What rank 0 broadcasts instead of a batch when a restarted rollout server waits for the
    trainer's weights: every rank streams them (the gather is collective), then the rollout
    goes on (``background.BackgroundSource``)."""


WEIGHTS_WANTED = WeightsWanted()


def broadcast_samples(
    samples: Union[None, list[TrainSample], BaseException],
) -> list[TrainSample]:
    """Rank 0's samples on every rank (pickled over the default group; small next to a step).

    Rank 0 may send an exception instead: the other ranks raise it (rank 0 raises its own), so
    that a failed rollout stops every rank instead of leaving them waiting here."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return samples
    payload = [samples]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], BaseException) and dist.get_rank() != 0:
        raise payload[0]
    return payload[0]
