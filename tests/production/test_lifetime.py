"""megatron_gspo.runtime.lifetime: processes forked inside ``forks_die_with_parent`` end with a SIGKILLed
parent; forks outside it (and forks of other threads) are left alone, as before."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import psutil
import pytest

PARENT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from megatron_gspo.runtime.lifetime import forks_die_with_parent

    def fork_sleeper():
        pid = os.fork()
        if pid == 0:
            quiet = os.open(os.devnull, os.O_WRONLY)  # let go of the test's output pipes
            os.dup2(quiet, 1)
            os.dup2(quiet, 2)
            time.sleep(120)
            os._exit(0)
        return pid

    mode = sys.argv[1]
    if mode == "guarded":
        with forks_die_with_parent():
            child = fork_sleeper()
    elif mode == "other_thread":
        children = []
        with forks_die_with_parent():
            thread = threading.Thread(target=lambda: children.append(fork_sleeper()))
            thread.start()
            thread.join()
        child = children[0]
    else:
        child = fork_sleeper()
    print(child, flush=True)
    time.sleep(0.5)  # the child is past its fork hook
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def child_after_parent_sigkill(mode: str) -> psutil.Process | None:
    """Start a parent that forks a sleeping child and SIGKILLs itself; the child if it still runs
    2 s later (killed then by the test), else None."""
    parent = subprocess.run(
        [sys.executable, "-c", PARENT, mode], capture_output=True, text=True, timeout=60
    )
    assert parent.returncode == -9, parent.stderr
    child = psutil.Process(int(parent.stdout.split()[0])) if parent.stdout.strip() else None
    assert child is not None
    deadline = time.monotonic() + 2.0
    try:
        while time.monotonic() < deadline:
            if not child.is_running() or child.status() == psutil.STATUS_ZOMBIE:
                return None
            time.sleep(0.05)
    except psutil.NoSuchProcess:
        return None
    child.kill()
    return child


def test_a_fork_inside_the_block_dies_with_its_parent():
    assert child_after_parent_sigkill("guarded") is None


@pytest.mark.parametrize("mode", ["unguarded", "other_thread"])
def test_other_forks_are_left_alone(mode):
    """Outside the block nothing changes; a fork by another thread is not tied to the parent
    either (PR_SET_PDEATHSIG would fire when that thread ends, long before the process)."""
    assert child_after_parent_sigkill(mode) is not None
