"""What reads a run's checkpoints without importing Megatron (the Ctrl-C resume hint, the summary
at the end, the checkpoint converter): all read the checkpoint folder through
``megatron_gspo/runtime/checkpoint_files.py``, the one place that knows its layout."""

from __future__ import annotations

import json

from megatron_gspo.config import TrainConfig
from megatron_gspo.convert.export import resolve_checkpoint_dir
from megatron_gspo.runtime.checkpoint_files import (
    FORMAT,
    MARKER,
    checkpoint_root,
    latest_checkpoint,
)
from megatron_gspo.runtime.console import summarize
from megatron_gspo.train import interrupted_message, parse_args


def saved_run(output_dir) -> str:
    """Steps 1 and 2 complete, ``latest`` rewound to step 1 by hand, step 3 interrupted (no
    marker); returns the checkpoint ``latest`` names."""
    root = output_dir / "checkpoints"
    for step in (1, 2):
        (root / f"step_{step:06d}").mkdir(parents=True)
        (root / f"step_{step:06d}" / MARKER).write_text(json.dumps({"format": FORMAT}))
    (root / "step_000003").mkdir()
    (root / "latest").write_text("step_000001\n")
    return str(root / "step_000001")


def test_resume_hint_and_summary_name_the_checkpoint_latest_names(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path), steps=4)
    args = parse_args(["--preset", "cpu_demo", "steps=4", "resume=false"])
    before = interrupted_message(config, args)
    assert "cannot be resumed" in before and "checkpoint.interval" in before

    latest = saved_run(tmp_path)
    assert latest_checkpoint(checkpoint_root(config.output_dir)) == latest
    message = interrupted_message(config, args)
    assert f"the latest checkpoint is {latest}." in message
    assert "python -m megatron_gspo.train --preset cpu_demo steps=4 resume=true" in message
    summary = summarize([{"step": 0, "reward_mean": 0.25}], config, seconds=3.0)
    assert f"checkpoints: {latest} (latest)" in summary


def test_converter_takes_the_checkpoint_latest_names(tmp_path):
    latest = saved_run(tmp_path)
    root = str(tmp_path / "checkpoints")
    assert resolve_checkpoint_dir(root) == latest  # not step_000002, the highest
    (tmp_path / "checkpoints" / "latest").unlink()
    assert resolve_checkpoint_dir(root) == str(tmp_path / "checkpoints" / "step_000002")
    torch_dist = tmp_path / "hf_to_megatron"
    torch_dist.mkdir()
    (torch_dist / ".metadata").write_bytes(b"")
    assert resolve_checkpoint_dir(str(torch_dist)) == str(torch_dist)


def test_resumed_metrics_drop_the_steps_trained_again(tmp_path):
    """A run killed after step 2's metrics line (and mid-way through step 3's) but resumed from
    the checkpoint of step 2: metrics.jsonl and TensorBoard hold each step once, the later
    steps from the resumed run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_gspo.config import LoggingConfig
    from megatron_gspo.metrics.sinks import MetricsLogger, read_metrics

    settings = LoggingConfig(tensorboard=True, progress_bar=False)
    killed = MetricsLogger(str(tmp_path), settings, total_steps=4)
    for step in range(3):
        killed.log(step, {"reward_mean": float(step)})
    killed.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 3, "reward_')  # cut short by the kill
    resumed = MetricsLogger(str(tmp_path), settings, total_steps=4, start_step=2)
    for step in (2, 3):
        resumed.log(step, {"reward_mean": 10.0 + step})
    resumed.close()
    records = read_metrics(str(tmp_path))
    assert [(r["step"], r["reward_mean"]) for r in records] == [(0, 0), (1, 1), (2, 12), (3, 13)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    assert scalars == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]
