"""The loopback server of the embedded engine in a child process of its own.

``rollout.engine=embedded_http`` with ``rollout.embedded_server_process=true``: the server runs
``python -m megatron_gspo.rollout.server`` beside the trainer instead of in a thread of it, so
that generation and training run in parallel on a CPU without sharing one Python interpreter
lock, and a server that dies can be restarted (the asynchronous producer does, then re-sends the
newest weights: :meth:`megatron_gspo.rollout.sglang_client.SGLangEngine.recover`).

The process dies with the trainer, even a SIGKILLed one (:mod:`megatron_gspo.runtime.lifetime`), and
takes the run's API key from its environment, never from its command line (which other users
can read in ``ps``).
"""

from __future__ import annotations

import json
import socket
import sys
from typing import Optional

from megatron_gspo.config import EMBEDDED_MAX_BATCH_SIZE, ModelConfig, to_dict
from megatron_gspo.rollout.auth import API_KEY_ENV
from megatron_gspo.rollout.server import LOOPBACK_HOST
from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess

START_DEADLINE_S = 300.0
"""Start-up of a fresh server: importing torch and transformers and building the model."""


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK_HOST, 0))
        return probe.getsockname()[1]


class EmbeddedServerProcess:
    """One ``python -m megatron_gspo.rollout.server`` child process on a fixed loopback port.

    A restart reuses the port (the server sets ``SO_REUSEADDR``), so the client keeps its URL.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        api_key: str,
        log_path: str,
        seed: int = 0,
        dtype: str = "float32",
        max_batch_size: int = EMBEDDED_MAX_BATCH_SIZE,
        route_source: str = "own",
        threads: Optional[int] = None,
        port: Optional[int] = None,
    ):
        self.port = port if port is not None else free_loopback_port()
        command = [
            sys.executable,
            "-m",
            "megatron_gspo.rollout.server",
            "--host",
            LOOPBACK_HOST,
            "--port",
            str(self.port),
            "--seed",
            str(seed),
            "--dtype",
            dtype,
            "--max-batch-size",
            str(max_batch_size),
            "--route-source",
            route_source,
            "--model-config",
            json.dumps(to_dict(model_config)),
        ]
        if threads is not None:
            command += ["--threads", str(threads)]
        # The key travels in the environment (readable by this user only), never on the command
        # line, which every local user reads in /proc/<pid>/cmdline.
        self.process = SGLangServerProcess(
            command,
            log_path,
            name="embedded rollout server",
            api_key=api_key,
            api_key_environment=API_KEY_ENV,
        )
        self.api_key = api_key
        self.restarts = 0

    @property
    def url(self) -> str:
        return self.process.url

    @property
    def pid(self) -> Optional[int]:
        return None if self.process.process is None else self.process.process.pid

    def start(self, deadline_s: float = START_DEADLINE_S) -> EmbeddedServerProcess:
        """Start the server and return once it answers ``/health_generate``."""
        self.process.start()
        try:
            self.process.wait_until_healthy(deadline_s, poll_s=0.2)
        except BaseException:
            self.process.stop()
            raise
        return self

    def restart(self, deadline_s: float) -> None:
        """Stop what is left of the server and start a fresh one (initial random weights: the
        caller sends the newest weights again)."""
        self.process.stop(timeout_s=5.0)
        self.restarts += 1
        self.start(deadline_s)

    def stop(self) -> None:
        self.process.stop()
