"""The bubblewrap command line of the code sandbox (:mod:`megatron_gspo.reward.sandbox`), and
how to know when a sandbox has ended.

``bwrap`` (bubblewrap, github.com/containers/bubblewrap) is the small tool that Flatpak uses to
put untrusted programs into namespaces. It is packaged by every major distribution, needs no
daemon, and starts a sandbox in milliseconds; its options map one to one onto the isolation this
project wants (``docs/code-sandbox.md`` says why it was chosen over the alternatives).
``MEGATRON_GSPO_BWRAP`` names another bwrap binary than the one on ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import site
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Optional

SANDBOX_UID = 65534
"""The sandbox's user and group id inside (and, under a root trainer, outside): nobody."""
SCRATCH = "/sandbox"
"""The writable directory (and working directory) as the sandboxed code sees it."""
HOST_PROC = "/run/host-proc"
"""Where a root trainer's outer bwrap shows the host's /proc to the inner bwrap (only to it): the
kernel lets a user namespace mount a fresh /proc only where some /proc is fully visible, and
the outer bwrap's own /proc has read-only covers on /proc/sys and others."""


class SandboxUnavailableError(RuntimeError):
    """The kernel cannot isolate code here; the message says why and how to fix it."""


def python_directories() -> list[str]:
    """This interpreter's installation: the directories the sandbox must see read-only."""
    executable = os.path.realpath(sys.executable)
    candidates = {
        sys.base_prefix,
        sys.prefix,
        sys.exec_prefix,
        sys.base_exec_prefix,
        os.path.dirname(sys.executable),
        os.path.dirname(os.path.dirname(executable)),
        *site.getsitepackages(),
    }
    return sorted(path for path in candidates if path and os.path.isdir(path))


@lru_cache(maxsize=1)
def system_view() -> tuple[str, ...]:
    """bwrap arguments of the read-only view: system directories (symbolic links kept as such,
    e.g. /bin -> usr/bin on merged-/usr systems) and the Python installation, with the parents
    of the latter created world-traversable (bwrap would copy /root's 0700)."""
    arguments: list[str] = []
    bound: list[str] = []
    for path in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):
            arguments += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            arguments += ["--ro-bind", path, path]
            bound.append(path)
    created: set[str] = set()
    for path in python_directories():
        if any(path == root or path.startswith(root + "/") for root in bound):
            continue
        parents = []
        parent = os.path.dirname(path)
        while parent not in ("/", "") and parent not in created:
            parents.append(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(parents):
            arguments += ["--perms", "0755", "--dir", directory]
            created.add(directory)
        arguments += ["--ro-bind", path, path]
        bound.append(path)
    return tuple(arguments)


@lru_cache(maxsize=4)
def bwrap_features(bwrap: Optional[str]) -> tuple[str, frozenset[str]]:
    """(``bwrap``, the options its --help lists); SandboxUnavailableError if it is absent."""
    if not bwrap or not os.access(bwrap, os.X_OK):
        raise SandboxUnavailableError(
            "the code sandbox needs bubblewrap ('bwrap'), which is not installed"
            + (f" (MEGATRON_GSPO_BWRAP={bwrap})" if bwrap else "")
            + ": install it (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install "
            "bubblewrap), or, for code you trust, set the code reward's isolation option to "
            "'none' (reward.options.code.isolation=none)"
        )
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise SandboxUnavailableError(f"cannot run {bwrap} --help: {error}") from None
    options = frozenset(word for word in usage.stdout.split() if word.startswith("--"))
    return bwrap, options


def sandbox_command(
    files: Mapping[str, int],
    scratch_bytes: int,
    seccomp_fd: Optional[int],
    info_fd: int,
    program: Sequence[str],
) -> list[str]:
    """The command that runs ``program`` confined as :mod:`megatron_gspo.reward.sandbox`
    describes: one unprivileged bwrap, or under root a privileged one around ``setpriv`` (host
    uid 65534) around the unprivileged one.

    ``files``: name -> descriptor of the files copied into the scratch directory (a tmpfs of
    ``scratch_bytes``; ``/dev/shm`` gets one of the same size, the rest of /dev is read-only).
    ``info_fd``: where the bwrap that runs in this process's PID namespace writes the pid of the
    init whose exit ends the call (:func:`open_sandbox_init`).
    """
    bwrap, options = bwrap_features(bwrap_path())
    sized = ["--size", str(scratch_bytes)] if "--size" in options else []
    nested = os.geteuid() == 0
    inner = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--cap-drop",
        "ALL",
        "--hostname",
        "sandbox",
    ]
    if not nested:
        inner += ["--info-fd", str(info_fd)]
    if "--disable-userns" in options:  # bubblewrap >= 0.8; the seccomp filter also covers it
        inner.append("--disable-userns")
    if seccomp_fd is not None:
        inner += ["--seccomp", str(seccomp_fd)]
    inner += [*system_view(), "--proc", "/proc", "--dev", "/dev"]
    inner += [*sized, "--tmpfs", "/dev/shm", *sized, "--tmpfs", SCRATCH]
    for name, descriptor in files.items():
        inner += ["--perms", "0644", "--file", str(descriptor), f"{SCRATCH}/{name}"]
    # The new root and /dev are tmpfs mounts too: read-only, so that the two sized tmpfs mounts
    # are the only places to write.
    inner += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", SCRATCH, "--", *program]
    if not nested:
        return inner
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    # The outer bwrap has a PID namespace of its own, and its init is the process whose end ends
    # the call: when that init exits or is killed, the kernel kills every process of its
    # namespace, the inner sandbox's included, whatever their uid. The parent-death signal
    # cannot do that across the uid change: the outer bwrap, root without capabilities, is not
    # allowed to signal host uid 65534, so a SIGKILLed reward worker used to leave the inner
    # bwrap and the program running. Its own /proc goes with it (the inner bwrap reads and
    # writes its child's entries there); the code gets a /proc of its own again. /tmp (bwrap's
    # own mount point inside) is a fresh tmpfs mounted *before* the view: a Python installation
    # under /tmp (a virtual environment there) is then bound on top of it, not hidden below it.
    outer = [
        bwrap,
        "--unshare-pid",
        "--die-with-parent",
        "--info-fd",
        str(info_fd),
        "--cap-drop",
        "ALL",
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
        "--tmpfs",
        "/tmp",
        *system_view(),
        "--proc",
        "/proc",
        "--bind",
        "/proc",
        HOST_PROC,
        "--dev",
        "/dev",
        "--",
        setpriv,
        f"--reuid={SANDBOX_UID}",
        f"--regid={SANDBOX_UID}",
        "--clear-groups",
        "--inh-caps=-all",
        "--ambient-caps=-all",
        "--bounding-set=-all",
        "--",
    ]
    return outer + inner


def open_sandbox_init(process: subprocess.Popen, info_read: int, deadline: float) -> Optional[int]:
    """A pidfd of the sandbox's first process (the init of its PID namespace), from the JSON
    that bwrap writes to its info descriptor once the namespace exists; None if bwrap ended
    before (it failed to start) or the deadline passed."""
    received = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([info_read], [], [], 0.05)
        if ready:
            chunk = os.read(info_read, 65536)
            received += chunk
            try:
                child = int(json.loads(received.decode())["child-pid"])
            except (ValueError, KeyError):
                if not chunk:
                    return None
                continue
            try:
                return os.pidfd_open(child)
            except OSError:  # already gone
                return None
        elif process.poll() is not None:
            return None
    return None


def end_sandbox(process: subprocess.Popen, init: Optional[int], kill: bool) -> None:
    """Wait until every process of the sandbox is gone, after killing them if ``kill``; then
    wait for ``process`` (the bwrap started) and reap the sandbox's init if it came back to
    this process.

    bwrap exits as soon as the program's first process does; the kernel then kills the rest of
    the PID namespace, and its init exits only when all of them are reaped. So the init's exit
    (its pidfd becoming readable) is the moment nothing of the call is left. By then the init's
    parent (a bwrap) is gone, and the init was re-parented to the nearest subreaper or to PID 1.
    Where that is this process (a reward worker is a subreaper; a trainer may be a container's
    PID 1) nothing else would ever reap it, and each call would leave a zombie: it is reaped
    here; anywhere else its new parent does that."""
    try:
        if init is not None:
            try:
                if kill:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(init, signal.SIGKILL)
                if not select.select([init], [], [], 10.0)[0]:
                    signal.pidfd_send_signal(init, signal.SIGKILL)
                    select.select([init], [], [], 10.0)
            except OSError:
                pass
        # bwrap's own session (start_new_session): whatever of it is left.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if init is not None:
            with contextlib.suppress(OSError):  # ChildProcessError: not ours to reap
                os.waitid(os.P_PIDFD, init, os.WEXITED | os.WNOHANG)
    finally:
        if init is not None:
            os.close(init)


def bwrap_path() -> Optional[str]:
    """``MEGATRON_GSPO_BWRAP``, else ``bwrap`` on PATH (None when there is none)."""
    return os.environ.get("MEGATRON_GSPO_BWRAP") or shutil.which("bwrap")
