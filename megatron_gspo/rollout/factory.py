"""Building the rollout engine that ``rollout.engine`` names: a registry, one builder per engine.

=================  ===========================================================================
``embedded``       :class:`EmbeddedEngine` in this process; weights by value.
``embedded_http``  the same engine behind its loopback server, driven by :class:`SGLangEngine`
                   (the production client path on CPU); weights through the disk transport.
                   The server runs in a thread, or with ``rollout.embedded_server_process`` in
                   a child process of its own (restarted by :meth:`SGLangEngine.recover`).
``sglang``         :class:`SGLangEngine` on the servers of ``rollout.sglang``, listed or
                   launched (:mod:`megatron_gspo.rollout.sglang_engine`).
=================  ===========================================================================

Each builder takes the rollout section (an engine reads its own nested section, e.g.
``rollout.sglang``, and the rollout-wide keys), the model and the :class:`EngineOptions` of the
call. A new engine is a module with its builder and one line in :data:`ENGINE_BUILDERS` (and, for
its start-up check, in :data:`megatron_gspo.startup.preflight.ENGINE_START_CHECKS`).

The returned engine owns what it started: ``close()`` stops the loopback server or the launched
servers. Servers it starts get a fresh per-run API key that the client sends on every call.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Optional

from megatron_gspo.config import ModelConfig, RolloutConfig
from megatron_gspo.rollout.auth import new_api_key
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.server import CLIENT_REQUESTS_PER_CALL, EmbeddedServer
from megatron_gspo.rollout.server_process import EmbeddedServerProcess
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_engine import build_sglang_engine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import EngineOptions, RolloutEngine
from megatron_gspo.weight_sync import DiskTransport

logger = logging.getLogger(__name__)

EngineBuilder = Callable[[RolloutConfig, ModelConfig, EngineOptions], RolloutEngine]


def build_embedded_engine(
    rollout: RolloutConfig, model: ModelConfig, options: EngineOptions
) -> EmbeddedEngine:
    """``embedded``: the policy as a transformers model in this process."""
    return EmbeddedEngine.from_config(model, rollout, seed=options.seed)


def build_embedded_http_engine(
    rollout: RolloutConfig, model: ModelConfig, options: EngineOptions
) -> SGLangEngine:
    """``embedded_http``: the embedded engine behind its loopback server (a thread, or a child
    process with ``rollout.embedded_server_process``), driven by the SGLang client."""
    work_dir = options.working_dir()
    layout = RouteLayout.from_model_config(model) if model.is_moe else None
    client_options = dict(
        request_timeout_s=rollout.request_timeout_s,
        max_retries=rollout.max_retries,
        max_concurrency=rollout.max_concurrency,
        max_requests_per_call=CLIENT_REQUESTS_PER_CALL,
    )
    # The loopback server takes weights from disk only (it offers no IPC/NCCL endpoints).
    transport = DiskTransport(os.path.join(work_dir, "weights"), config_json=None)
    if rollout.embedded_server_process:
        process = EmbeddedServerProcess(
            model,
            api_key=new_api_key(),
            log_path=os.path.join(work_dir, "embedded_server.log"),
            seed=options.seed,
            dtype=rollout.dtype,
            max_batch_size=rollout.embedded_max_batch_size,
            route_source=rollout.embedded_route_source,
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
    server = EmbeddedServer(
        EmbeddedEngine.from_config(model, rollout, seed=options.seed), api_key=new_api_key()
    ).start()
    return SGLangEngine(
        [server.url],
        layout,
        weight_transport=transport,
        on_close=[server.close],
        api_key=server.api_key,
        **client_options,
    )


ENGINE_BUILDERS: dict[str, EngineBuilder] = {
    "embedded": build_embedded_engine,
    "embedded_http": build_embedded_http_engine,
    "sglang": build_sglang_engine,
}
"""``rollout.engine`` -> its builder (the names are ``config.ROLLOUT_ENGINES``)."""


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
    """The engine of ``rollout.engine`` for ``model``; the arguments are those of
    :class:`EngineOptions`."""
    options = EngineOptions(
        seed=seed,
        enable_routed_experts=enable_routed_experts,
        work_dir=work_dir,
        master_address=master_address,
        master_port=master_port,
    )
    return ENGINE_BUILDERS[rollout.engine](rollout, model, options)
