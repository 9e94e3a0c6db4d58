"""Asynchronous training end to end (docs/async.md): the loopback server in a process of its own,
a server killed mid-run (and in the synchronous loop), SIGKILLs of the trainer at random points,
parallel layouts.

Every test checks exactly-once from outside: ``trained_prompts.jsonl`` and the pending prompt ids
of the last checkpoint together hold every prompt the stream served, each once.
"""

from __future__ import annotations

import json
import random
import re
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import torch

from megatron_gspo.driver.ledger import read_trained_prompts

from .harness import (
    LAYOUT_DEPENDENT,
    TINY,
    assert_records_close,
    assert_records_equal,
    assert_required_metrics,
    read_metrics,
    run_train,
    start,
    tail,
    train_command,
    wait_for_step,
)
from .test_agentic import TOOL_TASK

SERVER_PROCESS = (
    "rollout.engine=embedded_http",
    "rollout.embedded_server_process=true",
    "rollout.engine_threads=1",
)
ASYNC_METRICS = (
    "staleness_mean",
    "staleness_max",
    "partial_sample_frac",
    "segments_per_sample",
    "trainer_wait_s",
)


def latest_data_state(output_dir: Path) -> dict:
    root = output_dir / "checkpoints"
    latest = (root / "latest").read_text().strip()
    return json.loads((root / latest / "checkpoint.json").read_text())["extra_state"]["data"]


def assert_exactly_once(output_dir: Path, steps: int) -> list[int]:
    """Each step has one line; trained, dropped (dynamic sampling) and pending prompts are the
    served ones, each once."""
    lines = read_trained_prompts(output_dir)
    assert [line["step"] for line in lines] == list(range(steps)), lines
    trained = [prompt for line in lines for prompt in line["prompt_ids"]]
    dropped = [prompt for line in lines for prompt in line.get("dropped_prompt_ids", [])]
    state = latest_data_state(output_dir)
    counts = Counter(trained + dropped + state["pending_prompt_ids"])
    twice = sorted(prompt for prompt, count in counts.items() if count > 1)
    assert not twice, f"trained (or pending) twice: {twice}"
    assert sorted(counts) == list(range(state["consumed"])), "a served prompt was lost"
    return trained


def server_processes(launch) -> list[psutil.Process]:
    launch.remember_tree()
    found = []
    for process in launch.tree:
        try:
            command = " ".join(process.cmdline())
            if "megatron_gspo.rollout.server" in command and process.status() != "zombie":
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def kill_the_server(launch) -> None:
    """SIGKILL the run's one loopback server process with the trainer (a single process, the
    server's parent) stopped meanwhile: a step takes about a second, and a loaded machine could
    otherwise let the run finish before the kill lands, leaving nothing to recover."""
    launch.process.send_signal(signal.SIGSTOP)
    try:
        (server,) = server_processes(launch)
        server.send_signal(signal.SIGKILL)
    finally:
        launch.process.send_signal(signal.SIGCONT)


@pytest.mark.slow
def test_bound_zero_is_the_synchronous_loop_bit_for_bit(gspo_run, tmp_path):
    """The asynchronous driver at max_staleness 0 (its producer thread generates each batch after
    the step's weight sync) gives the synchronous run's metrics and weights and optimizer state
    after two steps, bit for bit (the synchronous run: the shared GSPO reference, which saves
    step 2). The full run's: CI checks the driver's batches at bound 0 against the synchronous
    driver's bit for bit (tests/async_training/test_async_driver.py) and trains asynchronously
    end to end in tests/e2e/test_agentic.py."""
    overrides = ["steps=2", *TINY, "checkpoint.interval=2", "rollout.max_staleness=0"]
    output_dir = tmp_path / "async"
    worker = [sys.executable, str(Path(__file__).with_name("async_bound_zero.py"))]
    launch = start([*worker, *overrides, f"output_dir={output_dir}"], output_dir)
    assert launch.wait(timeout=240) == 0, tail(launch.log)
    reference, records = gspo_run.metrics()[:2], launch.metrics()
    assert "staleness_max" in records[0] and "staleness_max" not in reference[0]
    assert len(records) == len(reference) == 2
    for want, got in zip(reference, records):
        assert_records_equal(want, got)
    assert read_trained_prompts(output_dir) == read_trained_prompts(gspo_run.output_dir)[:2]
    assert_same_checkpoint_tensors(
        gspo_run.output_dir / "checkpoints" / "step_000002",
        output_dir / "checkpoints" / "step_000002",
    )


@pytest.mark.slow
def test_bound_zero_is_the_synchronous_loop_bit_for_bit_with_episodes(tmp_path):
    """The same with multi-turn episodes (three turns each: every digit ends a turn, with
    per-turn advantages): the asynchronous driver at bound 0 gives the synchronous run's
    metrics, trained prompts, weights and optimizer state bit for bit."""
    overrides = [
        "steps=2",
        *TINY,
        "algo.response_length=24",
        "env.name=tests.envs.scripted:ScriptedEnvironment",
        "env.max_turns=3",
        "+env.options.turns=3",
        "+env.options.stop_token_ids=[0,1,2,3,4,5,6,7,8,9]",
        "+env.options.turn_reward=0.25",
        "algo.importance_sampling=seq_token",
        "algo.advantage_level=turn",
        "checkpoint.interval=2",
    ]
    synchronous = run_train(tmp_path / "sync", overrides)
    output_dir = tmp_path / "async"
    worker = [sys.executable, str(Path(__file__).with_name("async_bound_zero.py"))]
    launch = start([*worker, *overrides, f"output_dir={output_dir}"], output_dir)
    assert launch.wait(timeout=600) == 0, tail(launch.log)
    reference, records = synchronous.metrics(), launch.metrics()
    assert len(records) == len(reference) == 2 and "staleness_max" in records[0]
    assert all(record["env/turns_mean"] > 1.0 for record in records)
    for want, got in zip(reference, records):
        assert_records_equal(want, got)
    assert read_trained_prompts(output_dir) == read_trained_prompts(synchronous.output_dir)
    assert_same_checkpoint_tensors(
        synchronous.output_dir / "checkpoints" / "step_000002",
        output_dir / "checkpoints" / "step_000002",
    )


def assert_same_checkpoint_tensors(expected: Path, actual: Path) -> None:
    from megatron_gspo.convert.torch_dist import Region, TorchDistCheckpoint

    want, got = TorchDistCheckpoint(str(expected)), TorchDistCheckpoint(str(actual))
    assert sorted(want.tensors) == sorted(got.tensors)
    assert any(key.startswith("optimizer") for key in want.tensors)
    for key, metadata in want.tensors.items():
        region = Region(key, (0,) * len(metadata.size), tuple(metadata.size), 0)
        assert torch.equal(want.read(region), got.read(region)), key


@pytest.mark.slow
def test_killed_server_is_restarted_and_resynced(tmp_path):
    """SIGKILL the loopback server process mid-run: the trainer restarts it, sends it the newest
    weights before it serves again, generates the lost requests again and finishes."""
    output_dir = tmp_path / "out"
    overrides = [
        "steps=4",
        *TINY,
        *SERVER_PROCESS,
        "rollout.max_staleness=1",
        "rollout.max_retries=1",  # the dead server is noticed after one retry
        "checkpoint.interval=4",
        f"output_dir={output_dir}",
    ]
    launch = start(train_command(overrides), output_dir)
    try:
        # After step 0: the producer may run a step ahead, and the sync after the next step
        # still needs the server, so a later step's record counts the restart.
        wait_for_step([launch], output_dir, 0, timeout=240)
        kill_the_server(launch)
        assert launch.wait(timeout=300) == 0, tail(launch.log)
    finally:
        launch.kill()
    records = read_metrics(output_dir)
    assert_required_metrics(records, steps=4)
    assert all(name in records[0] for name in ASYNC_METRICS)
    assert "overlap_frac" in records[1] and "engine_idle_s" in records[1]
    assert records[-1]["engine_restarts"] >= 1, tail(launch.log)
    assert "is gone: restarting it" in launch.log and "re-synced to weight version" in launch.log
    # The lost requests' groups were generated again, and the chunk in flight at the end was
    # cancelled: no trained batch held an aborted sample.
    assert "rollout samples were aborted" not in launch.log, tail(launch.log)
    # The server reports the version of the weights it loaded: a restarted server that had not
    # taken the newest weights again would report version 0, its samples too stale to train.
    for record in records:
        assert record["staleness_max"] <= 1 and record["requeued_stale"] == 0, record
        assert record["rollout_log_prob_abs_diff"] < 0.5, record
    assert_exactly_once(output_dir, steps=4)


def test_killed_server_is_restarted_in_the_synchronous_loop(gspo_run, tmp_path):
    """The synchronous loop (``max_staleness`` 0) with its loopback server process SIGKILLed
    after step 0: the trainer restarts it, sends it the newest weights and generates the
    step's prompts again with the step's seeds, so every metric but wall times equals the
    uninterrupted in-process run's, bit for bit, and so do the trained prompts."""
    output_dir = tmp_path / "out"
    overrides = [
        "steps=3",
        *TINY,
        *SERVER_PROCESS,
        "rollout.max_retries=1",  # the dead server is noticed after one retry
        "checkpoint.interval=3",
        f"output_dir={output_dir}",
    ]
    launch = start(train_command(overrides), output_dir)
    try:
        wait_for_step([launch], output_dir, 0, timeout=240)  # steps 1 and 2 need the server
        kill_the_server(launch)
        assert launch.wait(timeout=300) == 0, tail(launch.log)
    finally:
        launch.kill()
    records = read_metrics(output_dir)
    assert_required_metrics(records, steps=3)
    assert records[-1]["engine_restarts"] == 1, tail(launch.log)
    assert "is gone: restarting it" in launch.log and "re-synced to weight version" in launch.log
    assert "Traceback" not in launch.log, tail(launch.log)
    for want, got in zip(gspo_run.metrics(), records):
        assert_records_equal(want, got)
    assert read_trained_prompts(output_dir) == read_trained_prompts(gspo_run.output_dir)
    assert_exactly_once(output_dir, steps=3)


@pytest.mark.slow
def test_engine_that_cannot_come_back_stops_with_a_checkpoint(tmp_path):
    """With no time to restart, the run saves a checkpoint of the steps it trained and stops
    (exit 3, no traceback); resuming it trains the rest, every prompt once."""
    output_dir = tmp_path / "out"
    overrides = [
        *TINY,
        *SERVER_PROCESS,
        "rollout.max_staleness=1",
        "rollout.max_retries=1",  # the dead server is given up on after one retry
        "checkpoint.interval=4",
        f"output_dir={output_dir}",
    ]
    launch = start(
        train_command(["steps=4", *overrides, "rollout.engine_restart_timeout_s=0"]), output_dir
    )
    try:
        wait_for_step([launch], output_dir, 0, timeout=240)  # steps 1-3 need the server
        kill_the_server(launch)
        returncode = launch.wait(timeout=300)
    finally:
        launch.kill()
    assert returncode == 3, tail(launch.log)
    assert "did not come back within rollout.engine_restart_timeout_s=0s" in launch.log
    assert "Traceback" not in launch.log, tail(launch.log)
    saved = re.search(r"saved \S+step_0*(\d+) before stopping", launch.log)
    assert saved, tail(launch.log)
    resumed = run_train(output_dir, ["steps=4", *overrides, "resume=true"], timeout=300)
    assert f"resuming from {output_dir / 'checkpoints'}" in resumed.log
    assert_required_metrics(resumed.metrics(), steps=4)
    assert_exactly_once(output_dir, steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("episodes", [False, True], ids=["completions", "tool_episodes"])
def test_every_prompt_trained_once_across_sigkills(tmp_path, episodes):
    """SIGKILL the trainer while a checkpoint is being written, then twice at random moments
    (generating, updating, saving), resuming each time: the final record trains every prompt
    the stream served once, none twice, none lost. ``tool_episodes``: the same with multi-turn
    episodes of the tool task made by two producer processes on the loopback server's process,
    and DAPO's dynamic sampling (dropped prompts count as consumed, once)."""
    output_dir = tmp_path / "out"
    steps = 8
    overrides = [
        f"steps={steps}",
        *TINY,
        "rollout.max_staleness=2",
        "checkpoint.interval=1",
        f"output_dir={output_dir}",
    ]
    if episodes:
        overrides += [
            *TOOL_TASK,
            "algo.dynamic_sampling=true",
            "algo.dynamic_sampling_max_rounds=2",
            "rollout.producer_processes=2",
            *SERVER_PROCESS,
        ]
    chance = random.Random(15)
    kills = ["during a checkpoint save", "at random", "at random"]
    killed = 0
    for attempt, moment in enumerate(kills):
        command = train_command([*overrides, *(["resume=true"] if attempt else [])])
        launch = start(command, output_dir, f"attempt{attempt}.log")
        try:
            wait_for_step([launch], output_dir, len(read_metrics(output_dir)), timeout=240)
            if moment == "during a checkpoint save":
                wait_for_temporary_checkpoint(output_dir / "checkpoints", launch)
            else:
                time.sleep(chance.uniform(0.0, 1.0))
        finally:
            launch.kill()
        if launch.process.returncode == 0:
            break  # it finished before the kill
        assert launch.process.returncode == -signal.SIGKILL, tail(launch.log)  # not a crash
        killed += 1
    assert killed >= 2
    final = run_train(output_dir, [*overrides, "resume=true"], timeout=300)
    # metrics.jsonl and trained_prompts.jsonl get a step's line before its checkpoint, and a
    # resume drops the lines of the steps it trains again: each holds every step exactly once.
    assert [record["step"] for record in final.metrics()] == list(range(steps))
    trained = assert_exactly_once(output_dir, steps=steps)
    assert len(trained) == steps * 2  # rollout_batch_size=2 prompts per step


def wait_for_temporary_checkpoint(root: Path, launch, timeout: float = 120.0) -> None:
    """Return while a ``step_N.tmp-*`` directory exists (a save in progress)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(root.glob("step_*.tmp-*")) or launch.process.poll() is not None:
            return
        time.sleep(0.002)
    raise AssertionError("no checkpoint save was seen in progress")


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_and_expert_parallel_async_run(gspo_run, tmp_path):
    """pp2 x ep2 (dp2) with one step off-policy: step 0 (generated by the initial weights) is
    the synchronous run's step 0; later steps train one-step-old samples, every prompt once."""
    output_dir = tmp_path / "out"
    overrides = [
        "steps=3",
        *TINY,
        "parallel.pp=2",
        "parallel.ep=2",
        "rollout.max_staleness=1",
        "checkpoint.interval=3",
    ]
    run = run_train(output_dir, overrides, nproc=4, timeout=400)
    records = run.metrics()
    assert_required_metrics(records, steps=3)
    assert_records_close(
        gspo_run.metrics()[0], records[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT
    )
    assert all(record["staleness_max"] <= 1 for record in records)
    assert_exactly_once(output_dir, steps=3)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_agents_async_run(gspo_run, tmp_path):
    """Two torchrun agents (tp2 x ep2 across two "nodes"): the producer runs on global rank 0,
    every rank takes its batches from the broadcast and drains the weight stream."""
    from .test_multinode import start_two_nodes

    output_dir = tmp_path / "out"
    extra = ["rollout.max_staleness=1", "checkpoint.interval=2"]
    launches = start_two_nodes(output_dir, steps=2, extra=extra)
    try:
        returncodes = [launch.wait(timeout=400) for launch in launches]
    finally:
        for launch in launches:
            launch.kill()
    assert returncodes == [0, 0], "\n".join(tail(launch.log, 3000) for launch in launches)
    records = launches[0].metrics()
    assert_required_metrics(records, steps=2)
    assert_records_close(
        gspo_run.metrics()[0], records[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT
    )
    assert records[1]["staleness_max"] <= 1
    assert_exactly_once(output_dir, steps=2)
