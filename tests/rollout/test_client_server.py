"""The SGLang client against the embedded engine's loopback server, end to end over HTTP.

A real SGLang server cannot start without a GPU; where a test needs behaviour the embedded server
deliberately lacks (the /begin_weight_update bracket, broken answers), a minimal stdlib server
that records calls stands in for it, and the test says so.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import requests
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.server import EmbeddedServer
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError, sync_weights_paused
from megatron_gspo.weight_sync import DiskTransport, TensorTransport

# The run's secret in these tests; the servers are started with it and the clients send it.
API_KEY = "test-run-key"


@pytest.fixture
def served(model_config):
    engine = EmbeddedEngine(model_config, seed=1)
    with EmbeddedServer(engine, api_key=API_KEY) as server:
        yield engine, server


def _client(model_config, urls, **options) -> SGLangEngine:
    options.setdefault("retry_backoff_s", 0.01)
    options.setdefault("api_key", API_KEY)
    return SGLangEngine(urls, RouteLayout.from_model_config(model_config), **options)


def _requests(count=4, **fields):
    defaults = dict(max_new_tokens=6, temperature=0.8, return_routed_experts=True)
    defaults.update(fields)
    return [
        GenerateRequest(
            input_ids=[(5 * i + j) % 90 + 1 for j in range(i + 2)], seed=40 + i, **defaults
        )
        for i in range(count)
    ]


def _assert_same(results, expected, exact=True):
    """Same samples; log-probs bit-equal when both sides ran the same batches (float32 -> JSON
    double -> float32 is exact), else equal up to the rounding that batch padding causes."""
    assert len(results) == len(expected)
    for got, want in zip(results, expected):
        assert got.request_id == want.request_id
        assert got.output_ids == want.output_ids
        assert got.finish_reason == want.finish_reason
        if exact:
            np.testing.assert_array_equal(got.output_log_probs, want.output_log_probs)
        else:
            np.testing.assert_allclose(got.output_log_probs, want.output_log_probs, atol=1e-5)
        np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        assert got.weight_version == want.weight_version
        np.testing.assert_array_equal(got.output_weight_versions, want.output_weight_versions)


def test_route_weights_are_refused_before_any_call(model_config):
    """SGLang's return_routed_experts carries ids only: a request for the routers' combine
    weights (R3 with replayed weights) is refused, never answered without them (no server
    needed: the client refuses before sending)."""
    client = _client(model_config, ["http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="returns expert ids only"):
        client.generate(_requests(1, return_routed_expert_weights=True))


def test_generate_equals_in_process_engine(served, model_config):
    engine, server = served
    requests_ = _requests(5, stop_token_ids=[7])
    expected = engine.generate(requests_)
    client = _client(model_config, [server.url])
    _assert_same(client.generate(requests_), expected)
    chunked = _client(model_config, [server.url], max_requests_per_call=2, max_concurrency=2)
    _assert_same(chunked.generate(requests_), expected, exact=False)
    plain = _requests(2, return_routed_experts=False, return_logprob=False)
    for result in client.generate(plain):
        assert result.output_log_probs is None and result.routed_experts is None
    client.close()


def test_n_samples(served, model_config):
    engine, server = served
    client = _client(model_config, [server.url])
    # Seeded: the client sends n separate prompts with derived seeds, as the engine does.
    seeded = _requests(2)
    _assert_same(client.generate(seeded, n=3), engine.generate(seeded, n=3))  # one call each
    # Unseeded: one call with sampling_params.n, answered prompt-major.
    unseeded = [GenerateRequest(input_ids=[1, 2, 3][: i + 1], max_new_tokens=4) for i in range(2)]
    results = client.generate(unseeded, n=2)
    assert [r.request_id for r in results] == [
        f"{request.request_id}/{index}" for request in unseeded for index in range(2)
    ]
    assert [r.prompt_length for r in results] == [1, 1, 2, 2]


def test_disk_weight_update_changes_outputs(served, model_config, tmp_path):
    engine, server = served
    donor = EmbeddedEngine(model_config, seed=2)
    client = _client(model_config, [server.url], weight_transport=DiskTransport(str(tmp_path)))
    requests_ = _requests()
    before = client.generate(requests_)
    stats = sync_weights_paused(client, donor.hf_state(), version=1)
    assert stats.num_tensors == len(engine._layout.disk_names) and stats.num_bytes > 0
    # Disk updates run outside the weight-update bracket, so it is never probed.
    assert client.servers[0].has_weight_update_bracket is None
    after = client.generate(requests_)
    # The donor runs version 0 in process; the server took the same weights as version 1.
    _assert_same(after, _with_version(donor.generate(requests_), 1))
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    assert engine.weight_version == client.weight_version == 1
    assert client.info()["servers"][0]["weight_version"] == 1
    sync_weights_paused(client, engine.hf_state(), version=2)
    assert sorted(os.listdir(tmp_path)) == ["weights_v00000002"]  # keep_last=1


def _with_version(results, version):
    for result in results:
        result.weight_version = version
        result.output_weight_versions = np.full(result.response_length, version)
    return results


def test_failed_disk_update_names_the_tensor(served, model_config, tmp_path):
    engine, server = served
    client = _client(model_config, [server.url], weight_transport=DiskTransport(str(tmp_path)))
    broken = [
        (name, tensor) for name, tensor in engine.hf_state() if "experts.1.up_proj" not in name
    ]
    with pytest.raises(RolloutEngineError, match="update_weights_from_disk: HTTP 400.*missing"):
        client.sync_weights(iter(broken), version=1)
    assert engine.weight_version == 0


def _wait_until_running(engine, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while engine.num_running == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)


def _generate_in_thread(client, requests_):
    outcome = {}
    worker = threading.Thread(target=lambda: outcome.update(results=client.generate(requests_)))
    worker.start()
    return worker, outcome


def test_abort_returns_partial_results(served, model_config):
    engine, server = served
    client = _client(model_config, [server.url])
    long_request = GenerateRequest(input_ids=[1, 2], max_new_tokens=200, return_routed_experts=True)
    # Abort once a few tokens exist (counted by a forward hook on the engine's model: the
    # prefill, then one forward per token), however slow the machine is.
    forwards = []
    hook = engine.hf_model.register_forward_hook(lambda *_: forwards.append(None))
    worker, outcome = _generate_in_thread(client, [long_request])
    deadline = time.monotonic() + 60
    while len(forwards) < 4:
        assert time.monotonic() < deadline, "the engine produced no tokens in 60 s"
        time.sleep(0.005)
    hook.remove()
    client.abort([long_request.request_id])
    worker.join(timeout=30)
    (result,) = outcome["results"]
    assert result.finish_reason == "abort" and 0 < result.response_length < 200
    assert result.routed_experts.shape[0] == 2 + result.response_length - 1
    worker, outcome = _generate_in_thread(client, [long_request])
    _wait_until_running(engine)
    client.abort()
    worker.join(timeout=30)
    assert outcome["results"][0].finish_reason == "abort"


def test_flush_is_retried_while_requests_run(served, model_config):
    engine, server = served
    impatient = _client(model_config, [server.url], flush_retries=0)
    patient = _client(model_config, [server.url], flush_retries=400, flush_retry_interval_s=0.02)
    worker, outcome = _generate_in_thread(
        patient, [GenerateRequest(input_ids=[1], max_new_tokens=150)]
    )
    _wait_until_running(engine)
    with pytest.raises(RolloutEngineError, match="flush_cache: HTTP 400"):
        impatient.flush_cache()
    patient.flush_cache()  # succeeds once the generation is over
    worker.join(timeout=30)
    assert outcome["results"][0].finish_reason == "length"


def test_in_place_sync_over_http_reports_each_tokens_version(served, model_config, tmp_path):
    """A weight sync lands while a request runs (paused in place, the disk update, continued):
    the answer says which tokens each version sampled (SGLang's ``weight_versions`` spans)."""
    engine, server = served
    donor = EmbeddedEngine(model_config, seed=2)
    client = _client(model_config, [server.url], weight_transport=DiskTransport(str(tmp_path)))
    request = GenerateRequest(input_ids=[1, 2], max_new_tokens=250, return_routed_experts=True)
    worker, outcome = _generate_in_thread(client, [request])
    _wait_until_running(engine)
    time.sleep(0.05)
    sync_weights_paused(client, donor.hf_state(), version=4, pause_mode="in_place")
    worker.join(timeout=60)
    (result,) = outcome["results"]
    versions = result.output_weight_versions
    assert result.finish_reason == "length" and len(versions) == 250
    assert versions[0] == 0 and versions[-1] == 4 and set(versions.tolist()) == {0, 4}
    assert (np.diff(versions) >= 0).all() and result.weight_version == 0


def test_pause_aborts_and_continue_resumes(served, model_config):
    engine, server = served
    client = _client(model_config, [server.url])
    worker, outcome = _generate_in_thread(
        client, [GenerateRequest(input_ids=[1], max_new_tokens=200)]
    )
    _wait_until_running(engine)
    client.pause()
    worker.join(timeout=30)
    assert outcome["results"][0].finish_reason == "abort"
    client.flush_cache()
    client.resume()
    assert client.generate(_requests(1))[0].finish_reason == "length"
    assert client.health()


def test_least_in_flight_balancing_uses_every_server(model_config):
    engines = [EmbeddedEngine(model_config, seed=seed) for seed in (1, 2)]
    servers = [EmbeddedServer(engine, api_key=API_KEY).start() for engine in engines]
    try:
        client = _client(model_config, [s.url for s in servers], max_requests_per_call=1)
        requests_ = _requests(8, max_new_tokens=20)
        results = client.generate(requests_)
        answered_by = set()
        for request, result in zip(requests_, results):
            for index, engine in enumerate(engines):
                if engine.generate([request])[0].output_ids == result.output_ids:
                    answered_by.add(index)
        assert answered_by == {0, 1}
        assert all(server.in_flight == 0 for server in client.servers)
    finally:
        for server in servers:
            server.close()


def test_dead_server_gives_error_naming_the_url(model_config):
    url = f"http://127.0.0.1:{free_port()}"
    client = _client(model_config, [url], max_retries=1)
    with pytest.raises(RolloutEngineError, match=f"{url}/generate: failed after 2 attempts"):
        client.generate(_requests(1))
    assert not client.health()


def test_bad_request_is_reported_with_the_server_message(served, model_config):
    _, server = served
    client = _client(model_config, [server.url])
    with pytest.raises(RolloutEngineError, match="HTTP 400.*outside the vocabulary"):
        client.generate([GenerateRequest(input_ids=[1, 900], max_new_tokens=2)])
    key = {"Authorization": f"Bearer {API_KEY}"}
    answer = requests.post(
        server.url + "/generate", json={"text": "hello"}, headers=key, timeout=10
    )
    assert answer.status_code == 400 and "no tokenizer" in answer.json()["error"]["message"]
    info = requests.get(server.url + "/server_info", headers=key, timeout=10).json()
    assert info["engine"] == "embedded"
    update = requests.post(
        server.url + "/update_weights_from_tensor", json={}, headers=key, timeout=10
    )
    assert update.status_code == 404


class _RecordingHandler(BaseHTTPRequestHandler):
    """A server that records the calls it gets: answers the weight-update bracket and any update
    with success, and /generate with whatever the test scripted (tests/real_sglang runs a real
    SGLang 0.5.23 where its venv exists)."""

    protocol_version = "HTTP/1.1"
    calls: list[str]
    generate_answer: tuple[int, bytes]

    def log_message(self, *args):
        pass

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.calls.append(self.path)
        if self.path == "/generate":
            status, data = self.generate_answer
        else:
            status, data = (
                200,
                json.dumps({"success": True, "message": "ok", "seen": body}).encode(),
            )
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def recording_server():
    handler = type("Handler", (_RecordingHandler,), {"calls": [], "generate_answer": (200, b"[]")})
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
    yield handler, f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def test_tensor_updates_run_inside_the_bracket_disk_updates_outside(
    recording_server, model_config, tmp_path
):
    """SGLang 0.5.23 refuses tensor (and distributed) updates outside the bracket, and
    post-processes disk updates twice inside it (tests/real_sglang)."""
    handler, url = recording_server
    engine = EmbeddedEngine(model_config, seed=1)
    client = _client(model_config, [url], weight_transport=TensorTransport(bucket_bytes=1 << 30))
    client.sync_weights(engine.hf_state(), version=5)
    client.sync_weights(engine.hf_state(), version=6)
    bracket = ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    assert handler.calls == bracket * 2
    assert client.servers[0].has_weight_update_bracket is True and client.weight_version == 6
    handler.calls.clear()
    client.weight_transport = DiskTransport(str(tmp_path))
    client.sync_weights(engine.hf_state(), version=7)
    assert handler.calls == ["/update_weights_from_disk"] and client.weight_version == 7


@pytest.mark.parametrize(
    "answer, message",
    [
        ((200, b"not json at all"), "malformed answer"),
        ((200, b'{"output_ids": [1]}'), "meta_info is missing"),
        ((500, b'{"error": {"message": "CUDA error"}}'), "HTTP 500.*CUDA error"),
    ],
)
def test_broken_answers_give_clear_errors(recording_server, model_config, answer, message):
    handler, url = recording_server
    handler.generate_answer = answer
    client = _client(model_config, [url])
    with pytest.raises(RolloutEngineError, match=f"{url}/generate: .*{message}"):
        client.generate([GenerateRequest(input_ids=[1], max_new_tokens=1)])
