"""Generated prompt groups waiting to be trained, and the staleness bound that decides which may
be (``rollout.max_staleness``, docs/async.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.data.prompts import Prompt
from megatron_gspo.samples import TrainSample


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
