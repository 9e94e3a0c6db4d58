"""Hostile programs through the public ``code`` reward (in this process, in reward worker
processes, and in a training run), each with the outcome asserted.

Each program attempts an attack and prints what it got; the sample's stdin/stdout case expects
the line the program prints when every attempt failed. So a score of 1.0 proves that the
program ran to its end and that the attack failed; the side effects are checked from outside
too (the caller and the worker alive, no connection at the listener, no process left, no file
written). Memory the address-space limit does not count, a reward worker SIGKILLed in the middle
of a call and a trainer that is PID 1 (no zombie left) are tested here too. Each test takes the
``sandbox`` fixture: it runs only where bubblewrap isolates code (``sandbox_support.py``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.config import RewardConfig
from megatron_gspo.reward import RewardInput, RewardRunner, SandboxLimits, run_python
from megatron_gspo.reward.code_execution import code_reward

from .sandbox_support import LoopbackListener


def expecting(program: str, verdict: str) -> RewardInput:
    """A sample whose one stdin/stdout case passes when ``program`` prints ``verdict``."""
    return RewardInput(
        prompt="attack",
        response=f"```python\n{program}\n```",
        metadata={"tests": [{"input": "", "output": verdict}]},
    )


def score(sample: RewardInput, **options) -> float:
    return code_reward(sample, timeout_s=10.0, **options)


# --------------------------------------------------------------------------------------------
# The attacks (each prints "contained" when every attempt failed)


def kill_program(pids: list[int]) -> str:
    """SIGKILL the given processes by pidfd and by pid, then the sandbox's parent chain."""
    return f"""
import os, signal
hits = []
for pid in {pids!r}:
    try:
        descriptor = os.pidfd_open(pid)
        signal.pidfd_send_signal(descriptor, signal.SIGKILL)
        hits.append(("pidfd", pid))
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
        hits.append(("kill", pid))
    except OSError:
        pass
print("contained" if not hits else hits)
"""


KILL_PARENTS = """
import os, signal
parent = os.getppid()
status = open(f"/proc/{parent}/status").read()
grandparent = int(status.split("PPid:")[1].split()[0])
print("parents", parent, grandparent, flush=True)
for pid in (grandparent, parent):
    if pid > 0:
        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
"""


def environment_program(pids: list[int], name: str) -> str:
    return f"""
import os
found = [key for key in os.environ if key == {name!r}]
candidates = ["/proc/self/environ", "/proc/1/environ"]
candidates += [f"/proc/{{pid}}/environ" for pid in {pids!r}]
candidates += [f"/proc/{{entry}}/environ" for entry in os.listdir("/proc") if entry.isdigit()]
for path in candidates:
    try:
        if {name!r}.encode() in open(path, "rb").read():
            found.append(path)
    except OSError:
        pass
print("contained" if not found else found)
"""


def network_program(port: int, pids: list[int]) -> str:
    """Neuter any audit hook, try setns/unshare into other network namespaces, connect."""
    return f"""
import ctypes, gc, os, socket, sys, types
for hook in [o for o in gc.get_objects() if isinstance(o, types.FunctionType)]:
    if "guard" in hook.__name__ or "audit" in hook.__name__:
        hook.__code__ = (lambda *args: None).__code__
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
escaped = []
for pid in [1, os.getppid(), *{pids!r}]:
    try:
        descriptor = os.open(f"/proc/{{pid}}/ns/net", os.O_RDONLY)
    except OSError:
        continue
    if libc.setns(descriptor, CLONE_NEWNET) == 0:
        escaped.append(("setns", pid))
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
    escaped.append("unshare")
for host in ["127.0.0.1", "localhost", socket.gethostname()]:
    try:
        socket.create_connection((host, {port}), timeout=2).close()
        escaped.append(("connected", host))
    except OSError:
        pass
print("contained" if not escaped else escaped)
"""


def outliving_program(marker: str) -> str:
    """A daemon (double fork, new session) and a plain child, both meant to run for minutes."""
    return f"""
import os, sys, time
def sleeper():
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", {marker!r}])
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sleeper()
    os._exit(0)
if os.fork() == 0:
    sleeper()
time.sleep(0.5)
print("contained")
"""


def write_program(outside: Path) -> str:
    targets = [str(outside), "/etc/escaped", "/usr/escaped", sys.prefix + "/escaped", "/escaped"]
    return f"""
import os
written = []
for path in {targets!r}:
    try:
        with open(path, "w") as handle:
            handle.write("escaped")
        written.append(path)
    except OSError:
        pass
for directory in ["/etc", "/usr", {sys.prefix!r}]:
    try:
        descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.close(os.open("escaped", os.O_WRONLY | os.O_CREAT, dir_fd=descriptor))
        written.append(("dir_fd", directory))
    except OSError:
        pass
try:
    os.chmod("/etc/passwd", 0o777)
    written.append("chmod")
except OSError:
    pass
open("/sandbox/inside.txt", "w").write("fine")
print("contained" if not written else written)
"""


def fork_bomb(marker: str, limit: int) -> str:
    return f"""
import os, sys, time
children = 0
while children < 1000:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", {marker!r}])
    children += 1
print("contained" if children < {limit} else children)
"""


def shared_memory_program(limit_mb: int) -> str:
    """System V shared memory: segments of a quarter of the limit, each attached, touched page
    by page and detached (it stays allocated), until twice the limit is held."""
    return f"""
import ctypes, mmap
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
segment, held = {limit_mb} * 1024 * 1024 // 4, 0
while held < 2 * {limit_mb} * 1024 * 1024:
    identifier = libc.shmget(0, segment, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    if identifier < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    address = libc.shmat(identifier, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    for offset in range(0, segment, mmap.PAGESIZE):
        ctypes.c_char.from_address(address + offset).value = b"x"
    libc.shmdt(ctypes.c_void_p(address))
    held += segment
print("held", held >> 20, "MB")
"""


def memfd_program(limit_mb: int) -> str:
    """Anonymous memory files of 16 MB (the file size limit), each filled page by page through
    a mapping that is then dropped (the file keeps the memory), until twice the limit is held."""
    return f"""
import mmap, os
size, held, files = 16 * 1024 * 1024, 0, []
while held < 2 * {limit_mb} * 1024 * 1024:
    descriptor = os.memfd_create("hold")
    os.ftruncate(descriptor, size)
    with mmap.mmap(descriptor, size) as view:
        for offset in range(0, size, mmap.PAGESIZE):
            view[offset] = 1
    files.append(descriptor)
    held += size
print("held", held >> 20, "MB")
"""


def sleeping_family(marker: str) -> str:
    """Two children that sleep for minutes (the marker in their command line) and a parent that
    sleeps too: a call that only ends when something kills it."""
    return f"""
import os, sys, time
for _ in range(2):
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(300)", {marker!r}])
print("started", flush=True)
time.sleep(300)
"""


PID_1_TRAINER = """
import os
from megatron_gspo.config import RewardConfig
from megatron_gspo.reward import RewardInput, RewardRunner, run_python

def zombies():
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                count += entry.isdigit() and handle.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            pass
    return count

calls = 8
outputs = {run_python("print(1)").stdout for _ in range(calls)}
in_process = zombies()
sample = RewardInput(prompt="", response="print(1)", metadata={"tests": [{"input": "", "output": "1"}]})
with RewardRunner(RewardConfig(functions=["code"], num_workers=2)) as runner:
    rewards = runner.score([sample] * calls).rewards
print(os.getpid(), outputs == {"1\\n"}, in_process, zombies(), sum(rewards))
"""


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in (process.info["cmdline"] or []):
            found.append(process)
    return found


# --------------------------------------------------------------------------------------------
# The tests


def test_caller_survives_kill_attempts_on_its_pids(sandbox):
    caller = os.getpid()
    assert score(expecting(kill_program([caller, os.getppid()]), "contained")) == 1.0
    assert psutil.Process(caller).is_running()


def test_environment_of_the_caller_is_not_readable(sandbox, monkeypatch):
    name = f"MEGATRON_GSPO_TEST_SECRET_{secrets.token_hex(4)}"
    monkeypatch.setenv(name, "hunter2")
    program = environment_program([os.getpid(), os.getppid()], name)
    assert score(expecting(program, "contained")) == 1.0


def test_loopback_listener_gets_no_connection(sandbox):
    listener = LoopbackListener()
    try:
        program = network_program(listener.port, [os.getpid()])
        assert score(expecting(program, "contained")) == 1.0
        assert listener.connections == 0
        # The listener does accept connections from outside the sandbox.
        import socket

        socket.create_connection(("127.0.0.1", listener.port), timeout=2).close()
        deadline = time.monotonic() + 5
        while listener.connections == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.connections == 1
    finally:
        listener.close()


def test_no_process_outlives_the_call(sandbox):
    marker = f"outlive-{secrets.token_hex(6)}"
    assert score(expecting(outliving_program(marker), "contained")) == 1.0
    assert processes_with(marker) == []


def test_writes_outside_the_scratch_directory_fail(sandbox, tmp_path):
    outside = tmp_path / "escaped.txt"
    assert score(expecting(write_program(outside), "contained")) == 1.0
    assert not outside.exists()
    assert not Path("/etc/escaped").exists() and not Path(sys.prefix, "escaped").exists()


def test_fork_bomb_is_capped(sandbox):
    marker = f"bomb-{secrets.token_hex(6)}"
    start = time.monotonic()
    sample = expecting(fork_bomb(marker, limit=8), "contained")
    assert score(sample, max_processes=8) == 1.0
    assert time.monotonic() - start < 30
    assert processes_with(marker) == []


def test_reward_workers_and_caller_survive_and_stay_unreplaced(sandbox, monkeypatch):
    """Through the runner's worker processes: kill attempts on the worker (the sandbox's real
    parent) and the caller (its grandparent) by their pids, the sandbox's own parent chain
    killed, the worker's environment read. Every call ends ``ok``; no worker is replaced."""
    name = f"MEGATRON_GSPO_TEST_SECRET_{secrets.token_hex(4)}"
    monkeypatch.setenv(name, "hunter2")  # inherited by the workers
    config = RewardConfig(functions=["code"], num_workers=2, timeout_s=60.0)
    with RewardRunner(config) as runner:
        workers = [worker.process.pid for worker in runner.pool._workers]
        pids = [*workers, os.getpid()]
        samples = [
            expecting(kill_program(pids), "contained"),
            expecting(environment_program(pids, name), "contained"),
            # Kills its own sandbox (its parent is the sandbox's init): scores 0, harms nothing.
            expecting(KILL_PARENTS, "never printed"),
            expecting("import sys\nsys.exit(0)", "anything"),
        ]
        result = runner.score(samples * 2)
        assert not result.failures, result.failures
        assert result.rewards == [1.0, 1.0, 0.0, 0.0] * 2
        assert [worker.process.pid for worker in runner.pool._workers] == workers
        assert all(psutil.Process(pid).is_running() for pid in workers)
        assert runner.pool.num_replaced == 0


@pytest.mark.parametrize("program", [shared_memory_program, memfd_program])
def test_memory_that_the_address_space_limit_misses_is_refused(sandbox, program):
    """Shared memory segments and memory files are memory that RLIMIT_AS does not count once
    unmapped: a program held 3 GB under a 1 GB limit with them. Twice the limit, touched page
    by page: the program fails (the seccomp filter refuses the calls) and never holds it."""
    limits = SandboxLimits(memory_mb=128, wall_time_s=30.0, cpu_time_s=30)
    result = run_python(program(128), limits=limits)
    assert not result.passed and "held" not in result.stdout, result.stdout
    assert "Function not implemented" in result.stderr or "[Errno 38]" in result.stderr
    # What a program may use instead still works: /dev/shm (the sandbox's own sized tmpfs),
    # which multiprocessing's shared memory and locks use, and a process pool.
    working = (
        "import multiprocessing as mp\nfrom multiprocessing import shared_memory\n"
        "block = shared_memory.SharedMemory(create=True, size=1 << 20)\nblock.buf[0] = 7\n"
        "with mp.Pool(2) as pool:\n    print(block.buf[0] + sum(pool.map(abs, range(-3, 0))))\n"
        "block.close()\nblock.unlink()\n"
    )
    result = run_python(working, limits=limits)
    assert result.passed and result.stdout == "13\n", result.stderr


def test_sandboxes_die_with_a_killed_reward_worker(sandbox, tmp_path, monkeypatch):
    """A reward worker SIGKILLed in the middle of a ``code`` call, by the pool's own time-out
    and from outside: no process of the program is left (they used to run on, 1.7 GB of them
    20 s after close() under a root trainer) and no temporary folder is left."""
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))  # the workers' and this process's temp folders
    monkeypatch.setattr(tempfile, "tempdir", None)
    marker = f"family-{secrets.token_hex(6)}"
    sample = expecting(sleeping_family(marker), "never printed")

    def config(timeout_s: float) -> RewardConfig:
        options = {"code": {"timeout_s": 120.0}}
        return RewardConfig(functions=["code"], num_workers=1, timeout_s=timeout_s, options=options)

    with RewardRunner(config(3.0)) as runner:
        result = runner.score([sample])
        assert [failure.kind for failure in result.failures] == ["timeout"]
        assert processes_with(marker) == []  # the pool waited for them after the kill
    with RewardRunner(config(120.0)) as runner:

        def kill_the_worker_once_the_family_runs() -> None:
            worker = runner.pool._workers[0].process.pid
            deadline = time.monotonic() + 30
            while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(worker, signal.SIGKILL)

        killer = threading.Thread(target=kill_the_worker_once_the_family_runs)
        killer.start()
        result = runner.score([sample])
        killer.join()
        assert [failure.kind for failure in result.failures] == ["error"]
        assert "worker process died" in result.failures[0].message
    # The kernel ends a PID namespace whose init died at once, but not synchronously with the
    # worker's death: allow it a moment.
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == []
    assert list(private.iterdir()) == []


def test_a_trainer_that_is_pid_1_collects_no_zombies(sandbox):
    """Containers started without an init make the trainer PID 1, which inherits every orphan:
    each sandboxed call used to leave one zombie there (382 in 45 s). Calls in the trainer and
    in reward workers, with the trainer as PID 1 of a PID namespace of its own."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("a PID namespace of its own needs root and unshare here (CI runs as root)")
    package_root = str(Path(code_reward.__code__.co_filename).resolve().parents[2])
    result = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", PID_1_TRAINER],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": package_root},
    )
    assert result.returncode == 0, result.stderr
    pid, outputs_right, in_process, after_workers, passed = result.stdout.split()
    assert (pid, outputs_right, passed) == ("1", "True", "8.0")
    assert (in_process, after_workers) == ("0", "0")


@pytest.mark.timeout(180)
def test_training_run_with_hostile_programs(sandbox, tmp_path, monkeypatch):
    """A short training run whose code rewards run hostile programs (tests/reward/
    hostile_rewards.py): it finishes, every reward call ends ok, the attacks score what the
    program reports (contained), the early exit scores 0. (Without isolation the run stops at
    start: ``test_code_reward.py::test_runner_refuses_to_start_without_isolation``.)"""
    from tests.e2e.harness import TINY, run_train

    name = "MEGATRON_GSPO_TRAINER_SECRET"
    monkeypatch.setenv(name, secrets.token_hex(8))
    overrides = [
        "steps=1",
        *TINY,
        "reward.functions=[tests.reward.hostile_rewards:attack_the_trainer,"
        "tests.reward.hostile_rewards:exit_early]",
        "reward.num_workers=2",
        "reward.timeout_s=60",
    ]
    run = run_train(tmp_path / "out", overrides, timeout=150)
    records = run.metrics()
    assert len(records) == 1
    for record in records:
        assert record["reward_errors"] == 0 and record["reward_timeouts"] == 0
        assert record["reward_hostile_rewards_attack_the_trainer_mean"] == 1.0
        assert record["reward_hostile_rewards_exit_early_mean"] == 0.0
