"""One real SGLang server for the whole package (started once: 15-60 s on 2 cores).

Package scope: pytest tears the server down after this package's last test, so it does not idle
through the rest of the suite. Teardown stops it by its process and fails the run if any of its
processes (SGLang's scheduler and detokenizer are children) had to be killed afterwards.
"""

from __future__ import annotations

import pytest
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from .server import (
    SGLANG_VERSION,
    SKIP_REASON,
    RealServer,
    export_model,
    server_model_config,
    sglang_python,
    start_server,
)


@pytest.fixture(scope="package")
def sglang_server(tmp_path_factory) -> RealServer:
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    directory = tmp_path_factory.mktemp("real_sglang")
    model = server_model_config()
    export_model(model, directory / "model")
    server = start_server(
        python, model, directory / "model", directory / "server.log", free_port("127.0.0.1")
    )
    try:
        info = server.get("/server_info")
        assert info["version"] == SGLANG_VERSION, info["version"]
        yield server
    finally:
        left = server.stop()
        assert not left, f"processes of the SGLang server outlived it and were killed: {left}"


@pytest.fixture
def fresh_server(sglang_server) -> RealServer:
    """The server with its exported weights (version 0), nothing running, not paused."""
    sglang_server.reset()
    return sglang_server
