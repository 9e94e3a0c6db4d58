"""The loopback rollout server's checks (run's key, Host, content type) over real HTTP, the
factory's per-run key, the launcher's ``--api-key``, and the warning for a non-loopback host."""

from __future__ import annotations

import http.client
import json

import pytest
import requests
import torch

from megatron_gspo.config import ConfigWarning, RolloutConfig, SGLangConfig
from megatron_gspo.config.schema import is_loopback_host
from megatron_gspo.rollout.auth import API_KEY_ENV, bearer_matches, host_header_is_loopback
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.server import EmbeddedServer
from megatron_gspo.rollout.sglang_launcher import build_launch_command, redacted
from megatron_gspo.weight_sync import write_hf_checkpoint

KEY = "the-runs-secret"


@pytest.fixture
def served(model_config):
    engine = EmbeddedEngine(model_config, seed=1)
    with EmbeddedServer(engine, api_key=KEY) as server:
        yield engine, server


@pytest.fixture
def donor_weights(model_config, tmp_path):
    """A complete weight directory of a different model: a successful update changes weights."""
    directory = tmp_path / "donor"
    write_hf_checkpoint(EmbeddedEngine(model_config, seed=2).hf_state(), str(directory))
    return str(directory)


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.hf_state()}


def _post_raw(url: str, path: str, body: bytes, headers: dict[str, str]) -> int:
    """A POST with exactly these headers (requests would add Host and Content-Type itself)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            connection.putheader(name, value)
        connection.endheaders(body)
        return connection.getresponse().status
    finally:
        connection.close()


def test_weight_update_needs_the_key_a_loopback_host_and_json(served, donor_weights):
    engine, server = served
    before = _snapshot(engine)
    body = json.dumps({"model_path": donor_weights, "weight_version": "7"}).encode()
    host = f"127.0.0.1:{server.port}"
    json_type = "application/json"
    refused = [
        ({"Host": host, "Content-Type": json_type}, 401),  # no key
        ({"Host": host, "Content-Type": json_type, "Authorization": "Bearer guess"}, 401),
        ({"Host": host, "Content-Type": json_type, "Authorization": KEY}, 401),  # no scheme
        (
            {"Host": "evil.example", "Content-Type": json_type, "Authorization": f"Bearer {KEY}"},
            403,
        ),
        ({"Content-Type": json_type, "Authorization": f"Bearer {KEY}"}, 403),  # no Host
        ({"Host": host, "Content-Type": "text/plain", "Authorization": f"Bearer {KEY}"}, 415),
        ({"Host": host, "Authorization": f"Bearer {KEY}"}, 415),  # no content type
    ]
    for headers, status in refused:
        assert _post_raw(server.url, "/update_weights_from_disk", body, headers) == status
        assert engine.weight_version == 0
    for name, tensor in engine.hf_state():
        assert torch.equal(tensor, before[name]), name
    for host_name in (host, f"localhost:{server.port}", "[::1]", "127.0.0.1"):
        headers = {"Host": host_name, "Content-Type": json_type, "Authorization": f"Bearer {KEY}"}
        assert _post_raw(server.url, "/update_weights_from_disk", body, headers) == 200
    assert engine.weight_version == 7
    assert any(not torch.equal(tensor, before[name]) for name, tensor in engine.hf_state())


def test_every_endpoint_but_health_needs_the_key(served):
    engine, server = served
    key = {"Authorization": f"Bearer {KEY}"}
    for method, path in [
        ("GET", "/model_info"),
        ("GET", "/server_info"),
        ("GET", "/flush_cache"),
        ("POST", "/generate"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/abort_request"),
        ("POST", "/flush_cache"),
    ]:
        answer = requests.request(method, server.url + path, json={}, timeout=10)
        assert answer.status_code == 401, path
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert engine._paused is None and engine._abort_epoch == 0  # nothing reached the engine
    for path in ("/health", "/health_generate"):
        assert requests.get(server.url + path, timeout=30).status_code == 200
    assert requests.get(server.url + "/model_info", headers=key, timeout=10).status_code == 200
    generated = requests.post(
        server.url + "/generate",
        json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
        headers=key,
        timeout=30,
    )
    assert generated.status_code == 200 and len(generated.json()["output_ids"]) == 2


def test_key_and_host_checks():
    assert bearer_matches(f"Bearer {KEY}", KEY) and bearer_matches(f"bearer {KEY}", KEY)
    assert not bearer_matches(None, KEY) and not bearer_matches(f"Basic {KEY}", KEY)
    assert not bearer_matches(f"Bearer {KEY}x", KEY) and not bearer_matches("Bearer ", KEY)
    for host in ("127.0.0.1", "127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:80", "[::1]"):
        assert host_header_is_loopback(host), host
    for host in ("", None, "10.0.0.1:80", "localhost.evil.com", "127.0.0.1:x", "[::1]x", "::1"):
        assert not host_header_is_loopback(host), host
    assert is_loopback_host("127.0.0.2") and is_loopback_host("::1") and is_loopback_host("[::1]")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("node-3")


def test_factory_gives_the_loopback_server_a_fresh_key(model_config, tmp_path):
    clients = [
        build_rollout_engine(
            RolloutConfig(engine="embedded_http"), model_config, seed=1, work_dir=str(tmp_path)
        )
        for _ in range(2)
    ]
    try:
        keys = [client._headers["Authorization"] for client in clients]
        assert keys[0] != keys[1] and all(len(key) > len("Bearer ") + 40 for key in keys)
        url = clients[0].urls[0]
        assert requests.get(url + "/model_info", timeout=10).status_code == 401
        wrong = {"Authorization": keys[1]}
        assert requests.get(url + "/model_info", headers=wrong, timeout=10).status_code == 401
        assert clients[0].info()["servers"][0]["engine"] == "embedded"  # the client's key works
    finally:
        for client in clients:
            client.close()


def test_launch_command_carries_the_key_and_logs_hide_it():
    command = build_launch_command("/m", port=1, api_key="s3cret-value")
    assert command[command.index("--api-key") + 1] == "s3cret-value"
    assert "s3cret-value" not in redacted(command) and "--api-key ***" in redacted(command)
    assert "--api-key" not in build_launch_command("/m", port=1)
    with pytest.raises(ValueError, match="duplicates a managed flag"):
        build_launch_command("/m", port=1, extra_args=["--api-key=x"])


def test_non_loopback_sglang_host_warns():
    with pytest.warns(ConfigWarning, match="sglang.host.*not a loopback address"):
        RolloutConfig(engine="sglang", sglang=SGLangConfig(launch=True, host="0.0.0.0"))
    with pytest.warns(ConfigWarning, match="sglang.host"):
        RolloutConfig(engine="sglang", sglang=SGLangConfig(launch=True, host="10.1.2.3"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        RolloutConfig(engine="sglang", sglang=SGLangConfig(launch=True, host="127.0.0.1"))
        RolloutConfig(engine="sglang", sglang=SGLangConfig(launch=True, host="localhost"))
        RolloutConfig(engine="sglang", sglang=SGLangConfig(urls=["http://10.0.0.5:30000"]))


def test_external_servers_get_the_key_from_the_environment(model_config, monkeypatch, tmp_path):
    engine = EmbeddedEngine(model_config, seed=1)
    with EmbeddedServer(engine, api_key=KEY) as server:
        rollout = RolloutConfig(
            engine="sglang", sglang=SGLangConfig(urls=[server.url]), weight_transport="disk"
        )
        monkeypatch.delenv(API_KEY_ENV, raising=False)
        # Refused at start: the client reads /server_info when it connects.
        with pytest.raises(Exception, match="401"):
            build_rollout_engine(rollout, model_config, work_dir=str(tmp_path))
        monkeypatch.setenv(API_KEY_ENV, KEY)
        client = build_rollout_engine(rollout, model_config, work_dir=str(tmp_path))
        client.flush_cache()
        client.close()
