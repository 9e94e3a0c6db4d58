"""The code sandbox, run for real: limits, time-outs, network, files, and the code reward on top."""

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from megatron_gspo.reward import RewardInput, SandboxLimits, run_python
from megatron_gspo.reward.code_execution import code_reward, extract_code
from megatron_gspo.reward.sandbox import namespace_command

FAST = SandboxLimits(wall_time_s=5.0, cpu_time_s=2, memory_mb=512)


class LoopbackServer:
    """A TCP server on 127.0.0.1 that records whether anyone connected."""

    def __init__(self):
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen()
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                connection, _ = self.socket.accept()
            except OSError:
                continue
            self.connections += 1
            connection.close()

    def close(self):
        self._stop.set()
        self._thread.join()
        self.socket.close()


@pytest.fixture
def server():
    server = LoopbackServer()
    yield server
    server.close()


def test_correct_program_passes_and_wrong_one_fails():
    solution = "def add(a, b):\n    return a + b\n"
    assert run_python(solution + "assert add(2, 3) == 5\nprint('ok')", limits=FAST).passed
    wrong = run_python("def add(a, b):\n    return a - b\nassert add(2, 3) == 5", limits=FAST)
    assert not wrong.passed
    assert wrong.returncode == 1 and "AssertionError" in wrong.stderr


def test_stdin_and_stdout():
    result = run_python("print(input()[::-1])", stdin="abc\n", limits=FAST)
    assert result.passed and result.stdout == "cba\n"


def test_infinite_loop_is_killed_by_the_wall_clock():
    result = run_python("while True:\n    pass", limits=SandboxLimits(wall_time_s=1.0))
    assert result.timed_out and not result.passed and result.wall_s < 5.0


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    limits = SandboxLimits(wall_time_s=60.0, cpu_time_s=1)
    result = run_python("while True:\n    pass", limits=limits)
    assert not result.passed and not result.timed_out and result.cpu_time_exceeded


def test_sleeping_program_is_killed_by_the_wall_clock():
    limits = SandboxLimits(wall_time_s=1.0, cpu_time_s=10)
    result = run_python("import time\ntime.sleep(60)", limits=limits)
    assert result.timed_out and result.returncode is None and not result.passed
    assert 1.0 <= result.wall_s < 5.0


def test_memory_hog_is_stopped():
    result = run_python("hog = bytearray(4 * 1024**3)\nprint('allocated')", limits=FAST)
    assert not result.passed and result.memory_exceeded and "allocated" not in result.stdout


@pytest.mark.parametrize("isolation", ["auto", "python"])
def test_network_is_blocked(server, isolation):
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.port}), timeout=2)"
    limits = SandboxLimits(wall_time_s=5.0, network_isolation=isolation)
    result = run_python(code, limits=limits)
    assert not result.passed and "PermissionError" in result.stderr
    assert server.connections == 0
    expected = "namespace" if isolation == "auto" and namespace_command() else "python"
    assert result.network_isolation == expected
    # The server does accept connections from outside the sandbox.
    socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_network_namespace_blocks_without_the_python_guard(server):
    prefix = namespace_command()
    if prefix is None:
        pytest.skip("no network namespace here (needs root or user namespaces)")
    code = f"import socket; socket.create_connection(('127.0.0.1', {server.port}), timeout=2)"
    outside = subprocess.run([sys.executable, "-c", code], capture_output=True)
    inside = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True)
    assert outside.returncode == 0
    assert inside.returncode != 0 and b"OSError" in inside.stderr
    assert server.connections == 1


def test_files_stay_in_the_work_dir_which_is_removed(tmp_path):
    outside = tmp_path / "escaped.txt"
    code = (
        "import os\n"
        "open('result.txt', 'w').write('inside')\n"
        "os.makedirs('sub/dir')\n"
        "print(os.path.abspath('result.txt'))\n"
        "print(os.getcwd())\n"
        f"open({str(outside)!r}, 'w').write('outside')\n"
    )
    result = run_python(code, limits=FAST)
    written, cwd = result.stdout.split()
    assert Path(written).parent == Path(cwd) == Path(result.workdir)
    assert "PermissionError" in result.stderr and not outside.exists()
    assert not Path(result.workdir).exists() and not Path(result.workdir).parent.exists()


@pytest.mark.parametrize(
    "code, refused",
    [
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import os\nos.system('true')", "os.system"),
        ("import os\nos.fork()", "os.fork"),
        ("import os\nos.kill(os.getppid(), 9)", "os.kill"),
        ("import ctypes", "importing ctypes"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "setrlimit"),
        ("import os\nos.remove('/etc/hostname')", "os.remove"),
    ],
)
def test_guard_refuses_escapes(code, refused):
    result = run_python(code, limits=FAST)
    assert not result.passed and refused in result.stderr


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    result = run_python("import os\nprint(sorted(os.environ))", limits=FAST)
    assert "SECRET_TOKEN" not in result.stdout and "hunter2" not in result.stdout


def test_output_is_capped():
    limits = SandboxLimits(max_output_bytes=1000)
    result = run_python("print('x' * 100000)", limits=limits)
    assert result.passed and result.output_truncated and len(result.stdout) == 1000


def test_namespace_required_but_missing_is_an_error(monkeypatch):
    from megatron_gspo.reward import sandbox

    monkeypatch.setattr(sandbox, "namespace_command", lambda: None)
    with pytest.raises(RuntimeError, match="network namespace"):
        run_python("pass", limits=SandboxLimits(network_isolation="namespace"))


# ---------------------------------------------------------------------------------------------
# The code reward


def code_sample(response: str, tests) -> RewardInput:
    return RewardInput(prompt="write add", response=response, metadata={"tests": tests})


GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
BAD = "```python\ndef add(a, b):\n    return a * b\n```"


def test_code_reward_with_test_code_and_test_lists():
    assert code_reward(code_sample(GOOD, "assert add(2, 3) == 5\nassert add(0, 0) == 0")) == 1.0
    assert code_reward(code_sample(BAD, "assert add(2, 3) == 5")) == 0.0
    assert code_reward(code_sample(GOOD, ["assert add(1, 1) == 2", "assert add(2, 2) == 4"])) == 1.0
    assert code_reward(code_sample(BAD, ["assert add(2, 2) == 4", "assert add(1, 1) == 2"])) == 0.0


def test_code_reward_with_io_cases_scores_the_fraction_passed():
    program = "```python\nn = int(input())\nprint(n * 2 if n < 10 else n)\n```"
    cases = [
        {"input": "1\n", "output": "2"},
        {"input": "4\n", "output": "8\n"},
        {"input": "20\n", "output": "40"},
    ]
    assert code_reward(code_sample(program, cases)) == pytest.approx(2 / 3)


def test_code_reward_time_limit_and_bad_tests():
    looping = "```python\nwhile True:\n    pass\n```"
    assert code_reward(code_sample(looping, "pass"), timeout_s=1.0) == 0.0
    with pytest.raises(ValueError, match="needs tests"):
        code_reward(RewardInput(prompt="", response=GOOD))
    with pytest.raises(ValueError, match="must be test code"):
        code_reward(code_sample(GOOD, {"unexpected": 1}))


def test_extract_code_prefers_the_last_python_block():
    response = "```bash\nls\n```\n```python\nfirst()\n```\ntext\n```py\nsecond()\n```"
    assert extract_code(response) == "second()\n"
    assert extract_code("```\nonly()\n```") == "only()\n"
    assert extract_code("print(1)") == "print(1)"


def test_sandbox_runs_from_a_process_with_threads():
    # The trainer has threads (gloo, data loaders); starting the sandbox must not need fork-safety
    # of preexec_fn. Run several sandboxes concurrently from threads.
    results = [None] * 4

    def run(index):
        results[index] = run_python(f"print({index})", limits=FAST)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [result.stdout.strip() for result in results] == ["0", "1", "2", "3"]
    assert all(not Path(result.workdir).exists() for result in results)


def test_code_reward_through_the_runner():
    from megatron_gspo.config import RewardConfig
    from megatron_gspo.reward import RewardRunner

    tests = ["assert add(2, 3) == 5"]
    samples = [code_sample(GOOD, tests), code_sample(BAD, tests), code_sample("no code", tests)]
    with RewardRunner(RewardConfig(functions=["code"], num_workers=2)) as runner:
        result = runner.score(samples)
    assert result.rewards == [1.0, 0.0, 0.0]
    assert result.metrics["reward_code_mean"] == pytest.approx(1 / 3)
