"""Hostile programs through the public ``code`` reward (in this process, in reward worker
processes, and in a training run), each with the outcome asserted.

Each program attempts an attack and prints what it got; the sample's stdin/stdout case expects
the line the program prints when every attempt failed. So a score of 1.0 proves that the
program ran to its end and that the attack failed; the side effects are checked from outside
too (the caller and the worker alive, no connection at the listener, no process left, no file
written). Where the kernel cannot isolate code, each test asserts the fail-closed error instead.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_gspo.config import ConfigError, RewardConfig
from megatron_gspo.reward import RewardInput, RewardRunner
from megatron_gspo.reward.code_execution import code_reward

from .sandbox_support import LoopbackListener, isolated_or_fail_closed, unavailable_reason


def expecting(program: str, verdict: str) -> RewardInput:
    """A sample whose one stdin/stdout case passes when ``program`` prints ``verdict``."""
    return RewardInput(
        prompt="attack",
        response=f"```python\n{program}\n```",
        metadata={"tests": [{"input": "", "output": verdict}]},
    )


def score(sample: RewardInput, **options):
    return isolated_or_fail_closed(lambda: code_reward(sample, timeout_s=10.0, **options))


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


def processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if marker in (process.info["cmdline"] or []):
            found.append(process)
    return found


# --------------------------------------------------------------------------------------------
# The tests


def test_caller_survives_kill_attempts_on_its_pids():
    caller = os.getpid()
    assert score(expecting(kill_program([caller, os.getppid()]), "contained")) in (None, 1.0)
    assert psutil.Process(caller).is_running()


def test_environment_of_the_caller_is_not_readable(monkeypatch):
    name = f"MEGATRON_GSPO_TEST_SECRET_{secrets.token_hex(4)}"
    monkeypatch.setenv(name, "hunter2")
    program = environment_program([os.getpid(), os.getppid()], name)
    assert score(expecting(program, "contained")) in (None, 1.0)


def test_loopback_listener_gets_no_connection():
    listener = LoopbackListener()
    try:
        program = network_program(listener.port, [os.getpid()])
        assert score(expecting(program, "contained")) in (None, 1.0)
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


def test_no_process_outlives_the_call():
    marker = f"outlive-{secrets.token_hex(6)}"
    assert score(expecting(outliving_program(marker), "contained")) in (None, 1.0)
    assert processes_with(marker) == []


def test_writes_outside_the_scratch_directory_fail(tmp_path):
    outside = tmp_path / "escaped.txt"
    assert score(expecting(write_program(outside), "contained")) in (None, 1.0)
    assert not outside.exists()
    assert not Path("/etc/escaped").exists() and not Path(sys.prefix, "escaped").exists()


def test_fork_bomb_is_capped():
    marker = f"bomb-{secrets.token_hex(6)}"
    start = time.monotonic()
    sample = expecting(fork_bomb(marker, limit=8), "contained")
    assert score(sample, max_processes=8) in (None, 1.0)
    assert time.monotonic() - start < 30
    assert processes_with(marker) == []


def test_reward_workers_and_caller_survive_and_stay_unreplaced(monkeypatch):
    """Through the runner's worker processes: kill attempts on the worker (the sandbox's real
    parent) and the caller (its grandparent) by their pids, the sandbox's own parent chain
    killed, the worker's environment read. Every call ends ``ok``; no worker is replaced."""
    name = f"MEGATRON_GSPO_TEST_SECRET_{secrets.token_hex(4)}"
    monkeypatch.setenv(name, "hunter2")  # inherited by the workers
    config = RewardConfig(functions=["code"], num_workers=2, timeout_s=60.0)
    try:
        runner = RewardRunner(config)
    except ConfigError as error:
        assert unavailable_reason() is not None and "code sandbox cannot isolate" in str(error)
        return
    with runner:
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


@pytest.mark.timeout(180)
def test_training_run_with_hostile_programs(tmp_path, monkeypatch):
    """A short training run whose code rewards run hostile programs (tests/reward/
    hostile_rewards.py): it finishes, every reward call ends ok, the attacks score what the
    program reports (contained), the early exit scores 0. Without isolation the run stops at
    start with the fail-closed error."""
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
    if unavailable_reason() is not None:
        run = run_train(tmp_path / "out", overrides, expect_returncode=None)
        assert run.process.returncode != 0 and "code sandbox cannot isolate" in run.log
        return
    run = run_train(tmp_path / "out", overrides, timeout=150)
    records = run.metrics()
    assert len(records) == 1
    for record in records:
        assert record["reward_errors"] == 0 and record["reward_timeouts"] == 0
        assert record["reward_hostile_rewards_attack_the_trainer_mean"] == 1.0
        assert record["reward_hostile_rewards_exit_early_mean"] == 0.0
