"""Stops for runs that can no longer learn anything, instead of training on garbage to the end.

Each guard raises :class:`RunStopped` with what happened, why going on is pointless and what to
do; ``python -m megatron_gspo.train`` prints it without a traceback and exits with
:data:`EXIT_CODE`. The guards:

- non-finite steps: ``optim.max_consecutive_skips`` optimizer steps in a row with a non-finite
  loss or gradient norm (:class:`megatron_gspo.engine.NonFiniteStepsError`);
- failing rewards: a reward function that fails on every sample of ``reward.max_failed_steps``
  consecutive batches (:class:`megatron_gspo.reward.RewardRunner`): every sample would score
  ``reward.failure_reward`` and the advantages would all be zero;
- a collapsed policy: ``optim.max_collapsed_steps`` RL steps in a row whose every optimizer step
  had a gradient norm of exactly 0 while the advantages were not zero
  (:class:`CollapseGuard`, called by the loop);
- a lost rollout engine: :class:`RolloutEngineLost`, an engine that died and did not come back
  within ``rollout.engine_restart_timeout_s`` (the loop saves a checkpoint first).
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
from collections.abc import Iterator, Mapping

EXIT_CODE = 3
"""Exit status of a run that a guard stopped (0: finished, 1: crashed, 2: configuration error,
130: interrupted)."""


class RunStopped(RuntimeError):
    """A guard stopped the run; the message says what, why and how to fix it."""

    def __init__(self, what: str, why: str, fix: str):
        self.what, self.why, self.fix = what, why, fix
        super().__init__(f"run stopped: {what}\n  why: {why}\n  fix: {fix}")


class PolicyCollapsedError(RunStopped):
    """The policy stopped responding to the loss (see :class:`CollapseGuard`)."""


class CollapseGuard:
    """Stops a run whose policy can no longer learn.

    The signal: the gradient norm is exactly 0 in every optimizer step of an RL step
    (``grad_norm_max == 0``) although the advantages are not (``advantage_abs_mean > 0``) and not
    every sequence was clipped (``clip_frac_seq < 1``: clipping zeroes a sequence's gradient by
    design). A policy that still computes anything gets a non-zero gradient from any unclipped
    sample with a non-zero advantage, so an exact zero means saturated or dead activations
    (``optim.lr=1e6``: entropy at its maximum log V and gradient norm 0 from the first step),
    and no later step can change the weights. Entropy near its maximum is reported but not used:
    a freshly initialised model has it too. Non-finite losses are the skip guard's
    (``optim.max_consecutive_skips``).

    Every rank sees the same reduced metrics, so every rank stops at the same step.
    """

    def __init__(self, max_steps: int, *, vocab_size: int, lr: float):
        self.max_steps = max_steps
        self.vocab_size = vocab_size
        self.lr = lr
        self.consecutive = 0
        """RL steps in a row that showed the signal."""

    def check(self, metrics: Mapping[str, float]) -> None:
        """Count this step; raise :class:`PolicyCollapsedError` at ``max_steps`` in a row."""
        collapsed = (
            metrics.get("grad_norm_max") == 0.0
            and metrics.get("advantage_abs_mean", 0.0) > 0.0
            and metrics.get("clip_frac_seq", 0.0) < 1.0
        )
        self.consecutive = self.consecutive + 1 if collapsed else 0
        if not self.max_steps or self.consecutive < self.max_steps:
            return
        entropy = metrics.get("entropy", float("nan"))
        raise PolicyCollapsedError(
            f"the policy has collapsed: the gradient norm was exactly 0 in every optimizer step "
            f"of {self.consecutive} RL steps in a row, although the advantages are not zero "
            f"(advantage_abs_mean={metrics['advantage_abs_mean']:.4g}); entropy {entropy:.4g}, "
            f"the maximum is log({self.vocab_size}) = {math.log(self.vocab_size):.4g}",
            "the weights no longer respond to the loss (saturated or dead activations), so no "
            "later step can change them; a learning rate far too large does this within one "
            f"step (optim.lr={self.lr:g})",
            "lower optim.lr and start again from the initial weights or a checkpoint saved "
            "before the collapse; optim.max_collapsed_steps=0 disables this stop",
        )


class RolloutEngineLost(RunStopped):
    """The rollout engine stopped answering and could not be restarted and re-synced in time.

    Raised on every rank (it travels in the driver's broadcast, so it pickles with its fields);
    the loop saves a checkpoint of the last trained step before it propagates, and the prompts
    whose samples were lost are pending in it, generated again on resume."""

    def __reduce__(self):
        return (type(self), (self.what, self.why, self.fix))


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------

_interrupted = False
"""Set by the SIGINT handler of :func:`catch_interrupts` (a signal handler has no other way to
tell the loop; it is process state by nature)."""


def catch_interrupts() -> None:
    """Make Ctrl-C impossible to lose (call from the main thread).

    Python raises ``KeyboardInterrupt`` wherever the main thread is when SIGINT arrives; inside a
    finalizer (``__del__``, a weakref callback, the garbage collector: frequent in a training
    step) it is printed as "Exception ignored" and dropped, and the run goes on. The handler
    also records the signal, and :func:`raise_if_interrupted` raises it again at the loop's next
    step boundary.
    """

    def interrupt(signal_number: int, frame: object) -> None:
        global _interrupted
        _interrupted = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C inside the block is recorded, not raised, and raised when the block ends (main
    thread; elsewhere nothing changes). For a checkpoint save: it runs to its end, so the resume
    hint points at a whole checkpoint, and Megatron's writers fork inside it, where a
    ``KeyboardInterrupt`` raised in a fork handler is printed as a traceback and dropped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signal_number: int, frame: object) -> None:
        global _interrupted
        _interrupted = True

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    raise_if_interrupted()


def raise_if_interrupted() -> None:
    """``KeyboardInterrupt`` if Ctrl-C was pressed (and possibly lost) since
    :func:`catch_interrupts`."""
    if _interrupted:
        raise KeyboardInterrupt
