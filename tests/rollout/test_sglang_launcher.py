"""SGLang launch commands (pure), and the process wrapper on a real child server.

A real SGLang server needs a GPU; the process wrapper is exercised with the embedded server's
command-line entry point, which answers /health_generate the same way.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.config import SGLangConfig
from megatron_gspo.rollout.auth import API_KEY_ENV, new_api_key
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_launcher import (
    SGLangServerProcess,
    build_launch_command,
    launch_command_from_config,
)
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError
from tests.rollout.conftest import tiny_model_config


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_command_has_the_managed_flags():
    command = build_launch_command(
        "/models/qwen3-30b-a3b",
        port=30001,
        tp_size=8,
        ep_size=8,
        mem_fraction_static=0.7,
        enable_return_routed_experts=True,
        extra_args=["--moe-a2a-backend", "deepep", "--attn-dp-size=8"],
        python_executable="/usr/bin/python3",
    )
    assert command[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert _flag(command, "--model-path") == "/models/qwen3-30b-a3b"
    assert _flag(command, "--host") == "127.0.0.1" and _flag(command, "--port") == "30001"
    assert _flag(command, "--tp-size") == "8" and _flag(command, "--ep-size") == "8"
    assert _flag(command, "--mem-fraction-static") == "0.7"
    assert _flag(command, "--weight-version") == "0"
    assert "--skip-tokenizer-init" in command and "--enable-return-routed-experts" in command
    assert command[-3:] == ["--moe-a2a-backend", "deepep", "--attn-dp-size=8"]


def test_routed_experts_flag_only_for_r3():
    command = build_launch_command("/m", port=1)
    assert "--enable-return-routed-experts" not in command
    assert "--mem-fraction-static" not in command and "--base-gpu-id" not in command


@pytest.mark.parametrize(
    "extra", [["--tp-size", "4"], ["--port=9"], ["--enable-return-routed-experts"]]
)
def test_extra_args_may_not_override_managed_flags(extra):
    with pytest.raises(ValueError, match="duplicates a managed flag"):
        build_launch_command("/m", port=1, extra_args=extra)


def test_invalid_sizes():
    with pytest.raises(ValueError, match="ep_size must divide tp_size"):
        build_launch_command("/m", port=1, tp_size=4, ep_size=3)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        build_launch_command("/m", port=1, mem_fraction_static=1.5)


def test_command_from_the_sglang_section():
    sglang = SGLangConfig(port=31000, tp=2, ep=2, extra_args=["--x"])
    command = launch_command_from_config(
        sglang, "/m", enable_return_routed_experts=True, server_index=1
    )
    assert _flag(command, "--port") == "31001" and _flag(command, "--base-gpu-id") == "2"
    assert _flag(command, "--tp-size") == "2" and command[-1] == "--x"
    assert "--enable-memory-saver" not in command


def test_sglang_python_runs_the_launched_servers():
    """SGLang from its own environment: the command starts with that interpreter."""
    sglang = SGLangConfig()
    command = launch_command_from_config(sglang, "/m", enable_return_routed_experts=False)
    assert command[:3] == [sys.executable, "-m", "sglang.launch_server"]
    sglang.python = "/venvs/sglang/bin/python"
    command = launch_command_from_config(sglang, "/m", enable_return_routed_experts=False)
    assert command[:3] == ["/venvs/sglang/bin/python", "-m", "sglang.launch_server"]


def test_releasing_memory_launches_with_the_memory_saver():
    sglang = SGLangConfig(release_memory=True)
    command = launch_command_from_config(sglang, "/m", enable_return_routed_experts=False)
    assert command.count("--enable-memory-saver") == 1
    sglang.extra_args = ["--enable-memory-saver"]
    command = launch_command_from_config(sglang, "/m", enable_return_routed_experts=False)
    assert command.count("--enable-memory-saver") == 1


# As SGLang does, the stand-in reads its --config file and prints its arguments, the key among
# them, to its log; it also prints its own command line (what every local user can read).
FAKE_SGLANG = (
    "import json, os, stat, sys\n"
    "path = sys.argv[sys.argv.index('--config') + 1]\n"
    "print('cmdline', open('/proc/self/cmdline', 'rb').read(), flush=True)\n"
    "print('mode', oct(stat.S_IMODE(os.stat(path).st_mode)), 'config', path)\n"
    "print('api_key', json.load(open(path))['api-key'])\n"
    "print('CUDA out of memory'); sys.exit(3)\n"
)


def test_the_key_goes_in_a_private_config_file_not_on_the_command_line(tmp_path, caplog):
    command = [sys.executable, "-c", FAKE_SGLANG, "--host", "127.0.0.1"]
    command += ["--port", str(free_port()), "--api-key", "s3cret-value"]
    server = SGLangServerProcess(command, str(tmp_path / "server.log"))
    assert server.api_key == "s3cret-value" and "s3cret-value" not in server.command
    with caplog.at_level("INFO", logger="megatron_gspo.rollout.sglang_launcher"):
        server.start()
    with pytest.raises(
        RolloutEngineError, match="exited with code 3(.|\n)*CUDA out of memory"
    ) as error:
        server.wait_until_healthy(deadline_s=60, poll_s=0.1)
    log = (tmp_path / "server.log").read_text()
    (command_line,) = [line for line in log.splitlines() if line.startswith("cmdline")]
    assert "--config" in command_line and "s3cret-value" not in command_line
    assert "api_key s3cret-value" in log and "mode 0o600" in log
    config = log.split(" config ")[1].split()[0]
    assert not os.path.exists(config)  # removed once the server is past reading it
    assert "s3cret-value" not in str(error.value) and "***" in str(error.value)
    assert "s3cret-value" not in caplog.text
    assert (tmp_path / "server.log").stat().st_mode & 0o077 == 0  # the log is for this user only


def test_keys_sglang_cannot_take_are_refused():
    command = [sys.executable, "-c", "pass", "--host", "127.0.0.1", "--port", "1"]
    with pytest.raises(ValueError, match="starts with '-'"):
        SGLangServerProcess(command, "server.log", api_key="-leading-dash")
    with pytest.raises(ValueError, match="--config"):
        SGLangServerProcess([*command, "--config", "x.yaml"], "server.log", api_key="key")
    with pytest.raises(ValueError, match="SGLang reads one"):
        build_launch_command("/m", port=1, extra_args=["--config", "x.yaml"])
    # The trainer's own keys never start with "-" (one in 64 of token_urlsafe's would).
    assert not any(new_api_key().startswith("-") for _ in range(1000))


def test_child_server_becomes_healthy_and_serves(tmp_path):
    config = tiny_model_config()
    fields = {k: v for k, v in vars(config).items()}
    port = free_port()
    command = [sys.executable, "-m", "megatron_gspo.rollout.server", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--model-config", json.dumps(fields)]
    server = SGLangServerProcess(
        command, str(tmp_path / "server.log"), api_key="child-key", api_key_environment=API_KEY_ENV
    ).start()
    try:
        server.wait_until_healthy(deadline_s=120, poll_s=0.2)
        keyless = SGLangEngine([server.url], RouteLayout.from_model_config(config), max_retries=0)
        with pytest.raises(RolloutEngineError, match="HTTP 401"):
            keyless.generate([GenerateRequest(input_ids=[1, 2], max_new_tokens=1)])
        client = SGLangEngine(
            [server.url], RouteLayout.from_model_config(config), api_key="child-key"
        )
        (result,) = client.generate(
            [GenerateRequest(input_ids=[1, 2], max_new_tokens=3, return_routed_experts=True)]
        )
        assert result.response_length == 3 and result.routed_experts.shape == (4, 1, 2)
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_launched_server_dies_with_a_sigkilled_trainer(tmp_path):
    """SIGKILL gives the trainer no chance to stop its servers: the kernel must (PDEATHSIG)."""
    import signal
    import subprocess
    import time

    import psutil

    server_command = [sys.executable, "-c", "import time; time.sleep(600)"]
    server_command += ["--host", "127.0.0.1", "--port", str(free_port())]
    trainer_code = (
        "import sys, time\n"
        "from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess\n"
        f"server = SGLangServerProcess({server_command!r}, {str(tmp_path / 'server.log')!r})\n"
        "print(server.start().process.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    trainer = subprocess.Popen(
        [sys.executable, "-c", trainer_code], stdout=subprocess.PIPE, text=True
    )
    try:
        server = psutil.Process(int(trainer.stdout.readline()))
        time.sleep(1.0)  # the exec shim has replaced itself with the server command
        assert "time.sleep(600)" in " ".join(server.cmdline())
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if server.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            server.kill()
            raise AssertionError("the launched server outlived its SIGKILLed trainer")
    finally:
        trainer.kill()


def test_a_launched_server_does_not_inherit_torchrun_s_process_group(monkeypatch, tmp_path):
    """A trainer under torchrun launches its server with its own environment minus torchrun's
    rendezvous: SGLang's env:// process group would otherwise wait for the trainer's world."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "LOCAL_RANK": "0",
        "TORCHELASTIC_RUN_ID": "none",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MEGATRON_GSPO_KEPT", "yes")
    command = [sys.executable, "-c", "pass", "--host", "127.0.0.1", "--port", "1"]
    server = SGLangServerProcess(command, str(tmp_path / "server.log"), env={"EXTRA": "1"})
    assert not {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"} & set(server.env)
    assert not [name for name in server.env if name.startswith("TORCHELASTIC_")]
    assert server.env["MEGATRON_GSPO_KEPT"] == "yes" and server.env["EXTRA"] == "1"
