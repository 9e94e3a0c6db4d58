"""Free TCP ports for the servers tests start (torchrun's rendezvous, loopback and SGLang
servers), safe while other tests run beside them (pytest-xdist's workers).

A port that the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range,
the range every outgoing connection also takes its local port from: between the check and the
server's own bind, a connection of another test (gloo, HTTP) can take it, and the server fails
with EADDRINUSE (it did, under two workers). So a port is drawn below that range, where no
connection is given one, from a slice of its own for each worker, so that two workers never
draw the same; the bind check leaves out one that something listens on.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

LOWEST_PORT = 10000
"""Below this sit well-known services; the draw is from here to the ephemeral range."""


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def _worker_slice() -> range:
    """This worker's ports (the whole span without pytest-xdist)."""
    start, end = LOWEST_PORT, max(_ephemeral_start(), LOWEST_PORT + 1000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    width = (end - start) // max(count, 1)
    return range(start + index * width, start + (index + 1) * width)


def free_port(address: str = "127.0.0.1") -> int:
    """A port on ``address`` that nothing listens on now, outside the ephemeral range and in
    this worker's slice of the ports below it."""
    ports = _worker_slice()
    for _ in range(200):
        port = random.choice(ports)
        with socket.socket() as sock:
            try:
                sock.bind((address, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on {address} in {ports.start}-{ports.stop - 1}")
