"""Start-up checks on real files and folders (megatron_gspo/preflight.py)."""

from __future__ import annotations

import pytest

from megatron_gspo.config import TrainConfig
from megatron_gspo.preflight import StartupErrors, check_before_start, prepare_output_dir


def previous_run(output_dir) -> None:
    """What a finished run leaves behind: metrics, TensorBoard events, a checkpoint."""
    (output_dir / "checkpoints" / "step_000002").mkdir(parents=True)
    (output_dir / "checkpoints" / "latest").write_text("step_000002\n")
    (output_dir / "tensorboard").mkdir()
    (output_dir / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')


def test_fresh_run_into_a_used_output_dir_is_refused(tmp_path):
    previous_run(tmp_path)
    with pytest.raises(StartupErrors) as error:
        check_before_start(TrainConfig(output_dir=str(tmp_path)))
    message = str(error.value)
    assert "config error at 'output_dir'" in message and "metrics.jsonl" in message
    assert "resume=true" in message and "overwrite_output_dir=true" in message
    assert (tmp_path / "metrics.jsonl").read_text().startswith('{"step": 0')


def test_resume_and_empty_folders_are_accepted(tmp_path):
    check_before_start(TrainConfig(output_dir=str(tmp_path / "new")))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)  # created, nothing saved yet
    check_before_start(TrainConfig(output_dir=str(tmp_path / "empty")))
    previous_run(tmp_path)
    check_before_start(TrainConfig(output_dir=str(tmp_path), resume=True))


def test_overwrite_deletes_the_previous_run(tmp_path):
    previous_run(tmp_path)
    (tmp_path / "notes.txt").write_text("the user's own file")
    config = TrainConfig(output_dir=str(tmp_path), overwrite_output_dir=True)
    check_before_start(config)
    prepare_output_dir(config)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt"]


def test_resume_never_deletes(tmp_path):
    previous_run(tmp_path)
    prepare_output_dir(
        TrainConfig(output_dir=str(tmp_path), resume=True, overwrite_output_dir=True)
    )
    assert (tmp_path / "checkpoints" / "step_000002").is_dir()
