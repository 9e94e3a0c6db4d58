"""Several rollout servers: a session's requests go to the server holding its prefix (sticky),
a new session to the least loaded one, and every request carries the weight version's cache
salt. Two real loopback servers whose engines have different weights tell apart which served."""

from __future__ import annotations

from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.server import EmbeddedServer
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.types import GenerateRequest
from tests.rollout.conftest import tiny_model_config

API_KEY = "sticky-test-key"


def _request(session_id: str, turn: int) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1, 2, 3 + turn], max_new_tokens=4, seed=11, session_id=session_id
    )


def test_sessions_stick_to_their_server_and_spread_when_new():
    config = tiny_model_config()
    engines = [EmbeddedEngine(config, seed=seed) for seed in (1, 2)]
    servers = [EmbeddedServer(engine, api_key=API_KEY).start() for engine in engines]
    client = SGLangEngine([server.url for server in servers], api_key=API_KEY)
    try:
        assert client.cache_salt == "weights-v0"
        first = {session: client.generate([_request(session, 0)])[0] for session in ("a", "b")}
        homes = {session: client.session_server(session) for session in ("a", "b")}
        # Two new sessions, nothing in flight: the second goes to the server holding none.
        assert set(homes.values()) == {server.url for server in servers}
        for session, result in first.items():
            engine = engines[[server.url for server in servers].index(homes[session])]
            # The session's own server answered: its weights give these tokens.
            assert engine.generate([_request(session, 0)])[0].output_ids == result.output_ids
        for turn in range(1, 3):
            for session in ("a", "b"):
                result = client.generate([_request(session, turn)])[0]
                engine = engines[[server.url for server in servers].index(homes[session])]
                expected = engine.generate([_request(session, turn)])[0]
                assert result.output_ids == expected.output_ids
                assert client.session_server(session) == homes[session]
        client.end_session("a")
        assert client.session_server("a") is None
    finally:
        client.close()
        for server in servers:
            server.close()
