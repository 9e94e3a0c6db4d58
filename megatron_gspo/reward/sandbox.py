"""Run untrusted Python (a model's code) in a constrained child process.

What is enforced, and by what:

===========================  ==================================================================
CPU time                     ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL one second later)
memory                       ``RLIMIT_AS`` (allocations fail: MemoryError)
file size, open files, core  ``RLIMIT_FSIZE`` (also caps stdout/stderr), ``RLIMIT_NOFILE``,
                             ``RLIMIT_CORE`` = 0
wall clock                   the parent kills the child's whole process group after
                             ``wall_time_s``
working directory            a fresh temporary directory, removed afterwards (with everything the
                             code wrote in it)
environment                  scrubbed: PATH, HOME/TMPDIR = the work dir, LANG, single-threaded
                             BLAS; Python runs isolated (``-I``: no PYTHON* variables, no user
                             site, no script directory on sys.path)
network                      kernel: a new, empty network namespace (``unshare --net``, as root,
                             or ``unshare --map-root-user --net`` with user namespaces) when
                             available; always also Python: an audit hook refuses every
                             ``socket.*`` event
processes                    audit hook refuses fork, exec, spawn, ``os.system``, subprocess,
                             ``os.kill``; the child dies with its parent (PR_SET_PDEATHSIG)
files outside the work dir   audit hook refuses opening for writing, creating, removing,
                             renaming, chmod/chown and links outside the work dir (reads are
                             allowed: imports need them)
escape hatches               audit hook refuses importing or using ``ctypes``, raising resource
                             limits, and adding audit hooks
===========================  ==================================================================

The audit hook (PEP 578) is Python-level: native extension code can bypass it. It stops
accidents and naive misbehaviour of model-written code, not a determined attacker; the network
namespace and the resource limits are kernel-enforced. For adversarial code at scale, run the
reward workers in a container or gVisor.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

NETWORK_ISOLATION_MODES = ("auto", "namespace", "python")

# Runs in the child before the user's code; argv: [-c, script, cpu_s, memory_bytes, file_bytes,
# max_open_files]. Kept free of imports beyond the standard library.
_BOOTSTRAP = r"""
import os, resource, sys

def _set_limits(cpu_s, memory_bytes, file_bytes, max_open_files):
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

def _die_with_parent():
    import ctypes
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(137)
    # Forget ctypes so that importing it again goes through the guard's import check.
    for name in [name for name in sys.modules if name.partition(".")[0] in ("ctypes", "_ctypes")]:
        del sys.modules[name]

def _install_guard(workdir):
    workdir = os.path.realpath(workdir)
    blocked_imports = {"ctypes", "_ctypes"}
    blocked_events = {
        "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
        "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn", "resource.setrlimit",
        "resource.prlimit", "sys.addaudithook",
    }
    path_events = {
        "os.remove", "os.rmdir", "os.mkdir", "os.rename", "os.chmod", "os.chown", "os.chflags",
        "os.link", "os.symlink", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
        "shutil.rmtree", "shutil.copyfile", "shutil.copytree", "shutil.move",
    }
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    realpath, join, getcwd, fspath = os.path.realpath, os.path.join, os.getcwd, os.fspath

    def inside(path):
        if isinstance(path, int):
            return True
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        full = realpath(join(getcwd(), path))
        return full == workdir or full.startswith(workdir + os.sep) or full == "/dev/null"

    def guard(event, args):
        if event.startswith(("socket.", "ctypes.")) or event in blocked_events:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0].partition(".")[0] in blocked_imports:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags
            )
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the work dir")
        elif event in path_events:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the work dir")

    sys.addaudithook(guard)

def _main():
    import runpy
    script, cpu_s, memory_bytes, file_bytes, max_open_files = sys.argv[1:6]
    _die_with_parent()
    _set_limits(int(cpu_s), int(memory_bytes), int(file_bytes), int(max_open_files))
    _install_guard(os.getcwd())
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")

_main()
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    """Address-space limit (virtual memory; Python itself needs about 30 MB)."""
    max_output_bytes: int = 64 * 1024
    """Of stdout and of stderr kept in the result; the rest is dropped (``output_truncated``)."""
    max_file_mb: int = 16
    """Largest file the code may write (stdout/stderr included)."""
    max_open_files: int = 64
    network_isolation: str = "auto"
    """auto: a network namespace where the kernel allows one, else the Python guard only;
    namespace: require the namespace (RuntimeError if unavailable); python: the guard only."""

    def __post_init__(self) -> None:
        if self.network_isolation not in NETWORK_ISOLATION_MODES:
            raise ValueError(
                f"network_isolation={self.network_isolation!r}; choose one of "
                f"{', '.join(NETWORK_ISOLATION_MODES)}"
            )
        for name in ("wall_time_s", "cpu_time_s", "memory_mb", "max_output_bytes", "max_file_mb"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: Optional[int]
    """Exit status; negative = killed by that signal; None = killed by the wall-clock limit."""
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    wall_s: float
    network_isolation: str
    """``namespace`` or ``python``: what actually isolated the network in this run."""
    workdir: str
    """The temporary directory the code ran in (removed when the run ended)."""

    @property
    def passed(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    @property
    def memory_exceeded(self) -> bool:
        return "MemoryError" in self.stderr

    @property
    def cpu_time_exceeded(self) -> bool:
        return self.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and not self.timed_out


@lru_cache(maxsize=1)
def namespace_command() -> Optional[tuple[str, ...]]:
    """The ``unshare`` prefix that gives a child an empty network namespace here, or None.

    Probed once per process: as root ``unshare --net``; otherwise an unprivileged user namespace
    (``--map-root-user``), which many distributions and container runtimes disable.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    candidates = [(unshare, "--net")] if os.geteuid() == 0 else []
    candidates.append((unshare, "--map-root-user", "--net"))
    for prefix in candidates:
        try:
            probe = subprocess.run(
                [*prefix, sys.executable, "-I", "-c", "import socket; socket.create_connection"],
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    logger.warning(
        "sandbox: no network namespace can be created here (needs unshare and root or user "
        "namespaces); network access from sandboxed code is blocked only by the Python audit hook"
    )
    return None


def _network_prefix(mode: str) -> tuple[tuple[str, ...], str]:
    if mode == "python":
        return (), "python"
    prefix = namespace_command()
    if prefix is None:
        if mode == "namespace":
            raise RuntimeError(
                "network_isolation='namespace' but no network namespace can be created here "
                "(unshare is missing, or neither root nor user namespaces are available); use "
                "network_isolation='auto' or 'python', or run as root / in a container"
            )
        return (), "python"
    return prefix, "namespace"


def _sandbox_environment(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        # One thread per library: threaded BLAS reserves address space per thread, which the
        # memory limit counts.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_capped(path: Path, limit: int) -> tuple[str, bool]:
    with path.open("rb") as handle:
        data = handle.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


def _kill_group(process: subprocess.Popen) -> None:
    # The child leads its own session; anything it started (if the guard was bypassed) is in it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def run_python(
    source: str, *, stdin: str = "", limits: Optional[SandboxLimits] = None
) -> SandboxResult:
    """Run ``source`` as ``__main__`` in the sandbox described in the module docstring.

    ``stdin`` is the program's standard input. Returns how the run ended; never raises for
    anything the code does (errors are in ``returncode``/``stderr``).
    """
    limits = limits or SandboxLimits()
    prefix, isolation = _network_prefix(limits.network_isolation)
    root = Path(tempfile.mkdtemp(prefix="megatron_gspo_sandbox_"))
    workdir = root / "work"
    workdir.mkdir()
    script = workdir / "main.py"
    script.write_text(source, encoding="utf-8")
    (root / "stdin").write_text(stdin, encoding="utf-8")
    command = [
        *prefix,
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
        str(script),
        str(int(limits.cpu_time_s)),
        str(int(limits.memory_mb) * 1024 * 1024),
        str(int(limits.max_file_mb) * 1024 * 1024),
        str(int(limits.max_open_files)),
    ]
    start = time.monotonic()
    timed_out = False
    try:
        with (
            (root / "stdin").open("rb") as stdin_file,
            (root / "stdout").open("wb") as stdout_file,
            (root / "stderr").open("wb") as stderr_file,
        ):
            process = subprocess.Popen(
                command,
                cwd=workdir,
                env=_sandbox_environment(str(workdir)),
                stdin=stdin_file,
                stdout=stdout_file,
                stderr=stderr_file,
                start_new_session=True,
                close_fds=True,
            )
            try:
                returncode: Optional[int] = process.wait(timeout=limits.wall_time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = None
                _kill_group(process)
                process.wait()
            finally:
                _kill_group(process)
        wall_s = time.monotonic() - start
        stdout, stdout_truncated = _read_capped(root / "stdout", limits.max_output_bytes)
        stderr, stderr_truncated = _read_capped(root / "stderr", limits.max_output_bytes)
    finally:
        shutil.rmtree(root, onerror=_make_removable)
        if root.exists():
            logger.warning("sandbox: could not remove %s", root)
    return SandboxResult(
        returncode=returncode,
        stdout=stdout,
        stderr=stderr,
        timed_out=timed_out,
        output_truncated=stdout_truncated or stderr_truncated,
        wall_s=wall_s,
        network_isolation=isolation,
        workdir=str(workdir),
    )


def _make_removable(function, path, _exc_info) -> None:
    # The code may leave read-only files or directories behind; make them writable and retry.
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass
