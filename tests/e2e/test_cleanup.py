"""No process outlives the trainer: not after a SIGKILL (which runs no cleanup at all).

The trainer starts reward worker processes and, at its first checkpoint, Megatron's writer
result queue (a ``multiprocessing`` manager process); each must end when the trainer is killed
(:mod:`megatron_gspo.runtime.lifetime`).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

from .harness import TINY, start, train_command, wait_for_step


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """The processes that still run (a zombie has ended; only its exit status waits)."""
    running = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                running.append(process)
        except psutil.NoSuchProcess:
            pass
    return running


def wait_until_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(processes)


def describe(processes: list[psutil.Process]) -> str:
    lines = []
    for process in processes:
        try:
            memory = process.memory_info().rss / 2**20
            lines.append(f"{process.pid} ({memory:.0f} MB): {' '.join(process.cmdline())[:200]}")
        except psutil.NoSuchProcess:
            pass
    return "\n".join(lines)


def command_line(process: psutil.Process) -> str:
    """Its command line; empty for a child that exited meanwhile (a zombie until reaped: a
    checkpoint save's short-lived helper)."""
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def test_sigkilled_trainer_leaves_no_child(tmp_path):
    output_dir = tmp_path / "out"
    overrides = ["steps=50", *TINY, "checkpoint.interval=1", f"output_dir={output_dir}"]
    launch = start(train_command(overrides), output_dir)
    try:
        # Step 0's checkpoint starts the writer's queue manager. A step's line comes before its
        # checkpoint: kill once step 0's checkpoint is published, while step 1 trains (as before
        # the order changed; a kill in the middle of a save is the SIGKILL test's).
        wait_for_step([launch], output_dir, 0, timeout=240)
        latest = output_dir / "checkpoints" / "latest"
        deadline = time.monotonic() + 120
        while not latest.exists():
            assert time.monotonic() < deadline and launch.process.poll() is None, "no checkpoint"
            time.sleep(0.01)
        trainer = psutil.Process(launch.process.pid)
        children = trainer.children(recursive=True)
        commands = " ".join(command_line(child) for child in children)
        assert "megatron_gspo.reward.worker" in commands, describe(children)
        assert "multiprocessing" in commands, describe(children)  # the writer's queue manager
        trainer.send_signal(signal.SIGKILL)
        launch.process.wait()
        survivors = wait_until_gone(children, timeout=15)
        assert not survivors, f"alive after SIGKILL of the trainer:\n{describe(survivors)}"
    finally:
        launch.kill()


CHILDREN_AFTER_MAIN = """
import json, sys, traceback
import psutil
from megatron_gspo.train import main

try:
    code = main(sys.argv[1:])
except Exception:
    traceback.print_exc()
    code = 1
children = []
for child in psutil.Process().children(recursive=True):
    try:
        if child.status() != psutil.STATUS_ZOMBIE:
            children.append(" ".join(child.cmdline())[:200])
    except psutil.NoSuchProcess:
        pass
print("CHILDREN " + json.dumps(children), flush=True)
sys.exit(code)
"""
"""Runs the trainer in-process, then lists the processes still alive under this one: a failed
run must stop what it started before ``main`` returns (the kernel's parent-death signal only helps
once the whole process is gone)."""


def run_in_process(tmp_path, overrides: list[str], **env_extra: str):
    """``megatron_gspo.train.main(overrides)`` in a fresh interpreter with the stand-in
    ``sglang`` (tests/e2e/standin_sglang) and ``tmp_path`` importable; returns the completed
    process and the commands of its children still alive after ``main`` returned."""
    import json
    import subprocess
    import sys

    from .harness import REPO_ROOT, subprocess_env

    env = subprocess_env()
    standin = REPO_ROOT / "tests" / "e2e" / "standin_sglang"
    env["PYTHONPATH"] = f"{standin}:{tmp_path}:{env['PYTHONPATH']}"
    env.update(env_extra)
    result = subprocess.run(
        [sys.executable, "-c", CHILDREN_AFTER_MAIN, *overrides],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        start_new_session=True,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("CHILDREN ")]
    assert lines, (result.stdout + result.stderr)[-4000:]
    alive = [
        command
        for command in json.loads(lines[0].removeprefix("CHILDREN "))
        # Python's own resource tracker of this interpreter: it ends with it, by design.
        if "multiprocessing.resource_tracker" not in command
    ]
    return result, alive


def unassigned_port() -> int:
    """A free port below the kernel's ephemeral range, so that the sockets the trainer opens
    meanwhile (gloo, its store), which take ephemeral ports, cannot take it first."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(max(1024, low - 10_000), low), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port below the ephemeral range")


def launched_server_overrides(tmp_path) -> list[str]:
    """A run whose rollout engine is a launched (stand-in) SGLang server on a tiny HF model."""
    from transformers import AutoModelForCausalLM

    from megatron_gspo.config import ModelConfig
    from megatron_gspo.convert.hf_config import hf_config_from_model_config

    hf_dir = tmp_path / "hf"
    model = AutoModelForCausalLM.from_config(hf_config_from_model_config(ModelConfig()))
    model.save_pretrained(hf_dir)
    return [
        *TINY,
        "rollout.engine=sglang",
        "rollout.sglang.launch=true",
        "rollout.weight_transport=disk",
        f"rollout.sglang.port={unassigned_port()}",
        f"model.hf_path={hf_dir}",
        f"output_dir={tmp_path / 'out'}",
    ]


def test_failed_run_stops_everything_it_started(tmp_path):
    """A run with a launched (stand-in) SGLang server, reward worker processes and a checkpoint
    writer fails at step 1 (its reward fails on every sample): nothing it started is alive
    when it returns."""
    (tmp_path / "failing_reward.py").write_text(
        "def always_fails(sample):\n    raise RuntimeError('stand-in reward failure')\n"
    )
    overrides = [
        *launched_server_overrides(tmp_path),
        "steps=5",
        "checkpoint.interval=1",
        "reward.functions=[failing_reward:always_fails]",
        "reward.max_failed_steps=2",
    ]
    result, alive = run_in_process(tmp_path, overrides)
    log = result.stdout + result.stderr
    assert result.returncode == 3, log[-4000:]  # megatron_gspo.runtime.health.EXIT_CODE
    assert "failed on every sample of 2 batches" in log, log[-4000:]
    assert "saved checkpoint" in log and "starting SGLang" in log, log[-4000:]
    assert alive == [], alive


@pytest.mark.slow
def test_failure_while_starting_stops_what_already_started(tmp_path):
    """The reward workers start, then the SGLang server dies while starting: the workers are
    stopped although the driver was never complete."""
    result, alive = run_in_process(
        tmp_path, [*launched_server_overrides(tmp_path), "steps=1"], STANDIN_SGLANG_FAIL="1"
    )
    log = result.stdout + result.stderr
    assert result.returncode == 1 and "exited with code 3 while starting" in log, log[-4000:]
    assert "reward: 1 * synthetic (2 process workers" in log
    assert alive == [], alive
