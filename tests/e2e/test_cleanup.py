"""No process outlives the trainer: not after a SIGKILL (which runs no cleanup at all).

The trainer starts reward worker processes and, at its first checkpoint, Megatron's writer
result queue (a ``multiprocessing`` manager process); each must end when the trainer is killed
(:mod:`megatron_gspo.lifetime`).
"""

from __future__ import annotations

import signal
import time

import psutil

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


def test_sigkilled_trainer_leaves_no_child(tmp_path):
    output_dir = tmp_path / "out"
    overrides = ["steps=50", *TINY, "checkpoint.interval=1", f"output_dir={output_dir}"]
    launch = start(train_command(overrides), output_dir)
    try:
        wait_for_step([launch], output_dir, 0, timeout=240)  # a checkpoint was written before it
        trainer = psutil.Process(launch.process.pid)
        children = trainer.children(recursive=True)
        commands = " ".join(" ".join(child.cmdline()) for child in children)
        assert "megatron_gspo.reward.worker" in commands, describe(children)
        assert "multiprocessing" in commands, describe(children)  # the writer's queue manager
        trainer.send_signal(signal.SIGKILL)
        launch.process.wait()
        survivors = wait_until_gone(children, timeout=15)
        assert not survivors, f"alive after SIGKILL of the trainer:\n{describe(survivors)}"
    finally:
        launch.kill()
