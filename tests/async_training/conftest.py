"""Shared by the asynchronous driver tests."""

from __future__ import annotations

import pytest

from megatron_gspo.config import TrainConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine


@pytest.fixture(scope="session")
def policies():
    """Weights for versions 0, 1, 2, 3: other random models of the run's architecture (the
    trainer's updates, as far as the driver can tell); made once for every test file."""
    model = TrainConfig().model
    return [list(EmbeddedEngine(model, seed=100 + k).hf_state()) for k in range(4)]
