"""Child processes that end with the trainer, however the trainer ends.

A clean exit, an exception or Ctrl-C closes what the run started (``loop.run`` holds one exit
stack). A SIGKILL (the OOM killer, ``kill -9``, a scheduler pre-empting the job) gives the trainer
no chance to run any cleanup, so every long-lived child also asks the kernel to end it when its
parent dies:

- launched SGLang servers: started through :func:`command_dying_with_parent`, a two-line exec
  shim that sets ``PR_SET_PDEATHSIG`` and then ``exec``\\ s the server (the setting survives
  ``exec``, so the server process itself carries it; SGLang's own children already end with it);
- Megatron's checkpoint-writer result queue: a ``multiprocessing`` manager process that
  ``dist_checkpointing`` spawns at the first save and never stops (277 MB on the CPU demo);
  :mod:`megatron_gspo.engine.checkpoint` starts it itself, with :func:`die_with_parent` as the
  manager's initializer;
- reward workers: a watchdog thread that exits when the worker is re-parented
  (:mod:`megatron_gspo.reward.worker` says why not ``PR_SET_PDEATHSIG`` there);
- Megatron's checkpoint writers: ``dist_checkpointing`` forks short-lived writer processes in
  the middle of a save; :func:`forks_die_with_parent` around the save has every process forked
  by the main thread meanwhile ask for SIGKILL when the trainer dies (else a writer forked just
  before a SIGKILL finishes its part of a checkpoint nobody will read, seconds later on a busy
  machine).

``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends, not the process: start
such children from the main thread (the trainer does), never from a short-lived thread. It is a
Linux feature; elsewhere these functions only check that the parent is still alive.

Two helpers for processes that start short-lived process trees (the reward workers and their
code sandboxes, ``docs/code-sandbox.md``): :func:`become_subreaper`, so that the orphans of
those trees come back to the process that can reap them rather than to PID 1 (a trainer started
as a container's PID 1 reaps nothing it did not start), and :func:`kill_process_tree`, which ends
a child and everything below it and waits until they are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Optional

import psutil

PR_SET_PDEATHSIG = 1
"""``prctl`` option (linux/prctl.h): the signal the kernel sends when the parent thread dies."""
PR_SET_CHILD_SUBREAPER = 36
"""``prctl`` option (linux/prctl.h): orphaned descendants are re-parented to this process."""

_EXEC_SHIM = (
    "import ctypes, os, signal, sys\n"
    "parent = int(sys.argv[1])\n"
    "if sys.platform.startswith('linux'):\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)\n"
    "if os.getppid() != parent:\n"
    "    sys.exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)
"""``python -c`` program of :func:`command_dying_with_parent` (argv: parent pid, command...). It
imports nothing of this package, so it runs under any ``PYTHONPATH``. The ``getppid`` check
covers a parent that died before ``prctl`` took effect."""


def die_with_parent(parent_pid: int, signal_number: int = signal.SIGKILL) -> None:
    """Have the kernel send ``signal_number`` to this process when its parent dies.

    For a child process to call first thing (e.g. as a ``multiprocessing`` initializer, with the
    parent's pid as argument). If the parent is already gone, the signal is sent right away.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal_number), 0, 0, 0) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(error)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal_number)


def command_dying_with_parent(command: Sequence[str]) -> list[str]:
    """``command`` wrapped so that the process it becomes is SIGKILLed when the process that
    starts it (this one) dies. The wrapper ``exec``\\ s ``command``: same pid, same process, no
    extra process in the tree."""
    return [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), *command]


class _ForkGuard:
    """State of :func:`forks_die_with_parent`: how many blocks are open, and the pid of the
    process whose main thread is forking (set by the before-fork hook, None otherwise)."""

    depth = 0
    forking_parent: Optional[int] = None
    hooks_registered = False

    @classmethod
    def before_fork(cls) -> None:
        main = threading.current_thread() is threading.main_thread()
        cls.forking_parent = os.getpid() if cls.depth and main else None

    @classmethod
    def after_fork_in_child(cls) -> None:
        parent, cls.depth, cls.forking_parent = cls.forking_parent, 0, None
        if parent is not None:
            die_with_parent(parent)


@contextlib.contextmanager
def forks_die_with_parent() -> Iterator[None]:
    """Within the block, a process that the main thread forks (``os.fork``, ``multiprocessing``'s
    fork context; not ``subprocess``, which execs) is SIGKILLed when this process dies. Only the
    main thread's forks: ``PR_SET_PDEATHSIG`` fires when the forking *thread* ends."""
    if not _ForkGuard.hooks_registered:
        os.register_at_fork(
            before=_ForkGuard.before_fork, after_in_child=_ForkGuard.after_fork_in_child
        )
        _ForkGuard.hooks_registered = True
    _ForkGuard.depth += 1
    try:
        yield
    finally:
        _ForkGuard.depth -= 1


def become_subreaper() -> bool:
    """Have the kernel re-parent orphaned descendants of this process to it instead of to PID 1
    (``PR_SET_CHILD_SUBREAPER``); False where that is not available (not Linux).

    A process that sets this must reap those orphans itself (``os.waitpid`` on their pids):
    nothing else will, and each one left is a zombie until this process exits."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(error)}")
    return True


def kill_process_tree(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL the child ``pid`` and every process below it, and return once they are gone.

    The child is stopped (SIGSTOP) first and the tree collected level by level, each level
    stopped before its children are read, so that no process of it can fork one that escapes
    the collection. Descendants that this process ends up parenting (it is PID 1 or a
    subreaper, :func:`become_subreaper`) are reaped; ``pid`` itself is left to its owner
    (``subprocess.Popen.wait``), since reaping it here would take its exit status away."""
    try:
        root = psutil.Process(pid)
        root.suspend()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    tree, level = [root], [root]
    while level:
        children = []
        for process in level:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                children += process.children()
        for process in children:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                process.suspend()
        tree += children
        level = children
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.kill()
    deadline = time.monotonic() + timeout_s
    for process in tree[1:]:
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(process.pid, os.WNOHANG)
            try:
                if process.status() == psutil.STATUS_ZOMBIE:  # dead; its parent reaps it
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)
