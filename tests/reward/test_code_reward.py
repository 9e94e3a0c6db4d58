"""The ``code`` reward's contract: the three test forms, what scores, assertions judged outside
the program's interpreter, long outputs, and the start-up check. Attacks on the sandbox itself:
``test_hostile_code.py``. A test that takes the ``sandbox`` fixture runs only where bubblewrap
isolates code (``sandbox_support.py``)."""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, RewardConfig
from megatron_gspo.reward import RewardInput, RewardRunner
from megatron_gspo.reward.assertions import assertion_checks
from megatron_gspo.reward.code_execution import check_code_reward, code_reward, extract_code


def code_sample(response: str, tests) -> RewardInput:
    return RewardInput(prompt="write add", response=response, metadata={"tests": tests})


def score(response: str, tests, **options) -> float:
    return code_reward(code_sample(response, tests), **options)


GOOD = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\n"
BAD = "```python\ndef add(a, b):\n    return a * b\n```"


def test_test_code_and_test_lists(sandbox):
    cases = [
        (GOOD, "assert add(2, 3) == 5\nassert add(0, 0) == 0", 1.0),
        (BAD, "assert add(2, 3) == 5", 0.0),
        (GOOD, ["assert add(1, 1) == 2", "assert add(2, 2) == 4"], 1.0),
        (BAD, ["assert add(2, 2) == 4", "assert add(1, 1) == 2"], 0.0),
    ]
    for response, tests, expected in cases:
        assert score(response, tests) == expected


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
def test_exiting_early_scores_zero(sandbox, program):
    """The tests never pass (``assert False``, run in the interpreter; a wrong ``add`` against an
    assertion judged outside): no way of ending the program early scores."""
    assert score(f"```python\n{program}\n```", "assert False") == 0.0
    assert score(f"```python\n{program}\n```", ["assert False"]) == 0.0
    wrong = f"```python\ndef add(a, b):\n    return a - b\n{program}\n```"
    assert score(wrong, "assert add(1, 2) == 3") == 0.0


def test_tests_see_builtins_as_they_were_before_the_program(sandbox):
    program = "import builtins\nbuiltins.abs = lambda value: 0\n"
    assert score(program, "assert abs(-3) == 0") == 0.0
    assert score(program, "assert abs(-3) == 3") == 1.0


def test_the_program_cannot_read_the_tests_or_the_token_from_disk(sandbox):
    program = "import os\nLEFT = sorted(os.listdir('.'))\ndef add(a, b):\n    return a + b\n"
    tests = "assert LEFT == ['main.py', 'solution.py'], LEFT\nassert add(1, 2) == 3"
    assert score(program, tests) == 1.0  # judged outside: nothing but the program is left
    looping = "for a in range(2):\n    assert add(a, 1) == a + 1\nassert LEFT == ['main.py', 'solution.py']"
    assert score(program, looping) == 1.0  # in the interpreter: the tests and token are gone


def test_long_output_passes(sandbox):
    """A program that prints a lot still passes, judged outside or in the interpreter (where
    the token is looked for in the tail of stdout)."""
    chatty = "def add(a, b):\n    return a + b\nprint('x' * 200000)\n"
    assert score(chatty, "assert add(1, 2) == 3") == 1.0
    assert score(chatty, "for a in range(3):\n    assert add(a, 1) == a + 1") == 1.0


def test_an_output_longer_than_64_kb_is_compared_whole(sandbox):
    """A correct program whose output is 224 KB used to score 0: only its first 64 KB were
    compared. Everything a program may write (max_output_mb) is read back now, and an expected
    output longer than that is a data error that names the limit."""
    expected = "\n".join(f"{index:07d}" for index in range(28000))
    assert len(expected) == 224_000 - 1  # 224 KB with the last newline
    program = "```python\nfor index in range(28000):\n    print(f'{index:07d}')\n```"
    assert score(program, [{"input": "", "output": expected}]) == 1.0
    off_by_one = program.replace("28000", "27999")
    assert score(off_by_one, [{"input": "", "output": expected}]) == 0.0
    with pytest.raises(ValueError, match=r"output limit of 1048576 bytes \(max_output_mb=1\)"):
        code_reward(
            code_sample(program, [{"input": "", "output": "x" * (2 << 20)}]), max_output_mb=1
        )


GOOD_FORMS = [
    # MBPP: a list of assertions, expected values as literals or builtins of literals.
    ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) != 5"],
    ["assert set(add([1], [2])) == set([1, 2])", "assert add((1,), (2,)) == (1, 2)"],
    ["assert sorted(add([3], [1])) == [1, 3]", "assert add('a', 'b') in ['ab', 'ba']"],
    # Floating point: tolerance, isclose, and identity with True, False, None.
    "import math\nassert abs(add(0.1, 0.2) - 0.3) < 1e-9\nassert math.isclose(add(0.1, 0.2), 0.3)",
    "assert add(1, 2) is not None\nassert add(2, 3) == 5",
    "assert add(1, 2) and not add(1, -1)",
    # HumanEval: def check(candidate) of assertions, called on the entry point.
    "METADATA = {'author': 'x'}\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
    "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-6\n\ncheck(add)\n",
]


@pytest.mark.parametrize("tests", GOOD_FORMS)
def test_assertions_judged_outside_pass_a_correct_program(sandbox, tests):
    assert assertion_checks(tests if isinstance(tests, str) else "\n".join(tests)) is not None
    assert score(GOOD, tests) == 1.0
    assert score(BAD, tests) == 0.0


# The forms that scored 1.0 against failing tests when the assertion ran in the program's
# interpreter (docs/code-sandbox.md listed them as weak). Each meets the test it beat.
HOSTILE_FORMS = {
    "always equal": (
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    __hash__ = object.__hash__\n"
        "class AnyInt(int):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Anything() if a < 0 else AnyInt(0)\n",
        ["assert add(1, 2) == 4", "assert add(-1, 2) == 4"],
    ),
    "frame walk to the caller": (
        "import os, sys\ndef add(a, b):\n    frame = sys._getframe(1)\n"
        "    while frame is not None:\n        if 'token' in frame.f_locals:\n"
        "            sys.stdout.flush()\n"
        "            os.write(1, ('\\n' + frame.f_locals['token'] + '\\n').encode())\n"
        "            os._exit(0)\n        frame = frame.f_back\n    return 0\n",
        "assert add(1, 2) == 4",
    ),
    "shadowed abs": (
        "import builtins\nabs = builtins.abs = lambda value: 0\ndef add(a, b):\n    return 0.0\n",
        "assert abs(add(1, 2) - 4.0) < 1e-9",
    ),
    "replaced traceback.print_exc": (
        "import os, sys, traceback\ndef forge(*args, **kwargs):\n"
        "    token = sys._getframe(1).f_locals.get('token')\n"
        "    os.write(1, ('\\n' + str(token) + '\\n').encode())\n    os._exit(0)\n"
        "traceback.print_exc = forge\ndef add(a, b):\n    return a - b\n",
        "assert add(1, 2) == 4",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_FORMS))
def test_hostile_programs_score_zero_against_failing_assertions(sandbox, name):
    program, tests = HOSTILE_FORMS[name]
    assert score(f"```python\n{program}```", tests) == 0.0


def test_stdin_stdout_cases_score_the_fraction_passed(sandbox):
    program = "```python\nn = int(input())\nprint(n * 2 if n < 10 else n)\n```"
    cases = [
        {"input": "1\n", "output": "2"},
        {"input": "4\n", "output": "8\n"},
        {"input": "20\n", "output": "40"},
    ]
    assert score(program, cases) == pytest.approx(2 / 3)
    columns = {"inputs": ["1\n", "4\n", "20\n"], "outputs": ["2", "8", "40"]}
    assert score(program, columns) == pytest.approx(2 / 3)
    assert score("import sys\nsys.exit(0)", cases) == 0.0


def test_function_call_cases_are_judged_outside(sandbox):
    tests = {"fn_name": "add", "inputs": [[1, 2], [2, 2], [[1], [2]]], "outputs": [3, 4, [1, 2]]}
    assert score(GOOD, tests) == 1.0
    assert score(BAD, tests) == pytest.approx(1 / 3)  # 2 * 2 == 2 + 2
    method = "class Solution:\n    def add(self, a, b):\n        return (a + b,)\n"
    assert score(method, {"fn_name": "add", "inputs": [[1, 2]], "outputs": [[3]]}) == 1.0
    # An object equal to everything, an early exit, a raising call, lines forged with a guessed
    # prefix: none of them is an answer.
    always_equal = (
        "class Anything(int):\n    def __eq__(self, other):\n        return True\n"
        "def add(a, b):\n    return Anything(0)\n"
    )
    assert score(always_equal, tests) == 0.0
    assert score("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b", tests) == 0.0
    raising = "def add(a, b):\n    if a == 1:\n        raise ValueError\n    return a + b\n"
    assert score(raising, tests) == pytest.approx(2 / 3)
    forged = (
        "import sys\nfor i in range(3):\n    print(sys.argv[1], i, 3)\ndef add(a, b):\n    return 0"
    )
    assert score(forged, tests) == 0.0
    missing = "def plus(a, b):\n    return a + b"
    assert score(missing, tests) == 0.0


def test_bad_tests_and_missing_code(sandbox):
    looping = "```python\nwhile True:\n    pass\n```"
    assert score(looping, "pass", timeout_s=1.0) == 0.0
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


def test_code_reward_through_the_runner(sandbox):
    tests = ["assert add(2, 3) == 5"]
    samples = [code_sample(GOOD, tests), code_sample(BAD, tests), code_sample("no code", tests)]

    def scores():
        with RewardRunner(RewardConfig(functions=["code"], num_workers=2)) as runner:
            return runner.score(samples)

    result = scores()
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
