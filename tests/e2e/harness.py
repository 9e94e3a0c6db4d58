"""Launching ``python -m megatron_gspo.train`` (one process, torchrun, two torchrun agents) from
tests, and comparing the ``metrics.jsonl`` of two runs.

Every launch is a real subprocess in a session of its own with a hard timeout; on timeout or at
the end of a test the whole process tree is SIGKILLed (torchrun starts each worker in a session
of its own, so killing a process group does not reach the workers).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

REPO_ROOT = Path(__file__).resolve().parents[2]

TINY = (
    "algo.rollout_batch_size=2",
    "algo.num_return_sequences_in_group=4",
    "algo.num_mini_batches=2",
    "algo.response_length=8",
    "sft_warmup_steps=0",
    "logging.progress_bar=false",
)
"""Overrides that make a step take about a second on one core (8 samples of at most 8 tokens)."""

GRPO = ("algo.importance_sampling=token", "algo.clip_low=0.2", "algo.clip_high=0.27")
REFERENCE_RUN = ("steps=3", *TINY, "checkpoint.interval=2", "rollout.save_rollouts=true")
"""The shared GSPO reference run (conftest.gspo_run); test_resume.py resumes a copy of it."""

REQUIRED_METRICS = (
    "step",
    "reward_mean",
    "policy_loss",
    "grad_norm",
    "clip_frac_token",
    "clip_frac_seq",
    "kl",
    "entropy",
    "response_len_mean",
    "step_time_s",
    "routing_change_frac",
)
"""What every step of an MoE run must log (``kl``: see ``metrics.headline_metrics``)."""

LAYOUT_DEPENDENT = frozenset({"tokens", "padding_tokens", "num_micro_batches"})
"""Per-rank token counts: they depend on how the batch is cut, not on what is computed."""


def is_time_key(key: str) -> bool:
    return key.startswith("time/") or key.endswith("_s") or key.endswith("_seconds")


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # Several ranks share two cores: one thread each avoids oversubscription (and keeps the
    # reductions of every rank in the same order run after run).
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def train_command(
    overrides: Sequence[str], *, nproc: int = 1, torchrun_args: Sequence[str] = ()
) -> list[str]:
    if nproc == 1 and not torchrun_args:
        launcher = [sys.executable, "-m", "megatron_gspo.train"]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *(torchrun_args or ("--master_port", str(free_port()))),
            "--nproc_per_node",
            str(nproc),
            "-m",
            "megatron_gspo.train",
        ]
    return launcher + list(overrides)


@dataclass
class Launch:
    """A running (or finished) launch: its process, log file and output directory."""

    process: subprocess.Popen
    log_path: Path
    output_dir: Path
    tree: list = field(default_factory=list)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> list[dict]:
        return read_metrics(self.output_dir)

    def remember_tree(self) -> None:
        """Record the launch's processes (workers included) for :meth:`kill`."""
        try:
            root = psutil.Process(self.process.pid)
            known = {p.pid for p in self.tree}
            self.tree += [p for p in [root, *root.children(recursive=True)] if p.pid not in known]
        except psutil.NoSuchProcess:
            pass

    def kill(self) -> None:
        """SIGKILL every process of the launch (torchrun workers live in sessions of their own)."""
        self.remember_tree()
        # The launch leads a process group of its own: its group also holds the children it forks
        # after the tree was read (Megatron's checkpoint writer processes), which would otherwise
        # live on, orphaned, when the launch is killed during a checkpoint save.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for process in self.tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        self.process.wait()

    def wait(self, timeout: float) -> int:
        """The exit code, waiting at most ``timeout`` seconds from now (then kill and fail)."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{' '.join(map(str, self.process.args))} did not finish in {timeout} s:\n"
                f"{tail(self.log)}"
            ) from None


def start(command: Sequence[str], output_dir: Path, log_name: str = "train.log") -> Launch:
    output_dir.mkdir(parents=True, exist_ok=True)
    log_path = output_dir.parent / f"{output_dir.name}.{log_name}"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            list(command),
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Launch(process, log_path, output_dir)


def run_train(
    output_dir: Path,
    overrides: Sequence[str],
    *,
    nproc: int = 1,
    timeout: float = 180,
    expect_returncode: Optional[int] = 0,
) -> Launch:
    """Run the trainer to the end; fail with the log's tail unless it exits ``expect_returncode``."""
    launch = start(train_command([*overrides, f"output_dir={output_dir}"], nproc=nproc), output_dir)
    returncode = launch.wait(timeout)
    if expect_returncode is not None and returncode != expect_returncode:
        raise AssertionError(
            f"exit code {returncode}, expected {expect_returncode}:\n{tail(launch.log)}"
        )
    return launch


def tail(text: str, characters: int = 6000) -> str:
    return text[-characters:]


def read_metrics(output_dir: Path) -> list[dict]:
    """Complete records of ``metrics.jsonl`` (a line being written is left out)."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def wait_for_step(launches: Sequence[Launch], output_dir: Path, step: int, timeout: float) -> None:
    """Poll until ``metrics.jsonl`` holds ``step`` (fails early when a launch exits)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in read_metrics(output_dir)):
            return
        for launch in launches:
            if launch.process.poll() is not None:
                raise AssertionError(
                    f"exited ({launch.process.returncode}) before step {step} was logged:\n"
                    f"{tail(launch.log)}"
                )
        time.sleep(0.1)
    for launch in launches:
        launch.kill()
    raise AssertionError(f"step {step} was not logged within {timeout} s")


def assert_required_metrics(
    records: list[dict], steps: int, *, not_measured: Sequence[str] = ()
) -> None:
    """Steps ``0..steps-1``, each with every required metric, all finite. ``not_measured``: the
    metrics a configuration documents as absent (they must then be absent, not zero)."""
    assert [r["step"] for r in records] == list(range(steps)), [r["step"] for r in records]
    for record in records:
        missing = [n for n in REQUIRED_METRICS if n not in record and n not in not_measured]
        assert not missing, f"step {record['step']} lacks {missing}"
        present = [n for n in not_measured if n in record]
        assert not present, f"step {record['step']}: {present} logged but nothing measures them"
        assert_finite(record)


def assert_finite(record: dict) -> None:
    # metrics.jsonl writes NaN and inf as strings ('nan'), which JSON cannot hold as numbers.
    bad = {
        key: value
        for key, value in record.items()
        if not isinstance(value, (int, float)) or not math.isfinite(value)
    }
    assert not bad, f"step {record['step']}: non-finite or non-numeric metrics {bad}"


def compared_keys(reference: dict, actual: dict, skip: frozenset = frozenset()) -> list[str]:
    keys = sorted(k for k in reference if not is_time_key(k) and k not in skip)
    missing = [k for k in keys if k not in actual]
    assert not missing, f"step {reference['step']}: {missing} only in the reference run"
    return keys


def assert_records_equal(reference: dict, actual: dict, skip: frozenset = frozenset()) -> None:
    """Bitwise equality of every metric but wall times (and ``skip``)."""
    differences = {
        key: (reference[key], actual[key])
        for key in compared_keys(reference, actual, skip)
        if reference[key] != actual[key]
    }
    assert not differences, f"step {reference['step']} differs: {differences}"


def assert_records_close(
    reference: dict, actual: dict, *, rtol: float, atol: float, skip: frozenset = frozenset()
) -> None:
    differences = {
        key: (reference[key], actual[key])
        for key in compared_keys(reference, actual, skip)
        if not math.isclose(reference[key], actual[key], rel_tol=rtol, abs_tol=atol)
    }
    assert not differences, f"step {reference['step']} differs: {differences}"
