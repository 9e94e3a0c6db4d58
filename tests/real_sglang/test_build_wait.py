"""``sglang_python`` waits for ``.ci/run``'s background build of the SGLang environment: it
returns once the build says ``ok``, and fails with the build's own lines when it failed."""

from __future__ import annotations

import threading
import time

import pytest

from .server import READY_ENV, wait_for_sglang_build


def test_waits_until_the_build_has_succeeded(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setenv(READY_ENV, str(ready))
    writer = threading.Timer(0.5, lambda: ready.write_text("ok\n"))
    started = time.monotonic()
    writer.start()
    wait_for_sglang_build(timeout_s=30)
    assert time.monotonic() - started >= 0.5


def test_a_failed_build_fails_with_its_lines(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    ready.write_text("failed: bash setup.sh VENV\nsglang-cpu: unsupported CPU\n")
    monkeypatch.setenv(READY_ENV, str(ready))
    with pytest.raises(RuntimeError, match="unsupported CPU"):
        wait_for_sglang_build(timeout_s=30)


def test_a_build_that_never_ends_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv(READY_ENV, str(tmp_path / "never"))
    with pytest.raises(TimeoutError, match="did not end"):
        wait_for_sglang_build(timeout_s=1.5)


def test_no_background_build_returns_at_once(monkeypatch):
    monkeypatch.delenv(READY_ENV, raising=False)
    wait_for_sglang_build(timeout_s=0)
