"""One-process reference runs shared by the end-to-end tests (each costs ~15 s of start-up).

The GSPO reference runs three steps so that the kill-and-resume test can compare two steps
after a restart; every other comparison uses its first two. It saves a checkpoint after step 2
(and the final one): the asynchronous driver's bound-0 test compares its weights and optimizer
state with it (saving changes no metric), and the damaged-checkpoint test resumes a copy of it
from the first after cutting the second short.
"""

from __future__ import annotations

import pytest

from .harness import GRPO, REFERENCE_RUN, TINY, Launch, run_train


@pytest.fixture(scope="session")
def gspo_run(tmp_path_factory) -> Launch:
    """GSPO (the default loss), old log-probs recomputed, in-process embedded rollout engine;
    its batches recorded (rollout.save_rollouts, replayed by tests/e2e/test_replay.py)."""
    return run_train(
        tmp_path_factory.mktemp("gspo") / "out",
        list(REFERENCE_RUN),
    )


@pytest.fixture(scope="session")
def grpo_run(tmp_path_factory) -> Launch:
    """GRPO: token-level ratios clipped to [0.8, 1.27]."""
    return run_train(tmp_path_factory.mktemp("grpo") / "out", ["steps=2", *TINY, *GRPO])
