"""Building the rollout engine that ``rollout.engine`` names.

=================  ===========================================================================
``embedded``       :class:`EmbeddedEngine` in this process; weights by value.
``embedded_http``  the same engine behind its loopback server, driven by :class:`SGLangEngine`
                   (the production client path on CPU); weights through the disk transport.
                   The server runs in a thread, or with ``rollout.embedded_server_process`` in
                   a child process of its own (restarted by :meth:`SGLangEngine.recover`).
``sglang``         :class:`SGLangEngine` on ``rollout.sglang_urls``, or on servers launched
                   from ``model.hf_path`` when ``rollout.sglang_launch``.
=================  ===========================================================================

The returned engine owns what it started: ``close()`` stops the loopback server or the launched
SGLang processes. Servers it starts get a fresh per-run API key (the loopback server's key;
SGLang's ``--api-key``) that the client sends on every call; servers named in
``rollout.sglang_urls`` get the key in ``MEGATRON_GSPO_SGLANG_API_KEY`` (see ``auth.py``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import ExitStack
from typing import Optional

from megatron_gspo.config import ConfigError, ModelConfig, RolloutConfig
from megatron_gspo.rollout.auth import api_key_from_environment, new_api_key
from megatron_gspo.rollout.types import RolloutEngine

logger = logging.getLogger(__name__)


def build_rollout_engine(
    rollout: RolloutConfig,
    model: ModelConfig,
    *,
    seed: int = 0,
    enable_routed_experts: bool = False,
    work_dir: Optional[str] = None,
    master_address: Optional[str] = None,
    master_port: Optional[int] = None,
) -> RolloutEngine:
    """The engine of ``rollout.engine`` for ``model``.

    Args:
        seed: initial random weights of the embedded engine (real weights arrive by sync).
        enable_routed_experts: R3; launched SGLang servers get --enable-return-routed-experts.
        work_dir: weight files of the disk transport and server logs (a temporary directory
            when None).
        master_address / master_port: rendezvous of the distributed weight transport (None:
            from ``rollout.weight_sync_address`` / ``weight_sync_port``, else this machine's
            address towards the first server and a free port).
    """
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    if rollout.engine == "embedded":
        return EmbeddedEngine.from_config(model, rollout, seed=seed)

    from megatron_gspo.rollout.sglang_client import SGLangEngine
    from megatron_gspo.rollout.sglang_protocol import RouteLayout
    from megatron_gspo.rollout.sglang_weights import DiskTransport, transport_from_config

    work_dir = work_dir or tempfile.mkdtemp(prefix="megatron_gspo_rollout_")
    layout = RouteLayout.from_model_config(model) if model.is_moe else None
    client_options = dict(
        request_timeout_s=rollout.request_timeout_s,
        max_retries=rollout.max_retries,
        max_concurrency=rollout.max_concurrency,
    )
    if rollout.engine == "embedded_http":
        from megatron_gspo.rollout.server import CLIENT_REQUESTS_PER_CALL

        client_options["max_requests_per_call"] = CLIENT_REQUESTS_PER_CALL
        # The loopback server takes weights from disk only (it offers no IPC/NCCL endpoints).
        transport = DiskTransport(os.path.join(work_dir, "weights"), config_json=None)
        if rollout.embedded_server_process:
            from megatron_gspo.rollout.server_process import EmbeddedServerProcess

            process = EmbeddedServerProcess(
                model,
                api_key=new_api_key(),
                log_path=os.path.join(work_dir, "embedded_server.log"),
                seed=seed,
                dtype=rollout.dtype,
                threads=rollout.engine_threads,
            ).start()
            return SGLangEngine(
                [process.url],
                layout,
                weight_transport=transport,
                on_close=[process.stop],
                api_key=process.api_key,
                restarters={process.url: process.restart},
                **client_options,
            )
        from megatron_gspo.rollout.server import EmbeddedServer

        server = EmbeddedServer(
            EmbeddedEngine.from_config(model, rollout, seed=seed), api_key=new_api_key()
        ).start()
        return SGLangEngine(
            [server.url],
            layout,
            weight_transport=transport,
            on_close=[server.close],
            api_key=server.api_key,
            **client_options,
        )

    urls = list(rollout.sglang_urls)
    on_close = []
    restarters = {}
    api_key = api_key_from_environment()
    # Servers launched below are stopped if anything after them fails; the engine owns them once
    # it exists (the ExitStack lets go of them then).
    started = ExitStack()
    if not urls:
        if not rollout.sglang_launch:
            raise ConfigError(
                "rollout.sglang_urls",
                "no SGLang server to use",
                "rollout.engine=sglang needs running servers or permission to launch them",
                "set rollout.sglang_urls=[http://host:port, ...] or rollout.sglang_launch=true",
            )
        if model.hf_path is None:
            raise ConfigError(
                "model.hf_path",
                "SGLang needs a Hugging Face model directory to start from",
                "launched servers load their first weights from disk",
                "set model.hf_path (export one with tools/convert_checkpoint.py)",
            )
        from megatron_gspo.rollout.sglang_launcher import launch_sglang_servers

        api_key = api_key or new_api_key()
        servers = launch_sglang_servers(
            rollout,
            model.hf_path,
            enable_return_routed_experts=enable_routed_experts,
            log_dir=work_dir,
            api_key=api_key,
        )
        urls = [server.url for server in servers]
        on_close = [server.stop for server in servers]
        for stop in on_close:
            started.callback(stop)
        restarters = {server.url: _restarter(server) for server in servers}
    with started:
        transport = transport_from_config(
            rollout,
            model,
            num_engines=len(urls),
            disk_dir=os.path.join(work_dir, "weights"),
            master_address=master_address,
            master_port=master_port,
            urls=urls,
        )
        engine = SGLangEngine(
            urls,
            layout,
            weight_transport=transport,
            on_close=on_close,
            api_key=api_key,
            restarters=restarters,
            **client_options,
        )
        check_sglang_servers(engine, rollout, enable_routed_experts=enable_routed_experts)
        started.pop_all()
    return engine


TESTED_SGLANG_VERSION = "0.5.23"
"""The SGLang release the client is tested against, on CPU by tests/real_sglang."""


def check_sglang_servers(engine, rollout: RolloutConfig, *, enable_routed_experts: bool) -> None:
    """Refuse, at start, servers that cannot do what the run asks, every problem at once (from
    ``/server_info``); warn about what only changes reproducibility.

    * R3 needs ``--enable-return-routed-experts`` (else the first rollout fails to parse).
    * ``rollout.sglang_release_memory`` needs ``--enable-memory-saver``: without it SGLang
      answers ``/release_memory_occupation`` with 200 and frees nothing; on CPU the memory saver
      does not exist (it needs libcuda), so SGLang on CPU cannot release memory.
    * Without ``--enable-deterministic-inference`` SGLang ignores ``sampling_seed``: a resumed run
      does not redraw the samples of the interrupted one (a warning; the CPU backend cannot run
      deterministic inference).
    """
    from megatron_gspo.preflight import StartupErrors

    problems: list[ConfigError] = []
    for url, info in zip(engine.urls, engine.server_info()):
        # The embedded engine's loopback server (rollout/server.py) stands in for SGLang in
        # tests: it always returns routes, honours seeds and has no memory of its own.
        stand_in = info.get("engine") == "embedded"
        version = info.get("version")
        if not stand_in and version != TESTED_SGLANG_VERSION:
            logger.warning(
                "%s runs SGLang %s; the client is tested against %s",
                url,
                version,
                TESTED_SGLANG_VERSION,
            )
        if enable_routed_experts and not info.get("enable_return_routed_experts", stand_in):
            problems.append(
                ConfigError(
                    "algo.routing_replay",
                    f"r3, but {url} runs without --enable-return-routed-experts",
                    "R3 replays the routed experts the server returns with every sample",
                    "restart the server with --enable-return-routed-experts, or set "
                    "algo.routing_replay to r2 or none",
                )
            )
        if rollout.sglang_release_memory and not info.get("enable_memory_saver"):
            problems.append(
                ConfigError(
                    "rollout.sglang_release_memory",
                    f"true, but {url} runs without --enable-memory-saver",
                    "without it SGLang answers /release_memory_occupation with 200 and frees "
                    "nothing; SGLang on CPU has no memory saver at all (it needs libcuda)",
                    "start the servers with --enable-memory-saver (GPUs only), or set "
                    "rollout.sglang_release_memory=false",
                )
            )
        if not info.get("enable_deterministic_inference", stand_in):
            logger.warning(
                "%s runs without --enable-deterministic-inference: SGLang ignores sampling "
                "seeds, so a resumed run will not redraw the samples of the interrupted one",
                url,
            )
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise StartupErrors(problems)


def _restarter(server):
    """Restart a launched SGLang server and wait until it is healthy again."""

    def restart(deadline_s: float) -> None:
        server.stop(timeout_s=10.0)
        server.start()
        server.wait_until_healthy(deadline_s)

    return restart
