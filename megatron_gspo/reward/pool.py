"""Worker pools that run reward calls with a per-call time limit.

A pool has ``num_workers`` slots, each running one call at a time. A call's clock starts when a
slot takes it (not when the batch is submitted), so queueing never counts against the limit.

- :class:`ProcessPool`: each slot is a child process (``python -m megatron_gspo.reward.worker``,
  its own session) that resolves the reward functions by name itself. A call that runs past the
  limit is stopped by killing the worker and every process below it (the code reward's
  sandboxes run in sessions of their own, out of reach of a process-group kill); a fresh worker
  takes its place. A worker that dies (segfault, ``os._exit``, a SIGKILL from outside) fails its
  call and is replaced the same way; its sandboxes die with it (``docs/code-sandbox.md``). Each
  worker's ``TMPDIR`` is a directory of its own that the pool removes with the worker, so that a
  killed worker leaves no temporary files behind. Workers are
  started with ``subprocess`` rather than ``multiprocessing`` so that they do not re-import the
  trainer's ``__main__`` (Megatron and all) and are safe to start from a process with threads.
- :class:`ThreadPool`: each slot is a thread of this process. A call past the limit is abandoned
  (Python cannot stop a thread); it runs on in the background and its result is discarded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from megatron_gspo.reward.functions import RewardInput, RewardSpec, check_score
from megatron_gspo.runtime.lifetime import kill_process_tree

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CallOutcome:
    """How one call of one reward function on one sample ended."""

    status: str
    """``ok``, ``error`` (raised, returned a non-number, or its worker died) or ``timeout``."""
    value: float
    """The score; NaN unless ``ok``."""
    message: str = ""
    seconds: float = 0.0

    @classmethod
    def timed_out(cls, timeout_s: float, seconds: float) -> CallOutcome:
        """A call still without a result after ``timeout_s`` (``reward.timeout_s``)."""
        return cls(
            "timeout", float("nan"), f"no result after {timeout_s:g} s (reward.timeout_s)", seconds
        )


def call_reward(function: Callable[[RewardInput], float], sample: RewardInput) -> CallOutcome:
    """Run one call, turning every exception into an ``error`` outcome with its origin."""
    start = time.monotonic()
    try:
        returned = function(sample)
    except (Exception, SystemExit) as error:
        frames = traceback.extract_tb(error.__traceback__)
        origin = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
        message = f"{type(error).__name__}: {error}{origin}"
        return CallOutcome("error", float("nan"), message, time.monotonic() - start)
    seconds = time.monotonic() - start
    try:
        value = check_score(returned)
    except (TypeError, ValueError) as error:
        return CallOutcome("error", float("nan"), str(error), seconds)
    return CallOutcome("ok", value, "", seconds)


Call = tuple[int, RewardInput]
"""(index of the function, sample)."""


class _Pool:
    """The scheduling loop shared by both pools; subclasses start, wait on and stop slots."""

    def __init__(self, num_workers: int, timeout_s: float):
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.num_replaced = 0

    def run(self, calls: Sequence[Call]) -> list[CallOutcome]:
        """Outcomes of ``calls``, in order."""
        outcomes: list = [None] * len(calls)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[int, float]] = {}  # slot -> (call index, start time)
        while pending or busy:
            for slot in range(self.num_workers):
                if slot in busy or not pending:
                    continue
                call_index = pending.popleft()
                try:
                    self._submit(slot, call_index, *calls[call_index])
                except OSError:
                    # The idle worker is gone (killed from outside): replace it, keep the call.
                    self._replace(slot)
                    pending.appendleft(call_index)
                    continue
                except Exception as error:  # e.g. a sample that cannot be pickled
                    outcomes[call_index] = CallOutcome(
                        "error", float("nan"), f"cannot send the call: {error}"
                    )
                    continue
                busy[slot] = (call_index, time.monotonic())
            if not busy:
                continue
            deadline = min(start for _, start in busy.values()) + self.timeout_s
            for slot, call_index, outcome in self._wait(
                busy, max(0.0, deadline - time.monotonic())
            ):
                if busy.get(slot, (None,))[0] == call_index:
                    outcomes[call_index] = outcome
                    del busy[slot]
            now = time.monotonic()
            for slot, (call_index, start) in list(busy.items()):
                if now - start >= self.timeout_s:
                    outcomes[call_index] = CallOutcome.timed_out(self.timeout_s, now - start)
                    del busy[slot]
                    self._replace(slot)
        return outcomes

    def _replace(self, slot: int) -> None:
        self.num_replaced += 1
        self._stop(slot)
        self._start(slot)

    def _submit(self, slot: int, call_index: int, function_index: int, sample: RewardInput):
        raise NotImplementedError

    def _wait(self, busy: dict, timeout: float) -> list[tuple[int, int, CallOutcome]]:
        raise NotImplementedError

    def _start(self, slot: int) -> None:
        raise NotImplementedError

    def _stop(self, slot: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


class ThreadPool(_Pool):
    """Slots are threads of this process that take calls from one shared queue.

    Unlike the process pool, the scheduling needs no message per call: the whole batch is
    queued at once, each thread notes which call it runs and since when, and the caller sleeps
    until the last outcome arrives or the oldest running call reaches its limit. Handing every
    call to a slot and waking the caller for every result cost 25 us per call (1.7 ms for the 64
    calls of a vs-TRL step against 0.09 ms for the calls themselves; benchmarks/README.md).
    """

    def __init__(
        self,
        functions: Sequence[Callable[[RewardInput], float]],
        num_workers: int,
        timeout_s: float,
    ):
        super().__init__(num_workers, timeout_s)
        self.functions = list(functions)
        self._condition = threading.Condition()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list = [None] * num_workers
        """The live thread of each slot; a thread that finds itself replaced stops."""
        self._running: dict[int, tuple[int, float]] = {}  # slot -> (call index, start time)
        self._outcomes: list = []
        self._remaining = 0
        for slot in range(num_workers):
            self._start(slot)

    def run(self, calls: Sequence[Call]) -> list[CallOutcome]:
        """Outcomes of ``calls``, in order."""
        if not calls:
            return []
        with self._condition:
            self._outcomes = outcomes = [None] * len(calls)
            self._remaining = len(calls)
            for call_index, (function_index, sample) in enumerate(calls):
                self._calls.put((outcomes, call_index, function_index, sample))
            while self._remaining:
                now = time.monotonic()
                for slot, (call_index, start) in list(self._running.items()):
                    if now - start >= self.timeout_s:
                        outcomes[call_index] = CallOutcome.timed_out(self.timeout_s, now - start)
                        self._remaining -= 1
                        del self._running[slot]
                        self._replace(slot)
                # A call that starts while we wait ends its limit after this wait does.
                oldest = min((start for _, start in self._running.values()), default=now)
                if self._remaining:
                    self._condition.wait(max(0.0, oldest + self.timeout_s - now))
        return outcomes

    def _serve(self, slot: int) -> None:
        me = threading.current_thread()
        while True:
            task = self._calls.get()
            if task is None:
                return
            outcomes, call_index, function_index, sample = task
            with self._condition:
                if self._threads[slot] is not me:  # replaced while idle: give the call back
                    self._calls.put(task)
                    return
                self._running[slot] = (call_index, time.monotonic())
            outcome = call_reward(self.functions[function_index], sample)
            with self._condition:
                if self._threads[slot] is not me:  # abandoned after a time-out: discard
                    return
                del self._running[slot]
                outcomes[call_index] = outcome
                self._remaining -= 1
                if not self._remaining:
                    self._condition.notify()

    def _start(self, slot: int) -> None:
        thread = threading.Thread(
            target=self._serve, args=(slot,), name=f"reward-worker-{slot}", daemon=True
        )
        self._threads[slot] = thread
        thread.start()

    def _stop(self, slot: int) -> None:
        logger.warning(
            "reward worker thread %d is abandoned after a time-out: threads cannot be stopped, so "
            "the call keeps running in the background (use reward.executor=process to kill it)",
            slot,
        )
        self._threads[slot] = None  # the thread stops once the call returns

    def close(self) -> None:
        for _ in range(self.num_workers):
            self._calls.put(None)


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class _WorkerProcess:
    """One ``megatron_gspo.reward.worker`` child and the two pipes to it."""

    def __init__(self, specs: Sequence[RewardSpec]):
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        # Its temporary files (the sandbox's working folders among them) go here, removed by
        # kill() however the worker ended: a SIGKILLed worker cleans up nothing itself.
        self.temporary = tempfile.mkdtemp(prefix="megatron_gspo_reward_worker_")
        environment = dict(os.environ)
        environment["TMPDIR"] = self.temporary
        # The child must import the same modules (user reward functions included) as this process.
        environment["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "megatron_gspo.reward.worker",
                    str(child_reads),
                    str(child_writes),
                    self.temporary,
                ],
                pass_fds=(child_reads, child_writes),
                env=environment,
                start_new_session=True,
            )
        except BaseException:
            shutil.rmtree(self.temporary, ignore_errors=True)
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self.sender = Connection(parent_writes, readable=False)
        self.receiver = Connection(parent_reads, writable=False)
        self.sender.send(("init", [(spec.name, dict(spec.options)) for spec in specs]))

    def wait_ready(self) -> None:
        if not self.receiver.poll(WORKER_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(
                f"reward worker {self.process.pid} did not start within {WORKER_START_TIMEOUT_S} s"
            )
        try:
            message = self.receiver.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(
                f"reward worker exited during start-up (status {self.process.wait()}); its "
                "traceback is on stderr above"
            ) from None
        if message[0] != "ready":
            self.kill()
            raise RuntimeError(f"reward worker failed to start: {message[1]}")

    def kill(self) -> None:
        """End the worker, every process below it (the code sandboxes it started run in
        sessions of their own) and its process group, and remove its temporary folder."""
        if self.process.returncode is None:  # not reaped yet, so the pid is still the worker's
            kill_process_tree(self.process.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.sender.close()
        self.receiver.close()
        shutil.rmtree(self.temporary, onerror=_make_removable)

    def shut_down(self, grace_s: float = 2.0) -> None:
        with contextlib.suppress(OSError):
            self.sender.send(None)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=grace_s)
        self.kill()


def _make_removable(function, path, _exc_info) -> None:
    # A sandboxed program may leave read-only files or folders: make them writable and retry.
    with contextlib.suppress(OSError):
        os.chmod(os.path.dirname(path), 0o700)
        os.chmod(path, 0o700)
        function(path)


def _shut_down_all(workers: list) -> None:
    for worker in workers:
        if worker is not None:
            worker.shut_down()


class ProcessPool(_Pool):
    def __init__(self, specs: Sequence[RewardSpec], num_workers: int, timeout_s: float):
        super().__init__(num_workers, timeout_s)
        self.specs = list(specs)
        self._workers: list = [None] * num_workers
        # Start all, then wait for all: the workers import in parallel.
        for slot in range(num_workers):
            self._workers[slot] = _WorkerProcess(self.specs)
        try:
            for worker in self._workers:
                worker.wait_ready()
        except Exception:
            _shut_down_all(self._workers)
            raise
        self._finalizer = weakref.finalize(self, _shut_down_all, self._workers)

    def _start(self, slot: int) -> None:
        worker = _WorkerProcess(self.specs)
        worker.wait_ready()
        self._workers[slot] = worker

    def _stop(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = None

    def _submit(self, slot, call_index, function_index, sample) -> None:
        self._workers[slot].sender.send(("call", call_index, function_index, sample))

    def _wait(self, busy, timeout):
        by_receiver = {self._workers[slot].receiver: slot for slot in busy}
        ready = []
        for receiver in wait(list(by_receiver), timeout=timeout):
            slot = by_receiver[receiver]
            try:
                _, call_index, outcome = receiver.recv()
            except (EOFError, OSError):
                try:
                    status = self._workers[slot].process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:  # closed its pipe but lives on: killed below
                    status = None
                call_index = busy[slot][0]
                outcome = CallOutcome(
                    "error",
                    float("nan"),
                    f"the reward worker process died (exit status {status})",
                    time.monotonic() - busy[slot][1],
                )
                self._replace(slot)
            ready.append((slot, call_index, outcome))
        return ready

    def close(self) -> None:
        self._finalizer()
