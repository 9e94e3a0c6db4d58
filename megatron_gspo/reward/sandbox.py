"""Run untrusted Python (a model's code) in a child process that the kernel confines.

The threat model, what is enforced and by what, and how to run it on a cluster are in
``docs/code-sandbox.md``. In short, with ``isolation="bubblewrap"`` (the default):

=============================  ===============================================================
who                            uid 65534 with no capabilities and ``no_new_privs``; under a
                               root trainer also host uid 65534 (see below)
namespaces                     new user, PID, mount, network, IPC, UTS and cgroup namespaces
                               (``bwrap --unshare-all``); further user namespaces disabled
processes                      every process of the call lives in its PID namespace and dies
                               with it, and the namespace with the process that started it,
                               whatever kills that one (``--die-with-parent``); the init is
                               reaped when it comes back to the caller (a reward worker, a
                               trainer that is PID 1); ``RLIMIT_NPROC`` caps their number,
                               counted per sandbox (per user namespace)
file system                    a read-only view of the system directories and of this
                               Python's installation, a fresh ``/proc`` and read-only ``/dev``;
                               the writable places are ``/sandbox`` (the working directory,
                               holding the program's files) and ``/dev/shm``, tmpfs mounts of
                               ``max_scratch_mb`` each that vanish with the sandbox; the rest
                               of the machine (homes, /tmp, /run, data, checkpoints, other
                               sandboxes) is not there
network                        an empty network namespace: only its own loopback
system calls                   a seccomp filter (:mod:`megatron_gspo.reward.seccomp`);
                               without libseccomp the sandbox refuses to run
CPU, memory, files, output     ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` (also caps
                               stdout/stderr), ``RLIMIT_NOFILE``, no core dumps; memory that
                               ``RLIMIT_AS`` does not count (System V shared memory, memfd
                               files) is refused by the seccomp filter
wall clock                     the sandbox's first process is killed after ``wall_time_s``,
                               which takes every process of the sandbox with it
environment                    a fixed minimal one (no variable of the trainer's), Python
                               isolated (``-I -S``: no PYTHON* variables, no ``.pth`` files)
=============================  ===============================================================

When the trainer runs as root, bubblewrap's user namespace would map the sandbox's uid to host
uid 0, which still owns root's files and is exempt from ``RLIMIT_NPROC``. So as root a first,
privileged bubblewrap builds the read-only view (it can read root-only paths such as a Python
under ``/root``) in a PID namespace of its own, ``setpriv`` drops to host uid 65534 with no
capabilities, and an unprivileged bubblewrap inside makes the namespaces above; the first
one's PID namespace is what ends everything when the caller dies (``bubblewrap.py`` says why
the parent-death signal cannot). As any other user, the unprivileged bubblewrap alone does the
same.

Where the kernel refuses (no bubblewrap, user namespaces disabled, a container's seccomp
profile), :func:`run_python` raises :class:`SandboxUnavailableError` with the reason and the
fix; it never runs the code with less isolation. ``isolation="none"`` is the explicit opt-out
for trusted code: only the resource limits, the scratch directory and the clean environment
remain.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

from megatron_gspo.reward.bubblewrap import (
    SANDBOX_UID,
    SCRATCH,
    SandboxUnavailableError,
    bwrap_features,
    bwrap_path,
    end_sandbox,
    open_sandbox_init,
    python_directories,
    sandbox_command,
)
from megatron_gspo.reward.seccomp import sandbox_filter

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("bubblewrap", "none")

# Runs in the sandbox before the user's program; argv: [-c, cpu_s, memory_bytes, file_bytes,
# max_open_files, max_processes, site_dirs, script, *script_args]. Standard library only.
_BOOTSTRAP = r"""
import os, resource, sys

def _main():
    cpu_s, memory_bytes, file_bytes, open_files, processes, site_dirs, script = sys.argv[1:8]
    for limit, value in (
        (resource.RLIMIT_AS, int(memory_bytes)),
        (resource.RLIMIT_FSIZE, int(file_bytes)),
        (resource.RLIMIT_NOFILE, int(open_files)),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(limit, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 1))
    if int(processes) > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (int(processes), int(processes)))
    # Third-party packages without running their .pth files (-S): faster and nothing executes.
    sys.path.extend(path for path in site_dirs.split(os.pathsep) if path)
    sys.argv = [script, *sys.argv[8:]]
    import runpy
    runpy.run_path(script, run_name="__main__")

_main()
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run."""

    wall_time_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    """Address-space limit per process (virtual memory; Python itself needs about 30 MB). The
    memory one call can take is bounded by ``memory_mb * max_processes``."""
    max_output_bytes: int = 64 * 1024
    """Of stdout and of stderr kept in the result; the rest is dropped (``output_truncated``)."""
    max_file_mb: int = 16
    """Largest file the code may write (stdout/stderr included)."""
    max_open_files: int = 64
    max_scratch_mb: int = 64
    """Size of the writable scratch directory (and of /dev/shm): tmpfs mounts in memory, so a
    program cannot fill the host's disk. Not enforced with ``isolation="none"``."""
    max_processes: int = 8
    """Processes and threads of the sandbox user, counted per sandbox (the sandbox's first
    process included): a fork bomb stops here. Not enforced with ``isolation="none"``."""
    isolation: str = "bubblewrap"
    """bubblewrap: the kernel isolation of the module docstring (fails closed where the kernel
    refuses); none: no isolation, for trusted code only."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise ValueError(
                f"isolation={self.isolation!r}; choose one of {', '.join(ISOLATION_MODES)}"
            )
        for name in (
            "wall_time_s",
            "cpu_time_s",
            "memory_mb",
            "max_output_bytes",
            "max_file_mb",
            "max_open_files",
            "max_scratch_mb",
            "max_processes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did."""

    returncode: Optional[int]
    """Exit status; negative = killed by that signal (under bubblewrap, an exit status above 128
    counts as one, as in a shell); None = killed by the wall-clock limit."""
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool
    wall_s: float
    isolation: str
    """``bubblewrap`` or ``none``: what confined this run."""
    stdout_tail: str = ""
    """The last 4 KiB of stdout, kept even when ``stdout`` was truncated."""

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
def site_directories() -> tuple[str, ...]:
    """The interpreter's site-packages directories (third-party packages the code may import)."""
    return tuple(path for path in site.getsitepackages() if os.path.isdir(path))


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def _sandbox_environment(home: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        # One thread per library: threaded BLAS reserves address space per thread, which the
        # memory limit counts, and threads count as processes.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _read_capped(path: Path, limit: int) -> tuple[str, bool, str]:
    """(the first ``limit`` bytes, whether there was more, the last 4 KiB)."""
    with path.open("rb") as handle:
        data = handle.read(limit + 1)
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - 4096))
        tail = handle.read()
    text = data[:limit].decode("utf-8", errors="replace")
    return text, len(data) > limit, tail.decode("utf-8", errors="replace")


def run_python(
    source: str,
    *,
    stdin: str = "",
    limits: Optional[SandboxLimits] = None,
    files: Optional[Mapping[str, str]] = None,
    argv: Sequence[str] = (),
) -> SandboxResult:
    """Run ``source`` as ``__main__`` (``/sandbox/main.py``) confined as the module docstring
    says, with ``stdin`` as its standard input, ``files`` (name -> text) written into the
    scratch directory beside it and ``argv`` as its ``sys.argv[1:]``.

    Returns how the run ended; never raises for anything the code does (errors are in
    ``returncode``/``stderr``). Raises :class:`SandboxUnavailableError` when the kernel cannot
    provide the isolation asked for.
    """
    limits = limits or SandboxLimits()
    if limits.isolation == "bubblewrap":
        check_isolation()
    return _run(source, stdin=stdin, limits=limits, files=files, argv=argv)


def _run(
    source: str,
    *,
    stdin: str = "",
    limits: SandboxLimits,
    files: Optional[Mapping[str, str]] = None,
    argv: Sequence[str] = (),
) -> SandboxResult:
    """:func:`run_python` without the availability check (which itself runs a probe here)."""
    isolated = limits.isolation == "bubblewrap"
    files = {**(files or {}), "main.py": source}
    for name in files:
        if os.sep in name or name.startswith(".") or not name:
            raise ValueError(f"sandbox file name {name!r} must be a plain name")
    root = Path(tempfile.mkdtemp(prefix="megatron_gspo_sandbox_"))
    (root / "stdin").write_text(stdin, encoding="utf-8")
    home = SCRATCH
    workdir: Optional[Path] = None
    if not isolated:  # no tmpfs of its own: a directory on the host
        workdir = root / "work"
        workdir.mkdir()
        for name, text in files.items():
            (workdir / name).write_text(text, encoding="utf-8")
        home = str(workdir)
    program = [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _BOOTSTRAP,
        str(int(limits.cpu_time_s)),
        str(int(limits.memory_mb) * 1024 * 1024),
        str(int(limits.max_file_mb) * 1024 * 1024),
        str(int(limits.max_open_files)),
        # Without its own user namespace the count would be the trainer user's, machine-wide.
        str(int(limits.max_processes) if isolated else 0),
        os.pathsep.join(site_directories()),
        f"{home}/main.py",
        *argv,
    ]
    pass_fds: list[int] = []
    info_read: Optional[int] = None
    command = program
    try:
        if isolated:
            file_fds = {name: _memory_file(name, text) for name, text in files.items()}
            pass_fds += file_fds.values()
            seccomp = sandbox_filter()
            seccomp_fd = _memory_file("seccomp", seccomp) if seccomp is not None else None
            if seccomp_fd is not None:
                pass_fds.append(seccomp_fd)
            info_read, info_write = os.pipe()
            pass_fds.append(info_write)
            command = sandbox_command(
                file_fds, limits.max_scratch_mb * 1024 * 1024, seccomp_fd, info_write, program
            )
        returncode, timed_out, wall_s = _run_command(
            command, root, workdir or root, home, pass_fds, info_read, limits.wall_time_s
        )
        if isolated and returncode is not None and returncode > 128:
            # bwrap exits with 128 + N when the code was killed by signal N (as a shell does).
            returncode = 128 - returncode
        stdout, stdout_truncated, stdout_tail = _read_capped(
            root / "stdout", limits.max_output_bytes
        )
        stderr, stderr_truncated, _ = _read_capped(root / "stderr", limits.max_output_bytes)
    finally:
        for descriptor in pass_fds:
            with contextlib.suppress(OSError):
                os.close(descriptor)
        if info_read is not None:
            os.close(info_read)
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
        isolation=limits.isolation,
        stdout_tail=stdout_tail,
    )


def _memory_file(name: str, content: Union[str, bytes]) -> int:
    """A descriptor of an in-memory file holding ``content`` (bwrap copies it into the
    sandbox), positioned at its start."""
    descriptor = os.memfd_create(f"megatron_gspo_{name}")
    data = content.encode("utf-8") if isinstance(content, str) else content
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]
    os.lseek(descriptor, 0, os.SEEK_SET)
    return descriptor


def _run_command(
    command: Sequence[str],
    root: Path,
    cwd: Path,
    home: str,
    pass_fds: Sequence[int],
    info_read: Optional[int],
    wall_time_s: float,
) -> tuple[Optional[int], bool, float]:
    """Run with ``root/stdin`` as stdin and ``root/stdout``, ``root/stderr`` as outputs; kill
    it after ``wall_time_s``. Returns (exit status or None, timed out, wall seconds)."""
    start = time.monotonic()
    timed_out = False
    with (
        (root / "stdin").open("rb") as stdin_file,
        (root / "stdout").open("wb") as stdout_file,
        (root / "stderr").open("wb") as stderr_file,
    ):
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=_sandbox_environment(home),
            stdin=stdin_file,
            stdout=stdout_file,
            stderr=stderr_file,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
        deadline = start + wall_time_s
        init = open_sandbox_init(process, info_read, deadline) if info_read is not None else None
        try:
            returncode: Optional[int] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            returncode = None
        finally:
            # Killing the init takes the whole PID namespace with it; bwrap's own group too.
            end_sandbox(process, init, kill=timed_out)
    return returncode, timed_out, time.monotonic() - start


def _make_removable(function, path, _exc_info) -> None:
    # The code may leave read-only files or directories behind; make them writable and retry.
    try:
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Is the isolation available here?
# --------------------------------------------------------------------------------------------


@lru_cache(maxsize=4)
def _probe(bwrap: Optional[str]) -> Optional[str]:
    """None when a probe program ran confined as expected with ``bwrap``, else why not."""
    try:
        bwrap_features(bwrap)
    except SandboxUnavailableError as error:
        return str(error)
    if sandbox_filter() is None:
        return (
            "the code sandbox needs libseccomp (libseccomp.so.2), which is not installed: its "
            "seccomp filter is what keeps System V shared memory and memfd files, which "
            "RLIMIT_AS does not count, from holding memory past the sandbox's limit. Install "
            "it (Debian/Ubuntu: apt-get install libseccomp2; Fedora/RHEL: dnf install "
            "libseccomp), or, for code you trust, set the code reward's isolation option to "
            "'none' (reward.options.code.isolation=none)"
        )
    limits = SandboxLimits(wall_time_s=60.0, isolation="bubblewrap")
    result = _run("import os; print(os.getuid(), os.getpid())", limits=limits)
    if result.passed and result.stdout.split() == [str(SANDBOX_UID), "2"]:
        return None
    detail = (result.stderr.strip() or result.stdout.strip() or "no output")[-2000:]
    if "Can't find source path" in detail or "execvp" in detail:
        # bwrap started (the kernel allowed it) but a path of the view is missing inside.
        return (
            f"bubblewrap started but could not show this Python inside the sandbox (exit "
            f"status {result.returncode}): {detail}\n"
            f"The sandbox binds the directories of this interpreter ({sys.executable}: "
            f"{', '.join(python_directories())}) read-only; one of them is missing, or not "
            "readable by the sandbox's user (under a root trainer host uid 65534: each of "
            "these directories must be readable by others, not of mode 0700 as "
            "tempfile.mkdtemp makes them). Fix the permissions or install the Python "
            "elsewhere; see docs/code-sandbox.md."
        )
    return (
        f"bubblewrap could not start a sandbox here (exit status {result.returncode}): {detail}\n"
        "The code sandbox needs unprivileged user namespaces (sysctls "
        "kernel.unprivileged_userns_clone=1 where it exists, user.max_user_namespaces > 0; on "
        "Ubuntu 23.10+ kernel.apparmor_restrict_unprivileged_userns=0 or an AppArmor profile "
        "that allows bwrap) and, inside a container, a seccomp and AppArmor profile that "
        "allow them (e.g. docker run --security-opt seccomp=unconfined --security-opt "
        "apparmor=unconfined), plus a /proc that is not partly masked (--security-opt "
        "systempaths=unconfined). See docs/code-sandbox.md. For code you trust, set the code "
        "reward's isolation option to 'none' (reward.options.code.isolation=none)."
    )


def check_isolation() -> None:
    """Raise :class:`SandboxUnavailableError` (why, and how to fix it) unless bubblewrap can
    confine code on this machine. Probed once per process (and bwrap path:
    ``MEGATRON_GSPO_BWRAP`` overrides the one on PATH)."""
    reason = _probe(bwrap_path())
    if reason is not None:
        raise SandboxUnavailableError(reason)
