"""The ``sandbox`` fixture: a test that takes it runs only where the code sandbox isolates code
(skipped elsewhere, failed in CI: ``sandbox_support.require_sandbox``)."""

from __future__ import annotations

import pytest

from .sandbox_support import require_sandbox


@pytest.fixture
def sandbox() -> None:
    require_sandbox()
