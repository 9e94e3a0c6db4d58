"""Stops for runs that can no longer learn anything, instead of training on garbage to the end.

Each guard raises :class:`RunStopped` with what happened, why going on is pointless and what to
do; ``python -m megatron_gspo.train`` prints it without a traceback and exits with
:data:`EXIT_CODE`. The guards:

- non-finite steps: ``optim.max_consecutive_skips`` optimizer steps in a row with a non-finite
  loss or gradient norm (:class:`megatron_gspo.engine.NonFiniteStepsError`);
- failing rewards: a reward function that fails on every sample of ``reward.max_failed_steps``
  consecutive batches (:class:`megatron_gspo.reward.RewardRunner`): every sample would score
  ``reward.failure_reward`` and the advantages would all be zero.
"""

from __future__ import annotations

EXIT_CODE = 3
"""Exit status of a run that a guard stopped (0: finished, 1: crashed, 2: configuration error,
130: interrupted)."""


class RunStopped(RuntimeError):
    """A guard stopped the run; the message says what, why and how to fix it."""

    def __init__(self, what: str, why: str, fix: str):
        self.what, self.why, self.fix = what, why, fix
        super().__init__(f"run stopped: {what}\n  why: {why}\n  fix: {fix}")
