"""Bringing a rollout engine back: the loopback server in a child process, SIGKILLed and restarted,
and an external server that restarted on its own; both get the newest weights again before they
serve (``SGLangEngine.recover``)."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.server import EmbeddedServer
from megatron_gspo.rollout.server_process import EmbeddedServerProcess
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError
from megatron_gspo.weight_sync import DiskTransport

API_KEY = "test-recover-key"


def _request() -> GenerateRequest:
    return GenerateRequest(input_ids=[3, 1, 4], max_new_tokens=6, seed=5, temperature=0.8)


def _client(model_config, url, tmp_path, **options) -> SGLangEngine:
    return SGLangEngine(
        [url],
        RouteLayout.from_model_config(model_config),
        weight_transport=DiskTransport(str(tmp_path / "weights")),
        api_key=API_KEY,
        retry_backoff_s=0.05,
        max_retries=1,
        **options,
    )


def _kill(server: EmbeddedServerProcess) -> None:
    server.process.process.send_signal(signal.SIGKILL)
    server.process.process.wait()


@pytest.fixture
def server(model_config, tmp_path):
    """The loopback server in a child process, as a run launches it; stopped after the test."""
    process = EmbeddedServerProcess(
        model_config, api_key=API_KEY, log_path=str(tmp_path / "server.log"), threads=1
    ).start()
    yield process
    process.stop()


def test_dead_server_process_comes_back_with_the_newest_weights(model_config, tmp_path, server):
    owner = _client(model_config, server.url, tmp_path, restarters={server.url: server.restart})
    donor = EmbeddedEngine(model_config, seed=2)
    owner.sync_weights(donor.hf_state(), version=3)
    expected = donor.generate([_request()])[0]
    assert owner.recover(60) is None  # nothing to do while it answers with version 3

    # The client that launched it restarts it.
    _kill(server)
    with pytest.raises(RolloutEngineError, match="unreachable or died"):
        owner.generate([_request()])
    stats = owner.recover(120)
    assert stats.weight_version == 3 and server.restarts == 1
    (result,) = owner.generate([_request()])
    assert result.weight_version == 3 and result.output_ids == expected.output_ids
    np.testing.assert_allclose(result.output_log_probs, expected.output_log_probs, atol=1e-6)
    # The process gets the key from its environment, never on its command line (which any
    # local user reads in /proc), nor does anything it starts.
    root = psutil.Process(server.pid)
    for process in [root, *root.children(recursive=True)]:
        command_line = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert API_KEY.encode() not in command_line, command_line
    assert requests.get(server.url + "/model_info", timeout=10).status_code == 401

    # A client that did not launch it waits for it (its operator restarts it), never
    # restarts it, and sends the weights again once it answers.
    guest = _client(model_config, server.url, tmp_path / "guest")
    guest.sync_weights(donor.hf_state(), version=4)
    _kill(server)
    with pytest.raises(RolloutEngineError, match="did not answer again within 0s"):
        guest.recover(0)
    server.restart(120)
    assert guest.recover(30).weight_version == 4
    assert guest.generate([_request()])[0].output_ids == expected.output_ids


def test_a_server_restarted_at_version_0_gets_the_weights_again(model_config, tmp_path, server):
    """A restarted server reports version 0 with its start-up weights; when the trainer's
    weights are version 0 too (a run that fails before its first update), they are sent again
    all the same."""
    owner = _client(model_config, server.url, tmp_path, restarters={server.url: server.restart})
    donor = EmbeddedEngine(model_config, seed=2)
    owner.sync_weights(donor.hf_state(), version=0)
    expected = donor.generate([_request()])[0]
    _kill(server)
    stats = owner.recover(120)
    assert stats is not None and stats.weight_version == 0
    assert owner.generate([_request()])[0].output_ids == expected.output_ids


def test_transport_without_a_copy_waits_for_the_trainers_sync(model_config, tmp_path):
    """The client synced version 4 through a transport that keeps no copy (a fresh disk
    transport holds none yet, as tensor and distributed never do); the server (a restart) holds
    version 0: it must not generate until the trainer's next sync."""
    first = EmbeddedServer(EmbeddedEngine(model_config, seed=1), api_key=API_KEY).start()
    try:
        client = _client(model_config, first.url, tmp_path, initial_weight_version=4)
        assert client.recover(10) is None and client.needs_full_sync
        with pytest.raises(RolloutEngineError, match="sync_weights\\(\\) first"):
            client.generate([_request()])
        donor = EmbeddedEngine(model_config, seed=2)
        client.sync_weights(donor.hf_state(), version=5)
        assert not client.needs_full_sync
        (result,) = client.generate([_request()])
        assert result.weight_version == 5
        assert result.output_ids == donor.generate([_request()])[0].output_ids
    finally:
        first.close()


def test_answer_cut_short_is_an_engine_error(tmp_path):
    """A server that dies in the middle of its answer (headers sent, body cut short) is a
    transport failure: retried, then ``RolloutEngineError`` (which the asynchronous driver
    recovers from), not a ``requests`` exception that ends the run with a traceback."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    answered = []

    def serve() -> None:
        for _ in range(2):  # the call and its one retry (max_retries=1)
            connection, _ = listener.accept()
            with connection:
                connection.recv(65536)
                connection.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 7098\r\n\r\n{"text"'
                )
                answered.append(True)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = SGLangEngine(
        [f"http://127.0.0.1:{port}"], retry_backoff_s=0.01, max_retries=1, control_timeout_s=10
    )
    try:
        with pytest.raises(RolloutEngineError, match="failed after 2 attempts.*ChunkedEncoding"):
            client.post_json(client.urls[0], "/generate", {"input_ids": [1]})
    finally:
        client.close()
        listener.close()
    thread.join(timeout=10)
    assert len(answered) == 2
