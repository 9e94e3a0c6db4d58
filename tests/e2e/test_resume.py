"""Kill a run with SIGKILL right after a step's checkpoint, resume it, and get the uninterrupted
run.

``checkpoint.interval=1`` saves after the step's metrics line is written; once ``checkpoints/
latest`` names a step the resumed run continues from there and must reproduce every later step
exactly: same rollouts (sampling seeds derive from the step), same prompt stream position, same
optimizer state and reward statistics; ``metrics.jsonl`` holds every step once (the lines of the
steps trained again are dropped at the resume).
"""

from __future__ import annotations

import re
import shutil
import time

import pytest

from megatron_gspo.runtime.checkpoint_files import CheckpointError

from .harness import (
    LAYOUT_DEPENDENT,
    REFERENCE_RUN,
    TINY,
    assert_records_close,
    assert_records_equal,
    assert_required_metrics,
    run_train,
    start,
    train_command,
    wait_for_step,
)

KILLED_AFTER_STEP = 0


def kill_and_resume(output_dir, overrides, nproc):
    """Run 3 steps, SIGKILL every process once step 0's checkpoint is published, resume; return
    the records and the step the resumed run started from."""
    overrides = ["steps=3", *TINY, "checkpoint.interval=1", f"output_dir={output_dir}", *overrides]
    first = start(train_command(overrides, nproc=nproc), output_dir, "first.log")
    latest = output_dir / "checkpoints" / "latest"
    try:
        wait_for_step([first], output_dir, KILLED_AFTER_STEP, timeout=240)
        deadline = time.monotonic() + 120
        while not latest.exists() and first.process.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint within 120 s of step 0's line"
            time.sleep(0.05)
        first.remember_tree()  # torchrun's workers, while they are still its children
    finally:
        first.kill()
    assert latest.exists(), "no checkpoint before the kill"
    resumed = run_train(output_dir, [*overrides, "resume=true"], nproc=nproc, timeout=240)
    match = re.search(
        r"resuming from \S+step_0*(\d+)", resumed.log
    )  # trainer.setup.resume_checkpoint
    assert match, f"no resume message in the log:\n{resumed.log[-3000:]}"
    start_step = int(match.group(1))
    assert KILLED_AFTER_STEP < start_step < 3, start_step
    return resumed.metrics(), start_step


@pytest.mark.slow  # CI kills and resumes in bf16 (test_resume_bf16.py): the same path
def test_kill_and_resume_one_process(gspo_run, tmp_path):
    records, start_step = kill_and_resume(tmp_path / "out", [], nproc=1)
    # Steps before the restart come from the killed run, later ones from the resumed run; the
    # file holds each step once.
    assert_required_metrics(records, steps=3)
    for reference, actual in zip(gspo_run.metrics(), records):
        assert_records_equal(reference, actual)
    assert start_step >= 1


@pytest.mark.slow
@pytest.mark.distributed
def test_kill_and_resume_two_processes(gspo_run, tmp_path):
    """Expert and data parallel (ep2 x dp2) under torchrun: workers and agent killed together."""
    records, _ = kill_and_resume(tmp_path / "out", ["parallel.ep=2"], nproc=2)
    assert_required_metrics(records, steps=3)
    reference = gspo_run.metrics()
    assert_records_close(reference[0], records[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT)
    for old, new in zip(reference[1:], records[1:]):
        for key in ("reward_mean", "response_len_mean", "routing_change_frac"):
            assert new[key] == old[key], (new["step"], key)
        for key in ("policy_loss", "grad_norm", "entropy"):
            assert new[key] == pytest.approx(old[key], rel=1e-4, abs=1e-6), (new["step"], key)


def test_damaged_newest_checkpoint_falls_back_to_the_one_before(gspo_run, tmp_path):
    """A shard file of the newest checkpoint cut short (a full disk while copying it): the resume
    names the file, warns, and continues from the previous complete checkpoint, reproducing the
    uninterrupted run from there. The run is a copy of the shared reference run (checkpoints
    after steps 2 and 3), resumed with the reference's own settings."""
    from megatron_gspo.engine.checkpoint import resumable_checkpoint
    from megatron_gspo.runtime.checkpoint_files import damaged_files

    output_dir = tmp_path / "out"
    shutil.copytree(gspo_run.output_dir, output_dir)
    root = output_dir / "checkpoints"
    newest, previous = root / "step_000003", root / "step_000002"
    assert damaged_files(str(newest)) == [] and resumable_checkpoint(str(root)) == str(newest)
    shard = max(newest.glob("*.distcp"), key=lambda path: path.stat().st_size)
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    (problem,) = damaged_files(str(newest))
    assert problem.startswith(f"{shard}: ") and "truncated" in problem

    resumed = run_train(output_dir, [*REFERENCE_RUN, "resume=true"], timeout=240)
    log = resumed.log
    assert f"resuming from {previous} instead of the newer step_000003" in log, log[-3000:]
    assert str(shard) in log and "Traceback" not in log
    # The resumed run trained step 2 again and saved step 3 over the damaged copy.
    assert damaged_files(str(newest)) == []
    records = resumed.metrics()
    assert [record["step"] for record in records] == [0, 1, 2]
    for reference, actual in zip(gspo_run.metrics(), records):
        assert_records_equal(reference, actual)

    kept = sorted(root.glob("step_*"))  # steps 2 and 3 (saved again by the resumed run)
    assert [path.name for path in kept] == ["step_000002", "step_000003"]
    (kept[0] / "common.pt").write_bytes(b"PK\x03\x04")
    (kept[1] / "metadata.json").write_text('{"sharded_backend": ')
    with pytest.raises(CheckpointError, match="every complete checkpoint .* is damaged"):
        resumable_checkpoint(str(root))
