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
    from megatron_gspo.config_loader import load_config

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
            f"rollout.sglang_urls=[http://127.0.0.1:{closed_port()}]",
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
        "rollout.sglang_urls",
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
        config.rollout.sglang_urls = [
            f"http://127.0.0.1:{healthy.server_port}",
            f"http://127.0.0.1:{refusing.server_port}/",  # it answers: the key is checked later
        ]
        check_before_start(config)
    finally:
        healthy.shutdown()
        refusing.shutdown()


def test_vocab_too_small_for_the_tokenizer(tmp_path):
    from megatron_gspo.config import ModelConfig

    config = TrainConfig(output_dir=str(tmp_path), model=ModelConfig(vocab_size=12))
    with pytest.raises(StartupErrors) as caught:
        check_before_start(config)
    assert [error.key for error in caught.value.errors] == ["model.vocab_size"]


def test_launching_sglang_needs_a_model_directory_and_sglang(tmp_path):
    import importlib.util

    config = TrainConfig(output_dir=str(tmp_path))
    config.rollout.engine, config.rollout.sglang_launch = "sglang", True
    with pytest.raises(StartupErrors) as caught:
        check_before_start(config)
    keys = [error.key for error in caught.value.errors]
    expected = ["model.hf_path"]
    if importlib.util.find_spec("sglang") is None:
        expected.append("rollout.sglang_launch")
    assert keys == expected


def test_sglang_python_must_have_sglang(tmp_path):
    """rollout.sglang_python: a missing interpreter and one without sglang are refused at start
    (the test's own interpreter has no sglang: the project's environment never installs it)."""
    import sys

    config = TrainConfig(output_dir=str(tmp_path))
    config.rollout.engine, config.rollout.sglang_launch = "sglang", True
    config.model.hf_path = str(tmp_path)
    for python, problem in (
        (str(tmp_path / "bin" / "python"), "no executable file there"),
        (sys.executable, "sglang is not installed in its environment"),
    ):
        config.rollout.sglang_python = python
        with pytest.raises(StartupErrors) as caught:
            check_before_start(config)
        [error] = [e for e in caught.value.errors if e.key == "rollout.sglang_python"]
        assert problem in str(error)
