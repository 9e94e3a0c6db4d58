"""tests/free_ports.py: ports below the kernel's ephemeral range, in a slice of each pytest-xdist
worker's own, that nothing listens on."""

from __future__ import annotations

import socket

import free_ports
import pytest


def test_ports_are_below_the_ephemeral_range_in_the_workers_slice(monkeypatch):
    start = free_ports._ephemeral_start()
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(free_ports._worker_slice())
        port = free_ports.free_port()
        assert port in slices[-1] and free_ports.LOWEST_PORT <= port < start
    assert not set(slices[0]) & set(slices[1])


def test_a_port_something_listens_on_is_never_drawn(monkeypatch):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        monkeypatch.setattr(free_ports, "_worker_slice", lambda: range(taken, taken + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            free_ports.free_port()
