"""The driver: the actor of a run that generates and scores samples (global rank 0), and its
followers on the other ranks.

:func:`build_driver` gives each rank its :class:`Driver` (:mod:`~megatron_gspo.driver.interface`):
rank 0 the :class:`~megatron_gspo.driver.rollout_driver.RolloutDriver`, which owns the task, the
rollout engine, the rewards and the logs, and takes each step's batch from a batch source
(:mod:`~megatron_gspo.driver.source`): the :mod:`~megatron_gspo.driver.synchronous` one, a
background producer within a staleness bound (:mod:`~megatron_gspo.driver.background`,
:mod:`~megatron_gspo.driver.staleness`), or the batches a run recorded
(:mod:`~megatron_gspo.driver.replay`); the other ranks a
:class:`~megatron_gspo.driver.follower.DriverFollower`. The prompt ledger
(:mod:`~megatron_gspo.driver.ledger`) records which prompts were served and trained.
"""

from megatron_gspo.driver.build import build_driver
from megatron_gspo.driver.interface import Driver, RolloutBatch

__all__ = ["Driver", "RolloutBatch", "build_driver"]
