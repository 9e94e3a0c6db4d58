"""A checkpoint save that fills the disk stops the run with what, why and the fix (no Megatron
traceback), and the run's metrics survive. The disk is a real tmpfs of 512 KiB mounted over the
checkpoint folder in a mount namespace of the run's own (as root, as CI runs)."""

from __future__ import annotations

import os
import shlex

import pytest

from .harness import TINY, start, train_command


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (CI runs as root)")
def test_a_full_disk_during_a_save_stops_with_the_fix(tmp_path):
    output_dir = tmp_path / "out"
    checkpoints = output_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    train = train_command(["steps=2", *TINY, "checkpoint.interval=1", f"output_dir={output_dir}"])
    script = f"mount -t tmpfs -o size=512k tmpfs {checkpoints} && exec {shlex.join(train)}"
    launch = start(["unshare", "-m", "sh", "-c", script], output_dir)
    returncode = launch.wait(300)
    log = launch.log
    assert returncode == 1, log[-4000:]
    assert "checkpoint error: the checkpoint of step 1 could not be written" in log, log[-4000:]
    assert "No space left on device" in log and "resume=true" in log
    assert "Traceback" not in log, log[-4000:]
    assert len(launch.metrics()) == 1  # step 0's line precedes its checkpoint and is kept
