"""Every rank but 0: the driver's part in the collectives, nothing else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional

from megatron_gspo.driver.interface import Driver, RolloutBatch, WeightsWanted, broadcast_samples
from megatron_gspo.samples import TrainSample


class DriverFollower(Driver):
    """Every rank but 0: receives the driver's samples and drains the weight stream."""

    def __init__(self, weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None):
        self.weights = weights

    def start(self, step: int, data_state: Optional[dict]) -> None:
        pass

    def rollout(self, step: int) -> RolloutBatch:
        samples = broadcast_samples(None)
        while isinstance(samples, WeightsWanted):  # rank 0 sends the trainer's weights first
            self.sync_weights(self.weights(), version=step)
            samples = broadcast_samples(None)
        return RolloutBatch(samples)

    def mark_trained(self, step: int) -> None:
        pass

    def supervised_batch(self) -> list[TrainSample]:
        return broadcast_samples(None)

    def sync_weights(self, named_tensors: Iterator[tuple[str, Any]], version: int) -> dict:
        for _ in named_tensors:
            pass
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        pass

    @property
    def records(self) -> list[dict]:
        return []

    def state_dict(self) -> dict:
        return {}
