"""The seccomp filter of the code sandbox, compiled by libseccomp (when installed).

bubblewrap loads a compiled classic-BPF program (``bwrap --seccomp FD``) right before it starts
the sandboxed command. :func:`sandbox_filter` asks the system's libseccomp (``libseccomp.so.2``,
present on Debian and Ubuntu base images) to compile one, through its C API by ``ctypes``:

- every system call is allowed except the ones listed in :data:`DENIED_SYSCALLS`, which fail with
  ``EPERM``: debugging and memory access of other processes, kernel keyrings, BPF and perf,
  io_uring, namespaces and mounts, kernel modules and kexec, and a few obsolete or
  machine-wide calls. None of them is needed by a program that reads input and computes;
  several have a history of kernel privilege escalations;
- memory that ``RLIMIT_AS`` does not count fails with ``ENOSYS``, as on a kernel built without
  it (:data:`UNCOUNTED_MEMORY_SYSCALLS`): System V shared memory, message queues and semaphores
  (a detached shared memory segment stays allocated: one program held 3 GB under a 1 GB limit)
  and ``memfd_create``/``memfd_secret`` (an anonymous file is memory, capped only by
  ``RLIMIT_FSIZE`` per file: as many as the descriptor limit allows held 976 MB). ``ENOSYS``
  rather than ``EPERM`` because programs and libraries that use them already fall back on it
  (to ``/dev/shm`` files, which are on the sandbox's sized tmpfs); ``multiprocessing`` uses
  neither;
- ``clone`` with any namespace flag fails with ``EPERM``; ``clone3`` fails with ``ENOSYS``
  (its flags live in memory a filter cannot read, so the C library falls back to ``clone``);
- system calls of another architecture (32-bit ``int 0x80`` on x86-64) kill the process:
  libseccomp's default for a foreign architecture.

The namespaces, the unprivileged user and the read-only file system are the sandbox's main
walls; this filter narrows the kernel surface behind them, and holds the memory limit. Without
libseccomp the sandbox refuses to run (:func:`megatron_gspo.reward.sandbox.check_isolation`):
its memory limit would not hold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from functools import lru_cache
from typing import Optional

DENIED_SYSCALLS = (
    # other processes' memory and descriptors
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    # kernel keyrings, BPF, perf, io_uring, userfaultfd
    "add_key",
    "keyctl",
    "request_key",
    "bpf",
    "perf_event_open",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    # namespaces and mounts
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "open_by_handle_at",
    "name_to_handle_at",
    # kernel modules, kexec, machine-wide state
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "syslog",
    "acct",
    "quotactl",
    "iopl",
    "ioperm",
    "uselib",
    "vhangup",
    "lookup_dcookie",
)

UNCOUNTED_MEMORY_SYSCALLS = (
    # System V IPC: segments and queues belong to the IPC namespace, not to a process, so
    # RLIMIT_AS (per process) never sees them once detached.
    "shmget",
    "shmat",
    "shmdt",
    "shmctl",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "semget",
    "semop",
    "semtimedop",
    "semctl",
    "ipc",  # the multiplexer of all of the above on some architectures
    # anonymous files: memory held by a descriptor, counted by RLIMIT_AS only while mapped
    "memfd_create",
    "memfd_secret",
)

# linux/sched.h
NAMESPACE_CLONE_FLAGS = {
    "CLONE_NEWTIME": 0x00000080,
    "CLONE_NEWNS": 0x00020000,
    "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000,
    "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}

# seccomp.h (libseccomp 2.x)
_ACT_ALLOW = 0x7FFF0000
_ACT_ERRNO = 0x00050000
_CMP_MASKED_EQ = 7


class _ArgumentComparison(ctypes.Structure):
    """``struct scmp_arg_cmp``."""

    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _load_libseccomp() -> Optional[ctypes.CDLL]:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        library = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_init.argtypes = [ctypes.c_uint32]
    library.seccomp_release.argtypes = [ctypes.c_void_p]
    library.seccomp_syscall_resolve_name.restype = ctypes.c_int
    library.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    library.seccomp_rule_add_array.restype = ctypes.c_int
    library.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgumentComparison),
    ]
    library.seccomp_export_bpf.restype = ctypes.c_int
    library.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return library


@lru_cache(maxsize=1)
def sandbox_filter() -> Optional[bytes]:
    """The compiled filter (classic BPF for this machine's architecture), or None when
    libseccomp is not installed. Compiled once per process."""
    library = _load_libseccomp()
    if library is None:
        return None
    context = library.seccomp_init(_ACT_ALLOW)
    if not context:
        raise OSError(ctypes.get_errno(), "seccomp_init failed")
    try:

        def deny(name: str, code: int, conditions: list[_ArgumentComparison]) -> None:
            number = library.seccomp_syscall_resolve_name(name.encode())
            if number < 0:  # not a system call on this architecture (e.g. iopl on arm64)
                return
            array = (_ArgumentComparison * len(conditions))(*conditions) if conditions else None
            status = library.seccomp_rule_add_array(
                context, _ACT_ERRNO | code, number, len(conditions), array
            )
            if status < 0:
                raise OSError(-status, f"seccomp_rule_add_array({name}) failed")

        for name in DENIED_SYSCALLS:
            deny(name, errno.EPERM, [])
        for name in UNCOUNTED_MEMORY_SYSCALLS:
            deny(name, errno.ENOSYS, [])
        deny("clone3", errno.ENOSYS, [])
        for flag in NAMESPACE_CLONE_FLAGS.values():
            # Argument 0 of clone is the flags on x86-64 and arm64: (flags & flag) == flag.
            deny("clone", errno.EPERM, [_ArgumentComparison(0, _CMP_MASKED_EQ, flag, flag)])
        descriptor = os.memfd_create("megatron_gspo_seccomp")
        try:
            status = library.seccomp_export_bpf(context, descriptor)
            if status < 0:
                raise OSError(-status, "seccomp_export_bpf failed")
            os.lseek(descriptor, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(descriptor, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(descriptor)
    finally:
        library.seccomp_release(context)
