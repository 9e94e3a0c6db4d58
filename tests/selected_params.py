"""Which parameters of a module's tests this session runs, for a module-scoped fixture that
builds only what the selected tests use (CI's tier deselects the ``slow`` ones)."""

from __future__ import annotations

import pytest


def selected_params(
    request: pytest.FixtureRequest, tests: tuple[str, ...], param: str
) -> set[tuple[str, object]]:
    """``(test name, value of param)`` for each selected item of the requesting module whose
    test (its name without the parameter ids) is one of ``tests``."""
    return {
        (item.originalname, item.callspec.params[param])
        for item in request.session.items
        if item.originalname in tests and item.module is request.module
    }
