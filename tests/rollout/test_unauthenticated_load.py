"""What a local process without the run's key can make the loopback server do, over real HTTP on
127.0.0.1: its health probes run no model forward, and however many of its requests are refused
and connections cut, the server writes a bounded number of log lines and no traceback; the
trainer's calls keep working."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import time

import pytest
import requests

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.peer_events import LOG_BURST
from megatron_gspo.rollout.server import HEALTH_CACHE_S, EmbeddedServer

KEY = "the-runs-secret"
BEARER = {"Authorization": f"Bearer {KEY}"}
GENERATE = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture
def served(model_config):
    engine = EmbeddedEngine(model_config, seed=1)
    with EmbeddedServer(engine, api_key=KEY) as server:
        yield engine, server


def _count_forwards(engine) -> list[int]:
    """A one-element list that counts the model's forwards (a forward hook on the real model)."""
    forwards = [0]

    def count(*_: object) -> None:
        forwards[0] += 1

    engine.hf_model.register_forward_hook(count)
    return forwards


def test_keyless_health_probes_run_no_forward(served):
    engine, server = served
    forwards = _count_forwards(engine)
    for _ in range(50):
        for path in ("/health", "/health_generate"):
            assert requests.get(server.url + path, timeout=30).status_code == 200
    assert forwards[0] == 0
    # With the key, /health_generate runs a forward, and calls within HEALTH_CACHE_S share it.
    started = time.monotonic()
    for _ in range(10):
        answer = requests.get(server.url + "/health_generate", headers=BEARER, timeout=30)
        assert answer.status_code == 200
    elapsed = time.monotonic() - started
    assert 1 <= forwards[0] <= 1 + elapsed / HEALTH_CACHE_S, (forwards[0], elapsed)
    generated = requests.post(server.url + "/generate", json=GENERATE, headers=BEARER, timeout=30)
    assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2


def _cut(port: int, payload: bytes) -> None:
    """Send ``payload`` and reset the connection (SO_LINGER 0: RST, as a killed client)."""
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    connection.sendall(payload)
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def _refused(port: int, headers: dict[str, str]) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps(GENERATE).encode()
        connection.putrequest("POST", "/generate", skip_host=True, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


def test_cut_connections_and_refusals_log_a_bounded_number_of_lines(served, caplog, capfd):
    engine, server = served
    port = server.port
    host = f"127.0.0.1:{port}"
    keyed = f"Host: {host}\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 64}}).encode()
    cuts = [
        b"GET /gen",  # inside the request line
        f"POST /generate HTTP/1.1\r\n{keyed}Content-Length: 100\r\n\r\n{{".encode(),  # body
        # A whole request: the server generates, then finds nobody to answer.
        f"POST /generate HTTP/1.1\r\n{keyed}Content-Length: {len(body)}\r\n\r\n".encode() + body,
    ]
    refusals = [
        ({"Host": host, "Content-Type": "application/json"}, 401),
        ({"Host": "evil.example", "Content-Type": "application/json", **BEARER}, 403),
        ({"Host": host, "Content-Type": "text/plain", **BEARER}, 415),
    ]
    with caplog.at_level(logging.INFO):
        for index in range(50):
            _cut(port, cuts[index % len(cuts)])
            headers, status = refusals[index % len(refusals)]
            assert _refused(port, headers) == status
        # The cut generations finish in the server's threads; wait until it has seen them.
        deadline = time.monotonic() + 60
        while server.peer_events.counts["cut connections"] < 16:
            assert time.monotonic() < deadline, server.peer_events.counts
            time.sleep(0.1)
        answer = requests.post(server.url + "/generate", json=GENERATE, headers=BEARER, timeout=30)
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 2
        server.close()  # sums up what was not logged one by one
    assert server.peer_events.counts["refused requests"] == 50
    lines = [record for record in caplog.records if record.name.startswith("megatron_gspo")]
    # LOG_BURST lines of each kind (refused, cut, failed) and one summary line per kind.
    assert len(lines) <= 3 * (LOG_BURST + 1), [record.getMessage() for record in lines]
    assert not any(record.exc_info for record in lines)
    assert "Traceback" not in caplog.text and "Traceback" not in capfd.readouterr().err
    summaries = [
        record.getMessage() for record in lines if "not logged one by one" in record.getMessage()
    ]
    assert any(f"{50 - LOG_BURST} more refused requests" in line for line in summaries), summaries
