"""Shared by the sandbox tests: whether the kernel can isolate code here, and a loopback
listener that counts connections.

Every sandbox test asserts an outcome on both kinds of machine: where bubblewrap can isolate
code, what the code could and could not do; where it cannot, that the call fails closed with
the reason (never runs the code with less isolation).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Optional, TypeVar

import pytest

from megatron_gspo.reward.sandbox import SandboxUnavailableError, check_isolation

T = TypeVar("T")


def unavailable_reason() -> Optional[str]:
    """None where bubblewrap isolates code here, else the fail-closed message."""
    try:
        check_isolation()
    except SandboxUnavailableError as error:
        return str(error)
    return None


def isolated_or_fail_closed(call: Callable[[], T]) -> Optional[T]:
    """``call()`` where the sandbox is available; elsewhere assert that it raises the
    fail-closed error and return None (the caller then stops: that was the outcome)."""
    if unavailable_reason() is None:
        return call()
    with pytest.raises(SandboxUnavailableError, match="bubblewrap"):
        call()
    return None


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
