"""Reward functions that score hostile programs with the ``code`` reward, for the training-run
test in ``test_hostile_code.py`` (loaded by import path inside the trainer's reward workers).

Each ignores the policy's response (a tiny random model writes no Python) and runs a fixed
program instead, built in the worker so that it can name the worker's and the trainer's pids.
"""

from __future__ import annotations

import os

from megatron_gspo.reward import RewardInput
from megatron_gspo.reward.code_execution import check_code_reward, code_reward

SECRET_NAME = "MEGATRON_GSPO_TRAINER_SECRET"


def _with_program(sample: RewardInput, program: str, verdict: str) -> RewardInput:
    return RewardInput(
        prompt=sample.prompt,
        response=f"```python\n{program}\n```",
        metadata={"tests": [{"input": "", "output": verdict}]},
    )


def attack_the_trainer(sample: RewardInput) -> float:
    """1.0 when the program ran to its end and every attack on the worker (this process) and
    the trainer (its parent) failed: pidfd and plain SIGKILL, reading their environments."""
    pids = [os.getpid(), os.getppid()]
    program = f"""
import os, signal
hits = []
for pid in {pids!r}:
    for attempt in ("pidfd", "kill", "environ"):
        try:
            if attempt == "pidfd":
                signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)
            elif attempt == "kill":
                os.kill(pid, signal.SIGKILL)
            elif {SECRET_NAME!r}.encode() in open(f"/proc/{{pid}}/environ", "rb").read():
                hits.append((attempt, pid))
                continue
            else:
                continue
            hits.append((attempt, pid))
        except OSError:
            pass
print("contained" if not hits else hits)
"""
    return code_reward(_with_program(sample, program, "contained"), timeout_s=20.0)


def exit_early(sample: RewardInput) -> float:
    """The first reward hack a policy finds: exit with status 0 before the tests run."""
    hack = RewardInput(
        prompt=sample.prompt,
        response="```python\nimport sys\nsys.exit(0)\n```",
        metadata={"tests": "assert False"},
    )
    return code_reward(hack, timeout_s=20.0)


# The runner's start-up check: without isolation the run stops at start (fails closed).
attack_the_trainer.check = check_code_reward  # type: ignore[attr-defined]
exit_early.check = check_code_reward  # type: ignore[attr-defined]
