"""Entry point of a reward worker process (started by :class:`~megatron_gspo.reward.pool.ProcessPool`).

``python -m megatron_gspo.reward.worker READ_FD WRITE_FD [TEMPORARY_DIRECTORY]``. The directory
(the worker's ``TMPDIR``, made by the pool, which removes it whatever ends the worker) is removed
here too when the trainer dies. Protocol, one pickled message each way:
``("init", [(name, options), ...])`` -> ``("ready",)`` or ``("init_error", message)``; then
``("call", call_index, function_index, sample)`` -> ``("result", call_index, CallOutcome)``;
``None`` or end of file ends the worker.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Optional

from megatron_gspo.reward.functions import RewardSpec, load_reward_function
from megatron_gspo.reward.pool import call_reward
from megatron_gspo.runtime.lifetime import become_subreaper


def _exit_with_parent(temporary: Optional[str]) -> None:
    """Exit when the trainer is gone, even in the middle of a call that never returns; the code
    sandboxes the worker started die with it (``docs/code-sandbox.md``).

    A watchdog thread rather than PR_SET_PDEATHSIG: that signal fires when the *thread* that
    started the worker exits, and a replacement worker may be started from a short-lived thread.
    """
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                if temporary:  # the pool that would remove it is gone
                    shutil.rmtree(temporary, ignore_errors=True)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def main(argv: list[str]) -> int:
    _exit_with_parent(argv[3] if len(argv) > 3 else None)
    # The init of each code sandbox outlives the bwrap process that started it by a moment, and
    # then has no parent: as a subreaper the worker gets it back and reaps it (sandbox.py), where
    # a trainer running as a container's PID 1 would collect it as a zombie.
    become_subreaper()
    receiver = Connection(int(argv[1]), writable=False)
    sender = Connection(int(argv[2]), readable=False)
    try:
        _, specs = receiver.recv()
    except EOFError:
        return 0
    try:
        functions = [
            load_reward_function(RewardSpec(name=name, options=options)) for name, options in specs
        ]
    except Exception as error:
        sender.send(("init_error", f"{type(error).__name__}: {error}"))
        return 1
    sender.send(("ready",))
    while True:
        try:
            message = receiver.recv()
        except EOFError:
            return 0
        if message is None:
            return 0
        _, call_index, function_index, sample = message
        sender.send(("result", call_index, call_reward(functions[function_index], sample)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
