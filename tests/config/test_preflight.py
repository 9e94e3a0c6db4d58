"""Start-up checks on real files and folders (megatron_gspo/startup/preflight.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import TrainConfig
from megatron_gspo.config.schema import StartupErrors
from megatron_gspo.samples import TrainSample
from megatron_gspo.samples.recorded_batch import RecordedBatch, write_recorded_batch
from megatron_gspo.startup.preflight import check_before_start, prepare_output_dir


def previous_run(output_dir, *, checkpoint: bool = True) -> None:
    """What a finished run leaves behind: metrics, TensorBoard events and, unless
    ``checkpoint=False`` (the CPU demo saves none), a complete checkpoint (its marker file)."""
    if checkpoint:
        (output_dir / "checkpoints" / "step_000002").mkdir(parents=True)
        (output_dir / "checkpoints" / "step_000002" / "checkpoint.json").write_text("{}")
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


def test_resume_without_a_checkpoint_is_refused_and_loses_nothing(tmp_path):
    """Following the refusal's advice (resume=true) on a run that saved no checkpoint would
    start afresh and truncate its metrics: refused, and the fix offered is not resume."""
    previous_run(tmp_path, checkpoint=False)
    with pytest.raises(StartupErrors) as error:
        check_before_start(TrainConfig(output_dir=str(tmp_path), resume=True))
    message = str(error.value)
    assert "config error at 'resume'" in message and "no complete checkpoint" in message
    assert "metrics.jsonl with 1 row" in message and "another output_dir" in message
    assert (tmp_path / "metrics.jsonl").read_text().startswith('{"step": 0')
    # A run that saves checkpoints but stopped before its first restarts; its records are kept.
    config = TrainConfig(output_dir=str(tmp_path), resume=True)
    config.checkpoint.interval = 5
    (tmp_path / "trained_prompts.jsonl").write_text('{"step": 0}\n')
    check_before_start(config)
    prepare_output_dir(config)
    kept = tmp_path / "before_resume_0"
    assert sorted(path.name for path in kept.iterdir()) == [
        "metrics.jsonl",
        "tensorboard",
        "trained_prompts.jsonl",
    ]
    assert (kept / "metrics.jsonl").read_text().startswith('{"step": 0')
    assert not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "reward_mean": 0.5}\n')
    # A fresh run there is refused too, without suggesting resume=true.
    with pytest.raises(StartupErrors) as error:
        check_before_start(TrainConfig(output_dir=str(tmp_path)))
    fixes = str(error.value).split("fix:")[-1]
    assert "overwrite_output_dir=true" in fixes and "resume=true cannot continue it" in fixes


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


def loopback_server(status: int = 200):
    """A real HTTP server on 127.0.0.1 that answers every GET with ``status``."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the socket is closed


def test_every_problem_is_reported_at_once(tmp_path):
    from megatron_gspo.config.loader import load_config

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "ok"}\n{"prompt": "ok"\n{"text": "no prompt"}\n')
    config = load_config(
        None,
        [
            f"output_dir={tmp_path / 'out'}",
            f"data.train_path={data}",
            f"data.tokenizer_path={tmp_path / 'no_tokenizer'}",
            "reward.functions=[my_missing_package.rewards:score]",
            "env.name=my_missing_package.envs:Episode",
            "rollout.engine=sglang",
            f"rollout.sglang.urls=[http://127.0.0.1:{closed_port()}]",
            f"checkpoint.load_path={tmp_path / 'no_checkpoint'}",
        ],
    )
    with pytest.raises(StartupErrors) as caught:
        check_before_start(config)
    errors = caught.value.errors
    assert [error.key for error in errors] == [
        "checkpoint.load_path",
        "data.train_path",
        "data.tokenizer_path",
        "reward.functions['my_missing_package.rewards:score']",
        "env.name",
        "rollout.sglang.urls",
    ]
    message = str(caught.value)
    assert message.startswith("6 problems found before start")
    assert f"{data}:2: invalid JSON" in message and f"{data}:3: no prompt" in message
    assert "my_missing_package" in message and "does not answer" in message


def test_servers_that_answer_and_a_synthetic_vocab_that_fits(tmp_path):
    healthy, refusing = loopback_server(200), loopback_server(401)
    try:
        config = TrainConfig(output_dir=str(tmp_path))
        config.rollout.engine = "sglang"
        config.rollout.sglang.urls = [
            f"http://127.0.0.1:{healthy.server_port}",
            f"http://127.0.0.1:{refusing.server_port}/",  # it answers: the key is checked later
        ]
        check_before_start(config)
    finally:
        healthy.shutdown()
        refusing.shutdown()


def test_a_url_that_answers_404_is_not_an_sglang_server(tmp_path):
    """Any web server at the address answered before; only SGLang's answers pass now, and a
    page of HTML is named, not dumped."""
    from megatron_gspo.rollout.sglang_client import _excerpt

    missing = loopback_server(404)
    try:
        config = TrainConfig(output_dir=str(tmp_path))
        config.rollout.engine = "sglang"
        config.rollout.sglang.urls = [f"http://127.0.0.1:{missing.server_port}"]
        with pytest.raises(StartupErrors) as caught:
            check_before_start(config)
    finally:
        missing.shutdown()
    [error] = caught.value.errors
    assert error.key == "rollout.sglang.urls" and "answers HTTP 404" in str(error)
    page = "<!DOCTYPE html>\n<html><head><title>404 Not\n Found</title></head><body>" + "x" * 5000
    assert _excerpt(page) == (
        "an HTML page titled '404 Not Found', not SGLang's answer: is the URL an SGLang server's?"
    )


def test_vocab_too_small_for_the_tokenizer(tmp_path):
    from megatron_gspo.config import ModelConfig

    config = TrainConfig(output_dir=str(tmp_path), model=ModelConfig(vocab_size=12))
    with pytest.raises(StartupErrors) as caught:
        check_before_start(config)
    assert [error.key for error in caught.value.errors] == ["model.vocab_size"]


def test_launching_sglang_needs_a_model_directory_and_sglang(tmp_path):
    import importlib.util

    config = TrainConfig(output_dir=str(tmp_path))
    config.rollout.engine, config.rollout.sglang.launch = "sglang", True
    with pytest.raises(StartupErrors) as caught:
        check_before_start(config)
    keys = [error.key for error in caught.value.errors]
    expected = ["model.hf_path"]
    if importlib.util.find_spec("sglang") is None:
        expected.append("rollout.sglang.launch")
    assert keys == expected


def test_sglang_python_must_have_sglang(tmp_path):
    """rollout.sglang.python: a missing interpreter and one without sglang are refused at start
    (the test's own interpreter has no sglang: the project's environment never installs it)."""
    import sys

    config = TrainConfig(output_dir=str(tmp_path))
    config.rollout.engine, config.rollout.sglang.launch = "sglang", True
    config.model.hf_path = str(tmp_path)
    for python, problem in (
        (str(tmp_path / "bin" / "python"), "no executable file there"),
        (sys.executable, "sglang is not installed in its environment"),
    ):
        config.rollout.sglang.python = python
        with pytest.raises(StartupErrors) as caught:
            check_before_start(config)
        [error] = [e for e in caught.value.errors if e.key == "rollout.sglang.python"]
        assert problem in str(error)


def test_overrides_stand_on_both_sides_of_the_preset():
    """``python -m megatron_gspo.train a=1 --preset cpu_demo b=2`` as Hydra users write it."""
    from megatron_gspo.train import parse_args

    args = parse_args(["algo.lr=1", "--preset", "cpu_demo", "steps=2", "--cfg"])
    assert args.preset == "cpu_demo" and args.cfg
    assert args.overrides == ["algo.lr=1", "steps=2"]


def test_a_read_only_output_dir_is_found_before_start(tmp_path):
    """Found by writing, as the run would (root ignores permission bits): a read-only tmpfs
    mounted in a mount namespace of its own as root, a folder without write permission
    otherwise."""
    import os
    import subprocess
    import sys

    folder = tmp_path / "outputs"
    folder.mkdir()
    probe = (
        "import sys\n"
        "from megatron_gspo.config import TrainConfig\n"
        "from megatron_gspo.config.schema import StartupErrors\n"
        "from megatron_gspo.startup.preflight import check_before_start\n"
        "try:\n"
        f"    check_before_start(TrainConfig(output_dir={str(folder / 'run')!r}))\n"
        "except StartupErrors as error:\n"
        "    print(error)\n"
        "    sys.exit(3)\n"
    )
    python = f"{sys.executable} -c {__import__('shlex').quote(probe)}"
    if os.geteuid() == 0:
        command = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {folder} && {python}"]
    else:
        folder.chmod(0o555)
        command = ["sh", "-c", python]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "config error at 'output_dir'" in result.stdout
    assert (
        "cannot write to" in result.stdout
        and "Read-only file system" in result.stdout
        or (os.geteuid() != 0 and "Permission denied" in result.stdout)
    )


def test_a_damaged_hf_directory_is_named_before_start(tmp_path):
    """A truncated shard and a shard the index names but the folder lacks: each named with its
    file at start, and by the reader that would load it (instead of a raw traceback)."""
    import os

    from megatron_gspo.convert.safetensors_io import ConversionError, HFCheckpointReader
    from tests.convert.tiny_models import build_hf_model

    model = build_hf_model("qwen3_moe")
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    weights = single / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    shards[-1].unlink()
    for folder, problem in (
        (single, f"{weights} is truncated"),
        (sharded, f"{shards[-1]} is missing"),
    ):
        config = TrainConfig(output_dir=str(tmp_path / "run"))
        config.model.hf_path = str(folder)
        with pytest.raises(StartupErrors) as caught:
            check_before_start(config)
        errors = [str(error) for error in caught.value.errors if error.key == "model.hf_path"]
        assert len(errors) == 1 and problem in errors[0], caught.value
        with pytest.raises(ConversionError, match="damaged model directory"):
            HFCheckpointReader(str(folder))


def test_a_replay_without_its_recorded_batches_is_refused_at_once(tmp_path):
    """Every problem of a replay at once: the steps without a file (named), evaluation (which
    needs an engine), and an output_dir that holds the batches it replays."""
    rollouts = tmp_path / "rollouts"
    sample = TrainSample(tokens=torch.tensor([1, 2, 3]), prompt_length=1)
    write_recorded_batch(rollouts, RecordedBatch(0, [sample], [0]))
    write_recorded_batch(rollouts, RecordedBatch(2, [sample], [1]))
    (rollouts / "step_000002.safetensors").write_bytes(b"cut")
    config = TrainConfig(output_dir=str(tmp_path), steps=4)
    config.rollout.replay_dir = str(tmp_path)
    config.eval.interval = 2
    with pytest.raises(StartupErrors) as error:
        check_before_start(config)
    message = str(error.value)
    assert "'rollout.replay_dir': 3 of the 4 steps have no usable recorded batch" in message
    assert "step_000001.safetensors is missing" in message
    assert "step_000002.safetensors is damaged" in message
    assert "'eval.interval'" in message and "holds the batches that rollout.replay_dir" in message
    # Recorded for every step, replayed into a folder of its own: accepted.
    for step in (1, 2, 3):
        write_recorded_batch(rollouts, RecordedBatch(step, [sample], [step]))
    config = TrainConfig(output_dir=str(tmp_path / "replay"), steps=4)
    config.rollout.replay_dir = str(tmp_path)
    check_before_start(config)
    # The recording's folder counts as a previous run's output.
    with pytest.raises(StartupErrors, match="rollouts"):
        check_before_start(TrainConfig(output_dir=str(tmp_path)))
