"""The ``code`` reward's contract: the three test forms, what scores, and the start-up check.
Attacks on the sandbox itself: ``test_hostile_code.py``."""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, RewardConfig
from megatron_gspo.reward import RewardInput, RewardRunner
from megatron_gspo.reward.code_execution import check_code_reward, code_reward, extract_code

from .sandbox_support import isolated_or_fail_closed


def code_sample(response: str, tests) -> RewardInput:
    return RewardInput(prompt="write add", response=response, metadata={"tests": tests})


def score(response: str, tests, **options):
    """The code reward's score, or None after asserting that it fails closed (no isolation)."""
    return isolated_or_fail_closed(lambda: code_reward(code_sample(response, tests), **options))


GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
BAD = "```python\ndef add(a, b):\n    return a * b\n```"


def test_test_code_and_test_lists():
    cases = [
        (GOOD, "assert add(2, 3) == 5\nassert add(0, 0) == 0", 1.0),
        (BAD, "assert add(2, 3) == 5", 0.0),
        (GOOD, ["assert add(1, 1) == 2", "assert add(2, 2) == 4"], 1.0),
        (BAD, ["assert add(2, 2) == 4", "assert add(1, 1) == 2"], 0.0),
    ]
    for response, tests, expected in cases:
        assert score(response, tests) in (None, expected)


@pytest.mark.parametrize(
    "program",
    [
        "import sys\nsys.exit(0)",
        "raise SystemExit",
        "import os\nos._exit(0)",
        "import os, sys\nsys.stdout.flush()\nos.kill(os.getpid(), 9)",
        "import atexit, os\natexit.register(lambda: os._exit(0))\nimport sys\nsys.exit(0)",
        "import builtins\nbuiltins.AssertionError = KeyboardInterrupt",
        "import sys\nsys.excepthook = lambda *a: None\nsys.exit(0)",
        "import builtins\nbuiltins.exec = lambda *a, **k: None",
        "import builtins, os\nos.write, os._exit = (lambda *a: 0), (lambda *a: None)",
    ],
)
def test_exiting_early_scores_zero(program):
    """The tests never pass (``assert False``): no way of ending the program early scores."""
    assert score(f"```python\n{program}\n```", "assert False") in (None, 0.0)
    assert score(f"```python\n{program}\n```", ["assert False"]) in (None, 0.0)


def test_tests_see_builtins_as_they_were_before_the_program():
    program = "import builtins\nbuiltins.abs = lambda value: 0\n"
    assert score(program, "assert abs(-3) == 0") in (None, 0.0)
    assert score(program, "assert abs(-3) == 3") in (None, 1.0)


def test_the_program_cannot_read_the_tests_or_the_token_from_disk():
    program = "import os\nLEFT = sorted(os.listdir('.'))\ndef add(a, b):\n    return a + b\n"
    assert score(
        program, "assert LEFT == ['main.py', 'solution.py'], LEFT\nassert add(1, 2) == 3"
    ) in (
        None,
        1.0,
    )


def test_long_output_passes():
    """The token is looked for in the tail of stdout, which is kept when stdout is cut."""
    chatty = "def add(a, b):\n    return a + b\nprint('x' * 200000)\n"
    assert score(chatty, "assert add(1, 2) == 3") in (None, 1.0)


def test_stdin_stdout_cases_score_the_fraction_passed():
    program = "```python\nn = int(input())\nprint(n * 2 if n < 10 else n)\n```"
    cases = [
        {"input": "1\n", "output": "2"},
        {"input": "4\n", "output": "8\n"},
        {"input": "20\n", "output": "40"},
    ]
    assert score(program, cases) in (None, pytest.approx(2 / 3))
    columns = {"inputs": ["1\n", "4\n", "20\n"], "outputs": ["2", "8", "40"]}
    assert score(program, columns) in (None, pytest.approx(2 / 3))
    assert score("import sys\nsys.exit(0)", cases) in (None, 0.0)


def test_function_call_cases_are_judged_outside():
    tests = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [[1], [2]]], "outputs": [3, 4, [1, 2]]}
    assert score(GOOD, tests) in (None, 1.0)
    assert score(BAD, tests) in (None, pytest.approx(1 / 3))  # 2 * 2 == 2 + 2
    method = "class Solution:\n    def add(self, a, b):\n        return (a + b,)\n"
    assert score(method, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}) in (None, 1.0)
    # An object equal to everything, an early exit, a raising call, lines forged with a guessed
    # prefix: none of them is an answer.
    always_equal = (
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Anything(0)\n"
    )
    assert score(always_equal, tests) in (None, 0.0)
    assert score("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", tests) in (None, 0.0)
    raising = "def add(a, b):\n    if a == 1:\n        raise ValueError\n    return a + b\n"
    assert score(raising, tests) in (None, pytest.approx(2 / 3))
    forged = (
        "import sys\nfor i in range(3):\n    print(sys.argv[1], i, 3)\ndef add(a, b):\n    return 0"
    )
    assert score(forged, tests) in (None, 0.0)
    missing = "def plus(a, b):\n    return a + b"
    assert score(missing, tests) in (None, 0.0)


def test_bad_tests_and_missing_code():
    looping = "```python\nwhile True:\n    pass\n```"
    assert score(looping, "pass", timeout_s=1.0) in (None, 0.0)
    assert code_reward(code_sample("   ", "assert False")) == 0.0  # no code: nothing runs
    with pytest.raises(ValueError, match="needs tests"):
        code_reward(RewardInput(prompt="", response=GOOD))
    with pytest.raises(ValueError, match="must be test code"):
        code_reward(code_sample(GOOD, {"unexpected": 1}))
    with pytest.raises(ValueError, match="2 inputs and 1 outputs"):
        code_reward(code_sample(GOOD, {"inputs": ["1", "2"], "outputs": ["1"]}))


def test_extract_code_prefers_the_last_python_block():
    response = "```bash\nls\n```\n```python\nfirst()\n```\ntext\n```py\nsecond()\n```"
    assert extract_code(response) == "second()\n"
    assert extract_code("```\nonly()\n```") == "only()\n"
    assert extract_code("print(1)") == "print(1)"


def test_trusted_code_runs_without_isolation():
    assert code_reward(code_sample(GOOD, "assert add(2, 3) == 5"), isolation="none") == 1.0
    with pytest.raises(ValueError, match="isolation='gvisor'"):
        code_reward(code_sample(GOOD, "pass"), isolation="gvisor")


def test_code_reward_through_the_runner():
    tests = ["assert add(2, 3) == 5"]
    samples = [code_sample(GOOD, tests), code_sample(BAD, tests), code_sample("no code", tests)]

    def scores():
        with RewardRunner(RewardConfig(functions=["code"], num_workers=2)) as runner:
            return runner.score(samples)

    try:
        result = scores()
    except ConfigError as error:  # the runner's start-up check: the fail-closed outcome
        assert "code sandbox cannot isolate" in str(error)
        with pytest.raises(ConfigError, match="isolation"):
            check_code_reward()
        return
    assert result.rewards == [1.0, 0.0, 0.0] and not result.failures
    assert result.metrics["reward_code_mean"] == pytest.approx(1 / 3)


def test_runner_refuses_to_start_without_isolation(monkeypatch):
    monkeypatch.setenv("MEGATRON_GSPO_BWRAP", "/nonexistent/bwrap")
    with pytest.raises(ConfigError, match="(?s)code sandbox cannot isolate.*not installed"):
        RewardRunner(RewardConfig(functions=["code"], num_workers=1))
    with pytest.raises(ConfigError, match="not one of"):
        check_code_reward(isolation="namespace")
    trusted = RewardConfig(
        functions=["code"], num_workers=1, options={"code": {"isolation": "none"}}
    )
    with RewardRunner(trusted) as runner:
        assert runner.score([code_sample(GOOD, "assert add(1, 1) == 2")]).rewards == [1.0]
