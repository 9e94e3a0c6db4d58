"""What a run prints (megatron_gspo/runtime/console.py): our messages only at INFO, each config warning
once, the outputs at start, the progress bar counting RL steps only, a summary at the end."""

from __future__ import annotations

from .harness import run_train


def test_console_of_a_run(tmp_path):
    overrides = [
        "steps=2",
        "sft_warmup_steps=2",
        "algo.rollout_batch_size=2",
        "algo.num_return_sequences_in_group=4",
        "algo.num_mini_batches=2",
        "algo.response_length=8",
        "checkpoint.interval=2",
        "algo.clip_low=0.2",  # a GSPO configuration that warns
        "algo.clip_high=0.2",
    ]
    output_dir = tmp_path / "out"
    log = run_train(output_dir, overrides, timeout=240).log
    assert log.count("config warning at 'algo.clip_low/clip_high'") == 1, log[:3000]
    for noise in ("Params for bucket", "Transformer Engine and Apex", "Apex is not installed",
                  "full scope is deprecated", "megatron.core"):  # fmt: skip
        assert noise not in log, f"{noise!r} at INFO:\n{log[:3000]}"
    assert f"outputs: metrics {output_dir / 'metrics.jsonl'}" in log
    assert f"checkpoints {output_dir / 'checkpoints'} (every 2 steps" in log
    # The warm-up ends before the progress bar starts, so its time is not "step 1".
    assert log.index("SFT warm-up: 2 steps") < log.index("rl:"), log[-3000:]
    summary = log[log.index("finished steps 0-1 of 2") :]
    assert "reward_mean" in summary and str(output_dir / "metrics.jsonl") in summary
    assert str(output_dir / "checkpoints" / "step_000002") in summary


def test_debug_keeps_megatron_messages():
    """At DEBUG Megatron's INFO messages and kernel-library notices are shown again."""
    import logging
    import warnings

    from megatron_gspo.runtime.console import configure_logging

    root, megatron = logging.getLogger(), logging.getLogger("megatron")
    levels = root.level, megatron.level
    try:
        with warnings.catch_warnings(record=True) as caught:
            configure_logging(0, "INFO")
            warnings.warn(
                "Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1
            )
            assert not megatron.isEnabledFor(logging.INFO) and caught == []
            configure_logging(0, "DEBUG")
            warnings.warn(
                "Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1
            )
            assert megatron.isEnabledFor(logging.INFO) and len(caught) == 1
    finally:
        root.setLevel(levels[0])
        megatron.setLevel(levels[1])
