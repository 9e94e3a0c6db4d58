"""What the trainer checks before it builds anything, seen from the command line."""

from __future__ import annotations

import pytest

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


def test_all_problems_reported_before_the_model_is_built(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "ok", "answer": "1"}\n{"prompt": ""}\n')
    overrides = [
        f"data.train_path={data}",
        f"data.tokenizer_path={tmp_path / 'missing_tokenizer'}",
        "reward.functions=[no_such_module:score]",
        f"output_dir={tmp_path / 'out'}",
    ]
    launch = start(train_command(overrides), tmp_path / "out")
    assert launch.wait(timeout=120) == 2, launch.log[-3000:]
    log = launch.log
    assert "3 problems found before start" in log, log[-3000:]
    assert f"{data}:2: the prompt 'prompt' is empty" in log
    assert "missing_tokenizer" in log and "no_such_module" in log
    assert "parallel layout" not in log  # megatron_gspo.engine.parallel: the model was not built
    assert "Traceback" not in log


def test_ctrl_c_prints_how_to_resume(tmp_path):
    import signal

    from .harness import wait_for_step

    output_dir = tmp_path / "out"
    overrides = ["steps=50", *TINY, "checkpoint.interval=1", f"output_dir={output_dir}"]
    launch = start(train_command(overrides), output_dir)
    try:
        wait_for_step([launch], output_dir, 1, timeout=240)  # after step 0's checkpoint
        launch.process.send_signal(signal.SIGINT)
        assert launch.wait(timeout=60) == 130, launch.log[-3000:]
    finally:
        launch.kill()
    log = launch.log
    assert "Resume with:" in log and "resume=true" in log, log[-3000:]
    assert f"output_dir={output_dir}" in log.split("Resume with:")[1]
    assert "Traceback" not in log


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one
def test_ctrl_c_dropped_inside_a_finalizer_is_raised_at_the_next_check():
    """Python drops a KeyboardInterrupt raised inside ``__del__`` ("Exception ignored"); the
    run then went on to its end. The handler remembers it for the loop's next step."""
    import gc
    import os
    import signal

    from megatron_gspo.runtime import health

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while a finalizer runs
            sum(range(1000))  # the handler runs at the next bytecode, inside __del__

    previous = signal.getsignal(signal.SIGINT)
    try:
        health.catch_interrupts()
        health.raise_if_interrupted()  # nothing pressed yet
        Finalized()
        gc.collect()
        with pytest.raises(KeyboardInterrupt):
            health.raise_if_interrupted()
    finally:
        signal.signal(signal.SIGINT, previous)
        health._interrupted = False


def test_ctrl_c_during_a_checkpoint_save_waits_for_its_end():
    """Inside ``interrupts_deferred`` (the checkpoint save) Ctrl-C is recorded, the block runs to
    its end, and KeyboardInterrupt comes when it ends; outside it Ctrl-C raises at once again."""
    import os
    import signal

    from megatron_gspo.runtime import health

    previous = signal.getsignal(signal.SIGINT)
    finished = False
    try:
        health.catch_interrupts()
        with pytest.raises(KeyboardInterrupt), health.interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))  # the handler runs here: it must not raise
            finished = True
        assert finished
        with pytest.raises(KeyboardInterrupt):
            health._interrupted = False
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(1000))
    finally:
        signal.signal(signal.SIGINT, previous)
        health._interrupted = False
