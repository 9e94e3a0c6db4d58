"""Starting SGLang servers: ``python -m sglang.launch_server`` as a child process.

:func:`build_launch_command` is a pure function (tested on CPU); :class:`SGLangServerProcess`
starts it, waits for ``/health_generate`` with a deadline and, if the server dies or never gets
healthy, raises with the tail of its log; the server dies with the trainer, even a SIGKILLed one
(:mod:`megatron_gspo.lifetime`). Actually launching needs a GPU and sglang installed.

Flags (SGLang 0.5.23 ServerArgs): ``--model-path``, ``--host``, ``--port``, ``--tp-size``,
``--ep-size``, ``--mem-fraction-static``, ``--skip-tokenizer-init`` (the trainer sends token ids),
``--weight-version 0`` (versions are integers from the start), ``--base-gpu-id``,
``--enable-return-routed-experts`` for R3, and ``--api-key`` (the run's secret: SGLang then
refuses every call but ``/health*`` without ``Authorization: Bearer <key>``). Other ServerArgs
pass through ``extra_args``. Commands are logged with the key replaced by ``***``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import requests

from megatron_gspo.lifetime import command_dying_with_parent
from megatron_gspo.rollout.types import RolloutEngineError

logger = logging.getLogger(__name__)

MANAGED_FLAGS = (
    "--model-path",
    "--model",
    "--host",
    "--port",
    "--tp-size",
    "--tp",
    "--ep-size",
    "--ep",
    "--mem-fraction-static",
    "--skip-tokenizer-init",
    "--enable-return-routed-experts",
    "--weight-version",
    "--base-gpu-id",
    "--api-key",
)


def build_launch_command(
    model_path: str,
    *,
    port: int,
    host: str = "127.0.0.1",
    tp_size: int = 1,
    ep_size: int = 1,
    mem_fraction_static: Optional[float] = None,
    enable_return_routed_experts: bool = False,
    skip_tokenizer_init: bool = True,
    weight_version: int = 0,
    base_gpu_id: Optional[int] = None,
    extra_args: Sequence[str] = (),
    python_executable: str = sys.executable,
    api_key: Optional[str] = None,
) -> list[str]:
    """The argv that starts one SGLang server.

    Raises ``ValueError`` when ``extra_args`` repeats a flag this function manages (the two
    values would silently fight) or when a size is invalid.
    """
    for flag in extra_args:
        name = flag.split("=", 1)[0]
        if name in MANAGED_FLAGS:
            raise ValueError(
                f"extra SGLang argument {flag!r} duplicates a managed flag; set it through the "
                "rollout config (sglang_tp, sglang_ep, sglang_mem_fraction, sglang_port, ...)"
            )
    if tp_size < 1 or ep_size < 1 or tp_size % ep_size:
        raise ValueError(
            f"tp_size={tp_size}, ep_size={ep_size}: SGLang carves expert parallel groups out of "
            "the tensor parallel ranks, so ep_size must divide tp_size"
        )
    if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static={mem_fraction_static} is outside (0, 1)")
    command = [
        python_executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp_size),
        "--ep-size",
        str(ep_size),
        "--weight-version",
        str(weight_version),
    ]
    if mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(mem_fraction_static)]
    if skip_tokenizer_init:
        command.append("--skip-tokenizer-init")
    if enable_return_routed_experts:
        command.append("--enable-return-routed-experts")
    if base_gpu_id is not None:
        command += ["--base-gpu-id", str(base_gpu_id)]
    if api_key:
        command += ["--api-key", api_key]
    return command + list(extra_args)


def redacted(command: Sequence[str]) -> str:
    """``command`` as one line for logs, with the value of ``--api-key`` replaced by ``***``."""
    text = " ".join(command)
    key = _api_key_of(command)
    return text.replace(key, "***") if key else text


def _api_key_of(command: Sequence[str]) -> Optional[str]:
    for index, word in enumerate(command):
        if word == "--api-key" and index + 1 < len(command):
            return command[index + 1]
        if word.startswith("--api-key="):
            return word.partition("=")[2]
    return None


def launch_command_from_config(
    rollout: Any,
    model_path: str,
    *,
    enable_return_routed_experts: bool,
    server_index: int = 0,
    api_key: Optional[str] = None,
) -> list[str]:
    """The command of server ``server_index`` from a :class:`RolloutConfig`: port
    ``sglang_port + server_index``, GPUs from ``server_index * sglang_tp``;
    ``--enable-memory-saver`` with ``rollout.sglang_release_memory`` (what releasing needs); run
    by ``rollout.sglang_python`` (SGLang's own environment) or else this interpreter."""
    extra_args = list(rollout.sglang_extra_args)
    if rollout.sglang_release_memory and "--enable-memory-saver" not in extra_args:
        extra_args.append("--enable-memory-saver")
    return build_launch_command(
        model_path,
        port=rollout.sglang_port + server_index,
        host=rollout.sglang_host,
        tp_size=rollout.sglang_tp,
        ep_size=rollout.sglang_ep,
        mem_fraction_static=rollout.sglang_mem_fraction,
        enable_return_routed_experts=enable_return_routed_experts,
        base_gpu_id=server_index * rollout.sglang_tp,
        extra_args=extra_args,
        api_key=api_key,
        python_executable=rollout.sglang_python or sys.executable,
    )


def _url_of(command: Sequence[str]) -> str:
    host = command[command.index("--host") + 1]
    port = command[command.index("--port") + 1]
    return f"http://{host}:{port}"


class SGLangServerProcess:
    """One SGLang server child process with its log file.

    Usage::

        server = SGLangServerProcess(command, log_path).start()
        server.wait_until_healthy(deadline_s=900)
        ...
        server.stop()
    """

    def __init__(
        self,
        command: Sequence[str],
        log_path: str,
        env: Optional[dict[str, str]] = None,
        *,
        name: str = "SGLang server",
    ):
        self.command = list(command)
        self.log_path = log_path
        self.name = name
        """What the server is, in messages."""
        self.url = _url_of(self.command)
        self.env = {**os.environ, **(env or {})}
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> SGLangServerProcess:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        # SGLang logs its arguments, the API key among them: the log is for this user only.
        descriptor = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log_file = os.fdopen(descriptor, "ab")
        logger.info("starting %s: %s (log %s)", self.name, redacted(self.command), self.log_path)
        # The server is SIGKILLed by the kernel if the trainer dies without stopping it (a
        # SIGKILLed trainer runs no cleanup); see megatron_gspo.lifetime.
        self.process = subprocess.Popen(
            command_dying_with_parent(self.command),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
        )
        log_file.close()
        return self

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log_file:
                tail = "".join(log_file.readlines()[-num_lines:])
        except OSError as error:
            return f"<log {self.log_path} unreadable: {error}>"
        # SGLang prints its arguments: the tail goes into exceptions, the key must not.
        key = _api_key_of(self.command)
        return tail.replace(key, "***") if key else tail

    def wait_until_healthy(self, deadline_s: float = 900.0, poll_s: float = 2.0) -> None:
        """Poll ``/health_generate`` until it answers 200; raise with the log tail if the
        process exits or ``deadline_s`` passes (a cold start compiles kernels: minutes)."""
        if self.process is None:
            raise RuntimeError("wait_until_healthy() before start()")
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            code = self.process.poll()
            if code is not None:
                raise RolloutEngineError(
                    f"{self.name} {self.url} exited with code {code} while starting; last log "
                    f"lines ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                if (
                    requests.get(self.url + "/health_generate", timeout=poll_s * 5).status_code
                    == 200
                ):
                    return
            except requests.RequestException:
                pass
            time.sleep(poll_s)
        raise RolloutEngineError(
            f"{self.name} {self.url} not healthy after {deadline_s:.0f}s; last log lines "
            f"({self.log_path}):\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``timeout_s``)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_sglang_servers(
    rollout: Any,
    model_path: str,
    *,
    num_servers: int = 1,
    enable_return_routed_experts: bool = False,
    log_dir: str = ".",
    deadline_s: float = 900.0,
    api_key: Optional[str] = None,
) -> list[SGLangServerProcess]:
    """Start ``num_servers`` servers from a :class:`RolloutConfig` and wait until all are
    healthy; if one fails, every started server is stopped before the error propagates.
    ``api_key``: the servers' ``--api-key`` (the client must send the same)."""
    servers = [
        SGLangServerProcess(
            launch_command_from_config(
                rollout,
                model_path,
                enable_return_routed_experts=enable_return_routed_experts,
                server_index=index,
                api_key=api_key,
            ),
            os.path.join(log_dir, f"sglang_server_{index}.log"),
        )
        for index in range(num_servers)
    ]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_until_healthy(deadline_s)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
