"""RewardRunner: weighted sums, and failures/time-outs counted, logged and scored failure_reward,
in real worker processes and threads."""

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_gspo.config import ConfigError, RewardConfig
from megatron_gspo.data import build_synthetic_tokenizer
from megatron_gspo.reward import RewardInput, RewardRunner

USER_MODULE = f"{__name__.rpartition('.')[0]}.user_rewards".lstrip(".")


def user(function: str) -> str:
    return f"{USER_MODULE}:{function}"


def sample(response: str = "", **metadata) -> RewardInput:
    return RewardInput(prompt="p", response=response, metadata=metadata)


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_weighted_sum_and_per_function_means(executor):
    tokenizer = build_synthetic_tokenizer()
    responses = ["4321<eos>", "4300<eos>", "<eos>", "12345"]
    samples = [
        RewardInput(
            prompt="1234<sep>",
            response=text,
            answer="4321",
            response_ids=tokenizer(text).input_ids,
        )
        for text in responses
    ]
    config = RewardConfig(
        functions=["synthetic", user("response_length")],
        weights=[2.0, 0.5],
        options={user("response_length"): {"scale": 0.1}},
        executor=executor,
    )
    with RewardRunner(config) as runner:
        result = runner.score(samples)
    synthetic = [1.0, (2 + 0.1 + 0.1) / 4, 0.0, 0.4 / 4]
    length = [0.1 * len(text) for text in responses]
    assert result.scores["synthetic"] == pytest.approx(synthetic)
    assert result.scores["user_rewards_response_length"] == pytest.approx(length)
    expected = [2.0 * s + 0.5 * n for s, n in zip(synthetic, length)]
    assert result.rewards == pytest.approx(expected)
    assert result.failures == []
    metrics = result.metrics
    assert metrics["reward_errors"] == 0 and metrics["reward_timeouts"] == 0
    assert metrics["reward_mean"] == pytest.approx(sum(expected) / 4)
    assert metrics["reward_min"] == pytest.approx(min(expected))
    assert metrics["reward_max"] == pytest.approx(max(expected))
    mean = sum(expected) / 4
    std = (sum((value - mean) ** 2 for value in expected) / 4) ** 0.5
    assert metrics["reward_std"] == pytest.approx(std)
    assert metrics["reward_synthetic_mean"] == pytest.approx(sum(synthetic) / 4)
    assert metrics["reward_seconds"] > 0


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_errors_are_counted_logged_and_scored_failure_reward(executor, caplog):
    config = RewardConfig(
        functions=[user("raise_if_asked"), user("bad_value_if_asked")],
        failure_reward=-1.0,
        executor=executor,
    )
    samples = [
        sample(),
        sample(**{"raise": True}),
        sample(value=float("nan")),
        sample(value="high"),
        sample(**{"raise": True}, value=None),
    ]
    with caplog.at_level(logging.WARNING), RewardRunner(config) as runner:
        result = runner.score(samples)
    raising, bad_value = config.functions
    assert result.scores["user_rewards_raise_if_asked"] == [0.5, -1.0, 0.5, 0.5, -1.0]
    assert result.scores["user_rewards_bad_value_if_asked"] == [0.25, 0.25, -1.0, -1.0, -1.0]
    assert result.rewards == pytest.approx([0.75, -0.75, -0.5, -0.5, -2.0])
    assert result.metrics["reward_errors"] == 5
    assert result.metrics["reward_timeouts"] == 0
    failed = {(failure.sample_index, failure.function) for failure in result.failures}
    assert failed == {(1, raising), (2, bad_value), (3, bad_value), (4, raising), (4, bad_value)}
    by_place = {(f.sample_index, f.function): f.message for f in result.failures}
    assert "RuntimeError: asked to fail" in by_place[(1, raising)]
    assert "user_rewards.py" in by_place[(1, raising)]  # where it was raised
    assert "returned nan" in by_place[(2, bad_value)]
    assert "returned 'high'" in by_place[(3, bad_value)]
    logged = [
        record.getMessage() for record in caplog.records if "failed on sample" in record.message
    ]
    assert len(logged) == 5
    assert any(raising in line and "sample 1 " in line for line in logged)


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_timeouts_are_counted_and_later_calls_still_run(executor, caplog):
    config = RewardConfig(
        functions=[user("sleep_if_asked")],
        timeout_s=0.5,
        failure_reward=-2.0,
        num_workers=2,
        executor=executor,
    )
    samples = [sample(), sample(sleep_s=30), sample(), sample(), sample(sleep_s=30), sample()]
    with caplog.at_level(logging.WARNING), RewardRunner(config) as runner:
        start = time.monotonic()
        result = runner.score(samples)
        elapsed = time.monotonic() - start
        assert result.rewards == [1.0, -2.0, 1.0, 1.0, -2.0, 1.0]
        assert result.metrics["reward_timeouts"] == 2
        assert result.metrics["reward_errors"] == 0
        assert {f.sample_index for f in result.failures if f.kind == "timeout"} == {1, 4}
        assert elapsed < 15  # the sleeping calls were not waited for
        # The replaced workers serve the next batch.
        again = runner.score([sample(), sample()])
        assert again.rewards == [1.0, 1.0]
        assert runner.pool.num_replaced == 2
    assert any("timed out on sample 4" in record.getMessage() for record in caplog.records)


def test_a_dying_worker_fails_only_its_call():
    config = RewardConfig(functions=[user("exit_if_asked")], num_workers=1, executor="process")
    with RewardRunner(config) as runner:
        result = runner.score([sample(), sample(exit=True), sample()])
        assert result.rewards == [0.75, 0.0, 0.75]
        assert result.metrics["reward_errors"] == 1
        assert "worker process died (exit status 3)" in result.failures[0].message


def test_unknown_function_fails_at_start_with_the_valid_names():
    with pytest.raises(ConfigError, match="(?s)unknown reward function 'mathh'.*exact_match"):
        RewardRunner(RewardConfig(functions=["synthetic", "mathh"]))


def test_duplicate_functions_rejected():
    with pytest.raises(ConfigError, match="more than once"):
        RewardRunner(RewardConfig(functions=["format", "format"], executor="thread"))


def test_empty_batch():
    with RewardRunner(RewardConfig(executor="thread")) as runner:
        result = runner.score([])
    assert result.rewards == [] and result.metrics["reward_errors"] == 0


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return not any(line.startswith("State:\tZ") for line in status)
    except FileNotFoundError:
        return False


def test_a_worker_killed_while_idle_is_replaced_without_a_failure():
    config = RewardConfig(functions=[user("raise_if_asked")], num_workers=1, executor="process")
    with RewardRunner(config) as runner:
        assert runner.score([sample()]).rewards == [0.5]
        os.kill(runner.pool._workers[0].process.pid, signal.SIGKILL)
        runner.pool._workers[0].process.wait()
        result = runner.score([sample(), sample()])
        assert result.rewards == [0.5, 0.5] and result.failures == []


def test_workers_exit_when_the_trainer_dies(tmp_path):
    # A trainer whose reward call hangs is killed; its workers must not live on.
    script = tmp_path / "trainer.py"
    script.write_text(
        "import sys\n"
        "from megatron_gspo.config import RewardConfig\n"
        "from megatron_gspo.reward import RewardInput, RewardRunner\n"
        f"runner = RewardRunner(RewardConfig(functions=[{user('sleep_if_asked')!r}], "
        "timeout_s=600))\n"
        "print(*[w.process.pid for w in runner.pool._workers], flush=True)\n"
        "runner.score([RewardInput('p', 'r', metadata={'sleep_s': 600})] * 2)\n"
    )
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    trainer = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=environment
    )
    worker_pids: list[int] = []
    try:
        worker_pids = [int(pid) for pid in trainer.stdout.readline().split()]
        assert len(worker_pids) == 2 and all(_alive(pid) for pid in worker_pids)
        time.sleep(0.5)  # both workers are inside the sleeping call now
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in worker_pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in worker_pids)
    finally:
        trainer.kill()
        for pid in worker_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_function_failing_everywhere_stops_after_max_failed_steps():
    """Raising (or returning NaN) on every sample, batch after batch, stops the run; a batch in
    which the function works on some sample starts the count again."""
    from megatron_gspo.reward.runner import RewardsFailedError

    failing = [sample(**{"raise": True}) for _ in range(4)]
    config = RewardConfig(functions=[user("raise_if_asked")], executor="thread", max_failed_steps=3)
    with RewardRunner(config) as runner:
        assert runner.score(failing).metrics["reward_functions_all_failed"] == 1.0
        runner.score([sample(**{"raise": False}), *failing[1:]])  # works once: count restarts
        assert runner.consecutive_failed_batches == 0
        runner.score(failing)
        runner.score(failing)
        with pytest.raises(RewardsFailedError) as stopped:
            runner.score(failing)
    message = str(stopped.value)
    assert message.startswith("run stopped: reward")
    assert "3 batches in a row" in message and "asked to fail" in message
    assert "reward.max_failed_steps" in message

    config = RewardConfig(
        functions=["synthetic", user("bad_value_if_asked")],
        executor="thread",
        max_failed_steps=1,
    )
    nan = [RewardInput(prompt="1<sep>", response="1", answer="1", metadata={"value": float("nan")})]
    with RewardRunner(config) as runner, pytest.raises(RewardsFailedError, match="returned nan"):
        runner.score(nan)


def test_max_failed_steps_zero_never_stops():
    config = RewardConfig(functions=[user("raise_if_asked")], executor="thread", max_failed_steps=0)
    with RewardRunner(config) as runner:
        for _ in range(5):
            result = runner.score([sample(**{"raise": True})])
    assert result.metrics["reward_functions_all_failed"] == 1.0
