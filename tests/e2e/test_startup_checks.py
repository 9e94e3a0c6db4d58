"""What the trainer checks before it builds anything, seen from the command line."""

from __future__ import annotations

from .harness import TINY, start, train_command


def test_fresh_run_into_a_finished_run_is_refused(gspo_run):
    output_dir = gspo_run.output_dir
    metrics_before = (output_dir / "metrics.jsonl").read_bytes()
    command = train_command(["steps=1", *TINY, f"output_dir={output_dir}"])
    refused = start(command, output_dir, log_name="refused.log")
    assert refused.wait(timeout=120) == 2, refused.log[-3000:]
    log = refused.log
    assert "config error at 'output_dir'" in log and "resume=true" in log, log[-3000:]
    assert "Traceback" not in log
    assert (output_dir / "metrics.jsonl").read_bytes() == metrics_before
