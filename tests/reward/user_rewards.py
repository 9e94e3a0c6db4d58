"""User reward functions, loaded by import path in the runner tests (also inside worker processes)."""

import os
import time

from megatron_gspo.reward import RewardInput


def response_length(sample: RewardInput, *, scale: float = 1.0) -> float:
    return scale * len(sample.response)


def sleep_if_asked(sample: RewardInput) -> float:
    """Sleeps ``metadata["sleep_s"]`` seconds (to exceed the runner's time limit), then scores 1."""
    time.sleep(float(sample.metadata.get("sleep_s", 0.0)))
    return 1.0


def raise_if_asked(sample: RewardInput) -> float:
    if sample.metadata.get("raise"):
        raise RuntimeError(f"asked to fail on {sample.prompt!r}")
    return 0.5


def bad_value_if_asked(sample: RewardInput):
    return sample.metadata.get("value", 0.25)


def exit_if_asked(sample: RewardInput) -> float:
    """Kills its own process, as a segfaulting extension would."""
    if sample.metadata.get("exit"):
        os._exit(3)
    return 0.75
