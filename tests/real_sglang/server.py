"""A real SGLang 0.5.23 server on this CPU for the tests of this package.

SGLang lives in a virtual environment of its own (its transformers/tokenizers pins conflict with
the project's); the tests reach it over HTTP only, as a trainer does. ``MEGATRON_GSPO_SGLANG_VENV``
names that environment (``.ci/run`` builds it with ``../shared/sglang-cpu/setup.sh``); without it
every test here is skipped with :data:`SKIP_REASON`.

The server is started by the project's own launcher (``build_launch_command`` +
``SGLangServerProcess``) with the flags SGLang's CPU backend needs
(:mod:`megatron_gspo.rollout.sglang_cpu`), float32 on the plain-torch path
(``SGLANG_CPU_DISABLE_AMX=1``) unless a test asks for bfloat16, ``--skip-tokenizer-init`` (the
trainer sends token ids), ``--enable-return-routed-experts`` (R3) and a per-run ``--api-key``
(which the launcher passes in a ``--config`` file, never on the command line).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil
import requests

from megatron_gspo.config import ModelConfig
from megatron_gspo.rollout.auth import new_api_key
from megatron_gspo.rollout.sglang_cpu import (
    SGLANG_VENV_ENV,
    cpu_server_args,
    cpu_server_env,
    venv_python,
)
from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess, build_launch_command

VENV_ENV = SGLANG_VENV_ENV
SGLANG_VERSION = "0.5.23"
SKIP_REASON = (
    f"real SGLang server tests: set {VENV_ENV} to a virtual environment with SGLang "
    f"{SGLANG_VERSION} for CPU, built with `bash ../shared/sglang-cpu/setup.sh VENV` (about 2 "
    "minutes; .ci/run does both)"
)


def server_model_config(**overrides: Any) -> ModelConfig:
    """The CPU demo's model shape (Qwen3-MoE, 2 layers, 8 experts, top-2, vocab 16) with peaked
    random logits (``init_std=0.2``), so that samples and routes are far from uniform."""
    return ModelConfig(**{"init_std": 0.2, **overrides})


READY_ENV = "MEGATRON_GSPO_SGLANG_VENV_READY"
"""Set by ``.ci/run`` while it builds the SGLang environment beside the tests: the file that the
build writes when it ends, ``ok`` or ``failed`` and the build's last lines."""
BUILD_TIMEOUT_S = 1200.0


def wait_for_sglang_build(timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Returns once the background build of the SGLang environment has succeeded (at once when
    none runs: :data:`READY_ENV` unset); raises when it failed or did not end in time."""
    ready = os.environ.get(READY_ENV)
    if not ready:
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the SGLang environment's build did not end in {timeout_s:.0f} s")
        time.sleep(1.0)
    status = Path(ready).read_text()
    if status.splitlines()[:1] != ["ok"]:
        raise RuntimeError(f"the SGLang environment's build beside the tests failed:\n{status}")


def sglang_python() -> Optional[str]:
    """The interpreter of the SGLang environment, None when :data:`VENV_ENV` is unset; raises
    when it is set but holds no interpreter (a broken setup must fail, not skip). While
    ``.ci/run`` builds the environment beside the tests, it waits for the build."""
    venv = os.environ.get(VENV_ENV)
    if not venv:
        return None
    wait_for_sglang_build()
    python = venv_python(venv)
    if not python.exists():
        raise FileNotFoundError(f"{VENV_ENV}={venv} has no bin/python; rebuild it ({SKIP_REASON})")
    return str(python)


@dataclass
class RealServer:
    """A running server: its URL, key, model directory and process (with SGLang's children)."""

    url: str
    api_key: str
    model_dir: Path
    model: ModelConfig
    process: SGLangServerProcess
    tree: list = field(default_factory=list)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def post(self, path: str, payload: Any = None, timeout: float = 120.0) -> Any:
        """POST ``payload`` with the key; the JSON answer, or its text when it is not JSON
        (``/abort_request`` answers an empty body); raises on a non-200 status."""
        response = requests.post(
            self.url + path, json=payload or {}, headers=self.headers, timeout=timeout
        )
        response.raise_for_status()
        try:
            return response.json()
        except ValueError:
            return response.text

    def get(self, path: str, timeout: float = 60.0) -> Any:
        response = requests.get(self.url + path, headers=self.headers, timeout=timeout)
        response.raise_for_status()
        return response.json()

    def reset(self) -> None:
        """Back to the exported weights (version 0), nothing running, not paused."""
        self.post("/continue_generation", {})
        self.post("/abort_request", {"abort_all": True})
        body = {"model_path": str(self.model_dir), "weight_version": "0", "flush_cache": True}
        # Aborted requests leave the running batch at the scheduler's next step; until then the
        # cache flush of the update answers 400.
        deadline = time.monotonic() + 60
        while True:
            response = requests.post(
                self.url + "/update_weights_from_disk", json=body, headers=self.headers, timeout=120
            )
            if response.status_code != 400 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        response.raise_for_status()
        assert response.json()["success"], response.text

    def remember_tree(self) -> None:
        """Record the server's processes (SGLang's scheduler and detokenizer are children)."""
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.process.process.pid)
            known = {p.pid for p in self.tree}
            self.tree += [p for p in [root, *root.children(recursive=True)] if p.pid not in known]

    def stop(self) -> list[str]:
        """Stop the server by its process and every child it had; the processes that had to be
        killed after the server's own shutdown (empty when SGLang took its children down)."""
        self.remember_tree()
        self.process.stop(timeout_s=60)
        # SGLang's own shutdown ends its children; re-parented ones may linger as zombies
        # (nobody reaps them in a container), which count as gone.
        deadline = time.monotonic() + 30
        while any(_running(p) for p in self.tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [f"{p.pid} {p.name()}" for p in self.tree if _running(p)]
        for process in self.tree:
            if _running(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.kill()
        return left


def _running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def export_model(model: ModelConfig, directory: Path, seed: int = 0) -> None:
    """A Hugging Face checkpoint (config.json + safetensors) of ``model`` with random weights."""
    from megatron_gspo.convert.hf_config import hf_config_from_model_config
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.weight_sync import write_hf_checkpoint

    engine = EmbeddedEngine(model, seed=seed)
    write_hf_checkpoint(
        engine.hf_state(),
        str(directory),
        config_json=hf_config_from_model_config(model).to_json_string(),
    )
    engine.close()


def start_server(
    python: str,
    model: ModelConfig,
    model_dir: Path,
    log_path: Path,
    port: int,
    dtype: str = "float32",
    skip_tokenizer_init: bool = True,
) -> RealServer:
    """Launch SGLang on 127.0.0.1:``port`` with ``--dtype dtype`` and wait until
    ``/health_generate`` answers (float32: the plain-torch path; bfloat16: SGLang's choice, the
    AMX path on CPUs with AMX, see :mod:`megatron_gspo.rollout.sglang_cpu`).
    ``skip_tokenizer_init=False`` loads the tokenizer in ``model_dir`` (text, stop strings,
    ``min_new_tokens``)."""
    api_key = new_api_key()
    command = build_launch_command(
        str(model_dir),
        port=port,
        enable_return_routed_experts=True,
        skip_tokenizer_init=skip_tokenizer_init,
        python_executable=python,
        api_key=api_key,
        extra_args=cpu_server_args(dtype),
    )
    process = SGLangServerProcess(command, str(log_path), env=cpu_server_env(dtype)).start()
    server = RealServer(process.url, api_key, model_dir, model, process)
    try:
        # 15 s on an idle 2-core machine, minutes on a crowded one.
        process.wait_until_healthy(deadline_s=600)
    except BaseException:
        server.stop()
        raise
    server.remember_tree()
    return server


def run_python(command: list[str], env: dict[str, str], log_path: Path, timeout: float) -> str:
    """Run ``command`` with its output in ``log_path`` (a file, not a pipe: the tensor transport
    starts torch's ``torch_shm_manager`` daemon, which inherits the descriptors and lives as long
    as the server holds shared memory, so a pipe would never reach end-of-file); its output, or
    an AssertionError with the tail."""
    with log_path.open("w") as log:
        result = subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout
        )
    output = log_path.read_text(errors="replace")
    if result.returncode:
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}):\n{output[-8000:]}")
    return output
