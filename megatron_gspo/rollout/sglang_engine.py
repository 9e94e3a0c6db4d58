"""The SGLang engine built from its section of the configuration, ``rollout.sglang``: the servers
listed in ``rollout.sglang.urls``, or servers launched from ``model.hf_path`` when
``rollout.sglang.launch``; the checks of those servers when the engine connects
(:func:`check_sglang_servers`) and before the run starts (:func:`sglang_start_problems`).

Registered by name in :data:`megatron_gspo.rollout.factory.ENGINE_BUILDERS` and
:data:`megatron_gspo.startup.preflight.ENGINE_START_CHECKS`; another engine is a module like
this one, with its own configuration section, and one line in each registry.

Servers this engine launches get a fresh per-run API key (SGLang's ``--api-key``) that the client
sends on every call; listed servers get the key in ``MEGATRON_GSPO_SGLANG_API_KEY`` (see
``auth.py``). The engine owns what it started: ``close()`` stops the launched processes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
from contextlib import ExitStack
from typing import Optional

import requests

from megatron_gspo.config import ConfigError, ModelConfig, RolloutConfig, TrainConfig
from megatron_gspo.config.schema import StartupErrors
from megatron_gspo.config.sglang import KEY, SGLangConfig
from megatron_gspo.rollout.auth import api_key_from_environment, new_api_key
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess, launch_sglang_servers
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import EngineOptions
from megatron_gspo.weight_sync import transport_from_config

logger = logging.getLogger(__name__)

TESTED_SGLANG_VERSION = "0.5.23"
"""The SGLang release the client is tested against, on CPU by tests/real_sglang."""

SERVER_CHECK_TIMEOUT_S = 5.0
"""How long a listed SGLang server may take to answer ``/health`` at start-up."""


def no_server_error() -> ConfigError:
    """Neither servers to use nor permission to launch them."""
    return ConfigError(
        f"{KEY}.urls",
        "no SGLang server to use",
        "rollout.engine=sglang needs running servers or permission to launch them",
        f"set {KEY}.urls=[http://host:port, ...] or {KEY}.launch=true",
    )


def no_model_error() -> ConfigError:
    """Servers to launch, but no model directory to start them from."""
    return ConfigError(
        "model.hf_path",
        "SGLang needs a Hugging Face model directory to start from",
        "launched servers load their first weights from disk",
        "set model.hf_path (export one with tools/convert_checkpoint.py)",
    )


def build_sglang_engine(
    rollout: RolloutConfig, model: ModelConfig, options: EngineOptions
) -> SGLangEngine:
    """The client of the servers ``rollout.sglang`` names or launches, with the weight transport
    ``rollout.weight_transport`` names; its servers checked (:func:`check_sglang_servers`)."""
    sglang = rollout.sglang
    work_dir = options.working_dir()
    urls = list(sglang.urls)
    on_close = []
    restarters = {}
    api_key = api_key_from_environment()
    # Servers launched below are stopped if anything after them fails; the engine owns them once
    # it exists (the ExitStack lets go of them then).
    started = ExitStack()
    if not urls:
        if not sglang.launch:
            raise no_server_error()
        if model.hf_path is None:
            raise no_model_error()
        api_key = api_key or new_api_key()
        servers = launch_sglang_servers(
            sglang,
            model.hf_path,
            enable_return_routed_experts=options.enable_routed_experts,
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
            master_address=options.master_address,
            master_port=options.master_port,
            urls=urls,
        )
        engine = SGLangEngine(
            urls,
            RouteLayout.from_model_config(model) if model.is_moe else None,
            weight_transport=transport,
            on_close=on_close,
            api_key=api_key,
            restarters=restarters,
            request_timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            max_concurrency=rollout.max_concurrency,
        )
        check_sglang_servers(engine, sglang, enable_routed_experts=options.enable_routed_experts)
        started.pop_all()
    return engine


def check_sglang_servers(
    engine: SGLangEngine, sglang: SGLangConfig, *, enable_routed_experts: bool
) -> None:
    """Refuse, at start, servers that cannot do what the run asks, every problem at once (from
    ``/server_info``); warn about what only changes reproducibility.

    * R3 needs ``--enable-return-routed-experts`` (else the first rollout fails to parse).
    * ``rollout.sglang.release_memory`` needs ``--enable-memory-saver``: without it SGLang
      answers ``/release_memory_occupation`` with 200 and frees nothing; on CPU the memory saver
      does not exist (it needs libcuda), so SGLang on CPU cannot release memory.
    * Without ``--enable-deterministic-inference`` SGLang ignores ``sampling_seed``: a resumed run
      does not redraw the samples of the interrupted one (a warning; the CPU backend cannot run
      deterministic inference).
    """
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
        if sglang.release_memory and not info.get("enable_memory_saver"):
            problems.append(
                ConfigError(
                    f"{KEY}.release_memory",
                    f"true, but {url} runs without --enable-memory-saver",
                    "without it SGLang answers /release_memory_occupation with 200 and frees "
                    "nothing; SGLang on CPU has no memory saver at all (it needs libcuda)",
                    "start the servers with --enable-memory-saver (GPUs only), or set "
                    f"{KEY}.release_memory=false",
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


def _restarter(server: SGLangServerProcess):
    """Restart a launched SGLang server and wait until it is healthy again."""

    def restart(deadline_s: float) -> None:
        server.stop(timeout_s=10.0)
        server.start()
        server.wait_until_healthy(deadline_s)

    return restart


# --------------------------------------------------------------------------------------------
# Before the run: what can be checked without building anything
# --------------------------------------------------------------------------------------------


def sglang_start_problems(cfg: TrainConfig) -> list[ConfigError]:
    """The start-up check of ``rollout.engine=sglang``: listed servers answer, or what launching
    servers needs is there (a model directory, an interpreter with sglang)."""
    sglang = cfg.rollout.sglang
    if sglang.urls:
        return [error for url in sglang.urls if (error := _unreachable(url)) is not None]
    if not sglang.launch:
        return [no_server_error()]
    errors = []
    if cfg.model.hf_path is None:
        errors.append(no_model_error())
    if sglang.python:
        problem = sglang_unavailable(sglang.python)
        if problem:
            errors.append(
                ConfigError(
                    f"{KEY}.python",
                    f"{sglang.python!r} cannot start SGLang: {problem}",
                    f"launched servers run `<{KEY}.python> -m sglang.launch_server`",
                    "give the bin/python of a virtual environment with sglang installed, or leave "
                    f"{KEY}.python empty to use this interpreter",
                )
            )
    elif importlib.util.find_spec("sglang") is None:
        errors.append(
            ConfigError(
                f"{KEY}.launch",
                "sglang is not installed in this Python environment",
                "launched servers run `python -m sglang.launch_server` with this interpreter",
                f"install sglang (the GPU image has it), set {KEY}.python to the interpreter "
                "of SGLang's own environment, or start servers elsewhere and list them in "
                f"{KEY}.urls",
            )
        )
    return errors


def sglang_unavailable(python: str) -> Optional[str]:
    """Why ``python`` cannot run ``-m sglang.launch_server`` (None when it can): not an
    executable, or sglang not importable there (found without importing it: seconds, not the
    half minute an import of sglang takes)."""
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return "no executable file there"
    try:
        found = subprocess.run(
            [
                python,
                "-c",
                "import importlib.util, sys; sys.exit(not importlib.util.find_spec('sglang'))",
            ],
            capture_output=True,
            timeout=SERVER_CHECK_TIMEOUT_S * 6,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"running it failed ({type(error).__name__})"
    return None if found.returncode == 0 else "sglang is not installed in its environment"


def _unreachable(url: str) -> Optional[ConfigError]:
    """A :class:`ConfigError` unless an SGLang server answers at ``url``: ``/health`` answers
    200, or 401/403 when the server wants an API key (checked at the first call). Any other
    answer (a 404 page, a proxy's error) means the address is some other web server's."""
    try:
        response = requests.get(url.rstrip("/") + "/health", timeout=SERVER_CHECK_TIMEOUT_S)
        if response.status_code not in (200, 401, 403):
            return ConfigError(
                f"{KEY}.urls",
                f"{url}/health answers HTTP {response.status_code} "
                f"({response.reason or 'no reason given'}), not an SGLang server's answer",
                "an SGLang server answers /health with 200 (401 without its API key)",
                "point the URL at the server's address and port (no path), or start the server "
                "(examples/moe/sglang_server.sh)",
            )
    except requests.RequestException as error:
        text = str(error)
        return ConfigError(
            f"{KEY}.urls",
            f"{url} does not answer ({type(error).__name__}: "
            f"{text.splitlines()[0] if text else ''})",
            "every listed SGLang server serves rollouts from the first step on",
            "start the server (examples/moe/sglang_server.sh), fix the address, or leave "
            f"{KEY}.urls empty with {KEY}.launch=true",
        )
    return None
