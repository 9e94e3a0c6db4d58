"""Shared by the sandbox tests: whether the kernel can isolate code here, the ``sandbox``
fixture's rule, and a loopback listener that counts connections.

A test of the sandbox passes only when its programs ran in the sandbox: where bubblewrap cannot
isolate code it is skipped with the reason, and in CI (``CI`` set to true, 1 or yes) it fails
with the reason, so that a machine without a working sandbox never turns the sandbox's tests
green. Failing closed (the refusal with the reason and the fix) has tests of its own, which make
the sandbox unavailable on purpose (``MEGATRON_GSPO_BWRAP`` naming a missing or failing bwrap)
and run everywhere.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Optional

import pytest

from megatron_gspo.reward.sandbox import SandboxUnavailableError, check_isolation


def unavailable_reason() -> Optional[str]:
    """None where bubblewrap isolates code here, else the fail-closed message."""
    try:
        check_isolation()
    except SandboxUnavailableError as error:
        return str(error)
    return None


def in_ci() -> bool:
    """Whether the tests run in CI, where every sandbox test must run (``CI=true``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_sandbox() -> None:
    """Return where the sandbox runs; elsewhere fail (in CI) or skip the calling test, with
    bubblewrap's reason. Never lets a test pass without its programs having run sandboxed."""
    reason = unavailable_reason()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"the code sandbox cannot run here, and CI must test it: {reason}")
    pytest.skip(f"the code sandbox cannot run here: {reason}")


class LoopbackListener:
    """A TCP server on 127.0.0.1 that counts the connections it accepts."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen()
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            self.connections += 1
            connection.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.socket.close()
