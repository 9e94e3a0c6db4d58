"""Starting SGLang servers: ``python -m sglang.launch_server`` as a child process.

:func:`build_launch_command` is a pure function (tested on CPU); :class:`SGLangServerProcess`
starts it, waits for ``/health_generate`` with a deadline and, if the server dies or never gets
healthy, raises with the tail of its log; the server dies with the trainer, even a SIGKILLed one
(:mod:`megatron_gspo.runtime.lifetime`). Actually launching needs a GPU and sglang installed.

Flags (SGLang 0.5.23 ServerArgs): ``--model-path``, ``--host``, ``--port``, ``--tp-size``,
``--ep-size``, ``--mem-fraction-static``, ``--skip-tokenizer-init`` (the trainer sends token ids),
``--weight-version 0`` (versions are integers from the start), ``--base-gpu-id``,
``--enable-return-routed-experts`` for R3, and ``--api-key`` (the run's secret: SGLang then
refuses every call but ``/health*`` without ``Authorization: Bearer <key>``). Other ServerArgs
pass through ``extra_args``.

The key never reaches a command line: every local user reads every process's
``/proc/<pid>/cmdline`` (``ps``). :class:`SGLangServerProcess` takes ``--api-key`` out of the
command and hands it to SGLang through SGLang's own ``--config FILE.yaml`` (0.5.23:
``prepare_server_args`` in ``sglang/srt/server_args.py`` merges the file's keys into its
arguments, ``sglang/srt/utils/server_args_config_parser.py``), in a file only this user can read,
removed once the server answers; servers that read the key from the environment (the embedded
server) get it there instead (``api_key_environment``). Log tails hide the key as ``***``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Optional

import requests

from megatron_gspo.config import SGLangConfig
from megatron_gspo.rollout.types import RolloutEngineError
from megatron_gspo.runtime.lifetime import command_dying_with_parent

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
    "--config",
)
API_KEY_FLAG = "--api-key"
CONFIG_FLAG = "--config"
"""SGLang's YAML file of extra arguments (one per server): the launcher's way to pass the key."""


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
    """The argv that starts one SGLang server, as SGLang parses it: with ``api_key``, it holds
    ``--api-key <key>``, which :class:`SGLangServerProcess` moves into a private ``--config``
    file before it starts the server (run any other way, the key is on the command line).

    Raises ``ValueError`` when ``extra_args`` repeats a flag this function manages (the two
    values would silently fight) or when a size is invalid.
    """
    for flag in extra_args:
        name = flag.split("=", 1)[0]
        if name == CONFIG_FLAG:
            raise ValueError(
                f"extra SGLang argument {flag!r}: the launcher passes the run's API key in "
                "SGLang's --config file, and SGLang reads one; give the options as "
                "rollout.sglang.extra_args instead"
            )
        if name in MANAGED_FLAGS:
            raise ValueError(
                f"extra SGLang argument {flag!r} duplicates a managed flag; set it through the "
                "rollout.sglang section (tp, ep, mem_fraction, port, ...)"
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
    _, key = without_api_key(command)
    return text.replace(key, "***") if key else text


def without_api_key(command: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """``(command less its --api-key flag, the key or None)``."""
    rest: list[str] = []
    key = None
    words = iter(command)
    for word in words:
        if word == API_KEY_FLAG:
            key = next(words, None)
        elif word.startswith(API_KEY_FLAG + "="):
            key = word.partition("=")[2]
        else:
            rest.append(word)
    return rest, key


def write_api_key_config(api_key: str) -> str:
    """A fresh SGLang ``--config`` file holding ``api-key`` (mode 0600, in the temporary
    directory); its path. JSON is YAML, and quoting the key keeps YAML from reading it as
    another type."""
    descriptor, path = tempfile.mkstemp(prefix="megatron_gspo_sglang_", suffix=".yaml")
    with os.fdopen(descriptor, "w") as config_file:  # mkstemp: readable by this user only
        json.dump({"api-key": api_key}, config_file)
    return path


def launch_command_from_config(
    sglang: SGLangConfig,
    model_path: str,
    *,
    enable_return_routed_experts: bool,
    server_index: int = 0,
    api_key: Optional[str] = None,
) -> list[str]:
    """The command of server ``server_index`` from the ``rollout.sglang`` section: port
    ``port + server_index``, GPUs from ``server_index * tp``; ``--enable-memory-saver`` with
    ``release_memory`` (what releasing needs); run by ``python`` (SGLang's own environment) or
    else this interpreter."""
    extra_args = list(sglang.extra_args)
    if sglang.release_memory and "--enable-memory-saver" not in extra_args:
        extra_args.append("--enable-memory-saver")
    return build_launch_command(
        model_path,
        port=sglang.port + server_index,
        host=sglang.host,
        tp_size=sglang.tp,
        ep_size=sglang.ep,
        mem_fraction_static=sglang.mem_fraction,
        enable_return_routed_experts=enable_return_routed_experts,
        base_gpu_id=server_index * sglang.tp,
        extra_args=extra_args,
        api_key=api_key,
        python_executable=sglang.python or sys.executable,
    )


TORCHRUN_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What torchrun tells its workers about their process group. A server launched by a trainer
under torchrun must not inherit it: SGLang's own process group (``init_process_group`` with the
env:// rendezvous) would read the trainer's world size and master port and wait forever for
ranks that never join (found by tools/rehearse_presets.py: a launched CPU server under torchrun
hung at "Init parallel begin")."""


def without_torchrun_env(environment: Mapping[str, str]) -> dict[str, str]:
    """``environment`` without torchrun's process-group variables (:data:`TORCHRUN_ENV`,
    ``TORCHELASTIC_*``)."""
    return {
        name: value
        for name, value in environment.items()
        if name not in TORCHRUN_ENV and not name.startswith("TORCHELASTIC_")
    }


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

    The server's API key (``api_key``, or the ``--api-key`` of ``command``, which is taken out
    of it) goes to the server by another way than its command line: in the environment
    variable ``api_key_environment`` when given, else in a private SGLang ``--config`` file
    written at each :meth:`start` and removed once the server answers (it read the file while
    starting) or stops. The health probes send it; log tails in messages hide it.
    """

    def __init__(
        self,
        command: Sequence[str],
        log_path: str,
        env: Optional[dict[str, str]] = None,
        *,
        name: str = "SGLang server",
        api_key: Optional[str] = None,
        api_key_environment: Optional[str] = None,
    ):
        self.command, key_in_command = without_api_key(command)
        if api_key and key_in_command and api_key != key_in_command:
            raise ValueError("api_key and the command's --api-key differ")
        self.api_key = api_key or key_in_command or None
        self.api_key_environment = api_key_environment
        if self.api_key and api_key_environment is None:
            if any(word == CONFIG_FLAG or word.startswith(CONFIG_FLAG + "=") for word in command):
                raise ValueError(
                    f"{CONFIG_FLAG} in the command: the API key goes to SGLang in a --config "
                    "file of its own, and SGLang reads one"
                )
            if self.api_key.startswith("-"):
                # SGLang turns the file into `--api-key <key>` for argparse, which takes a
                # value starting with "-" for an unknown flag and fails to start.
                raise ValueError(
                    "the API key starts with '-', which SGLang's argument parser reads as a flag; "
                    "use another key (e.g. `openssl rand -hex 32`)"
                )
        self.log_path = log_path
        self.name = name
        """What the server is, in messages."""
        self.url = _url_of(self.command)
        self.env = {**without_torchrun_env(os.environ), **(env or {})}
        if self.api_key and api_key_environment is not None:
            self.env[api_key_environment] = self.api_key  # readable by this user only
        self.process: Optional[subprocess.Popen] = None
        self._config_path: Optional[str] = None

    def start(self) -> SGLangServerProcess:
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        # SGLang logs its arguments, the API key among them: the log is for this user only.
        descriptor = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        log_file = os.fdopen(descriptor, "ab")
        command = self.command
        if self.api_key and self.api_key_environment is None:
            self._remove_config()
            self._config_path = write_api_key_config(self.api_key)
            command = [*command, CONFIG_FLAG, self._config_path]
        logger.info("starting %s: %s (log %s)", self.name, " ".join(command), self.log_path)
        # The server is SIGKILLed by the kernel if the trainer dies without stopping it (a
        # SIGKILLed trainer runs no cleanup); see megatron_gspo.runtime.lifetime.
        try:
            self.process = subprocess.Popen(
                command_dying_with_parent(command),
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        except BaseException:
            self._remove_config()
            raise
        finally:
            log_file.close()
        return self

    def _remove_config(self) -> None:
        """Remove the key's ``--config`` file (the server reads it once, at start)."""
        if self._config_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._config_path)
            self._config_path = None

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log_file:
                tail = "".join(log_file.readlines()[-num_lines:])
        except OSError as error:
            return f"<log {self.log_path} unreadable: {error}>"
        # SGLang prints its arguments: the tail goes into exceptions, the key must not.
        return tail.replace(self.api_key, "***") if self.api_key else tail

    def wait_until_healthy(self, deadline_s: float = 900.0, poll_s: float = 2.0) -> None:
        """Poll ``/health_generate`` until it answers 200; raise with the log tail if the
        process exits or ``deadline_s`` passes (a cold start compiles kernels: minutes)."""
        if self.process is None:
            raise RuntimeError("wait_until_healthy() before start()")
        # With the key, the embedded server's /health_generate runs a forward (without it, only
        # a liveness answer); SGLang's is open either way.
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            code = self.process.poll()
            if code is not None:
                self._remove_config()
                raise RolloutEngineError(
                    f"{self.name} {self.url} exited with code {code} while starting; last log "
                    f"lines ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                answer = requests.get(
                    self.url + "/health_generate", headers=headers, timeout=poll_s * 5
                )
                if answer.status_code == 200:
                    # A server that answers has parsed its arguments long ago.
                    self._remove_config()
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
        self._remove_config()
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def launch_sglang_servers(
    sglang: SGLangConfig,
    model_path: str,
    *,
    num_servers: int = 1,
    enable_return_routed_experts: bool = False,
    log_dir: str = ".",
    deadline_s: float = 900.0,
    api_key: Optional[str] = None,
) -> list[SGLangServerProcess]:
    """Start ``num_servers`` servers from the ``rollout.sglang`` section and wait until all are
    healthy; if one fails, every started server is stopped before the error propagates.
    ``api_key``: the servers' ``--api-key`` (the client must send the same), passed in a
    private ``--config`` file, never on their command lines."""
    servers = [
        SGLangServerProcess(
            launch_command_from_config(
                sglang,
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
