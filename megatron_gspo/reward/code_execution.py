"""Code reward: run the response's Python against the sample's tests, only in the sandbox
(:mod:`megatron_gspo.reward.sandbox`), and score only what the sandbox cannot fake.

``metadata[tests_key]`` (``tests`` by default) holds the tests in one of three forms. Each is
judged outside the sandbox wherever it can be, against expected values that never enter it, so
the response's code can pass only by computing the right answers:

- **stdin/stdout cases** (APPS, CodeContests, LiveCodeBench stdin problems): a list of
  ``{"input": str, "output": str}``, or ``{"inputs": [str, ...], "outputs": [str, ...]}``. The
  program runs once per case with the input on stdin and must exit with status 0; the case
  passes when its stdout equals the output (trailing whitespace of each line and blank lines
  at the ends ignored). Score: the fraction of cases passed.
- **function-call cases** (TACO/APPS ``fn_name``, LiveCodeBench functional problems):
  ``{"fn_name": name, "inputs": [[arg, ...], ...], "outputs": [value, ...]}``. A driver defines
  the program's functions (as module ``solution``, so a ``__main__`` block does not run), calls
  ``name(*inputs[i])`` (or ``Solution().name`` for a class-style solution) for each case and
  prints each return value as JSON; outside, a case passes when the JSON value equals
  ``outputs[i]`` exactly (tuples compare as lists; no float tolerance). Score: the fraction.
- **test code** (HumanEval's ``check``, MBPP's ``test_list``): a string of Python, or a list of
  strings joined into one. Score: 1.0 when every test passes, else 0.0.

  *Assertions* (:func:`assertion_checks`): test code made of ``assert`` statements that compare
  a value of the program with an expected value written in the test (a literal, or builtins
  such as ``set``/``sorted`` applied to literals), ``assert value``/``assert not value``,
  ``abs(value - expected) < tolerance`` and ``math.isclose``, with ``import`` lines, or
  HumanEval's ``def check(candidate): <such asserts>`` followed by ``check(name)``. Only the
  value side of each assertion runs in the sandbox (after the program, in its namespace, with
  the builtins as they were before it ran); the values come out as JSON of plain data (tuples,
  sets and dictionaries tagged, subclasses of the builtin types converted to them, anything
  else refused) and each comparison runs here. An object whose ``==`` is always true, a frame
  walk to the driver, a shadowed ``abs`` or a replaced ``traceback.print_exc`` cannot change a
  comparison that does not run in its interpreter.

  *Other test code* (loops, helper functions, expected values computed by the test) runs with
  the program in one interpreter under a driver, which prints a random per-call token as the
  last line of stdout only after the last test returned: 1.0 when the run exits with status 0
  and the token is the last line. An early ``sys.exit(0)``/``os._exit(0)``, an exception
  swallowed at exit or a killed process scores 0, but a program that introspects the
  interpreter (reads the token from memory, returns objects whose ``==`` is always true) can
  forge a pass: ``docs/code-sandbox.md`` has the details. Convert such data into one of the
  forms above for RL against a policy that searches for exploits.

A response without code scores 0; a sample without tests, or with tests in none of these forms,
raises (a data error, counted by the runner), as does an expected output longer than the output
limit (``max_output_mb``, 16 MB: the most a program may write, and all of it is compared). Each
sandboxed run gets ``timeout_s`` of wall clock and CPU: one run per stdin/stdout case, one run
for the function-call cases, one for test code; keep ``reward.timeout_s`` above ``timeout_s`` x
cases. Where the kernel cannot isolate code, the call raises
:class:`~megatron_gspo.reward.sandbox.SandboxUnavailableError` (and the runner stops at start, see
:func:`check_code_reward`); ``isolation="none"`` runs it without isolation, for trusted code only.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gspo.config import ConfigError
from megatron_gspo.reward import assertions
from megatron_gspo.reward.functions import RewardInput
from megatron_gspo.reward.sandbox import (
    ISOLATION_MODES,
    SandboxLimits,
    SandboxUnavailableError,
    check_isolation,
    run_python,
)

logger = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)

# The drivers run as /sandbox/main.py with the program in solution.py beside it.
_TEST_CODE_DRIVER = r"""
import builtins, os, sys, traceback

def _main(exec=exec, compile=compile, write=os.write, exit_now=os._exit, dict=dict):
    # Everything the driver calls after the program ran is bound here, before it runs: a program
    # that replaces builtins.exec or os._exit changes nothing for the driver.
    # The token and the tests (their expected values) are read, then removed, before the
    # program runs: it cannot find them on disk.
    with open("token") as handle:
        token = handle.read().strip()
    with open("tests.py", encoding="utf-8") as handle:
        tests = compile(handle.read(), "tests.py", "exec")
    os.remove("token")
    os.remove("tests.py")
    with open("solution.py", encoding="utf-8") as handle:
        program = compile(handle.read(), "solution.py", "exec")
    pristine_builtins = dict(vars(builtins))
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(program, namespace)
        # The tests see the program's names, and builtins as they were before it ran.
        exec(tests, dict(namespace, __builtins__=pristine_builtins))
    except BaseException:  # SystemExit included: exiting early is not passing
        traceback.print_exc()
        sys.stderr.flush()
        exit_now(1)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    write(1, ("\n" + token + "\n").encode())
    exit_now(0)  # the program's atexit handlers cannot print after the token

_main()
"""

_FUNCTION_CALL_DRIVER = r"""
import json, os, sys, traceback

def _main():
    token, name = sys.argv[1], sys.argv[2]
    with open("inputs.json", encoding="utf-8") as handle:
        inputs = json.load(handle)
    with open("solution.py", encoding="utf-8") as handle:
        program = handle.read()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(program, "solution.py", "exec"), namespace)
        function = namespace.get(name)
        if function is None and isinstance(namespace.get("Solution"), type):
            function = getattr(namespace["Solution"](), name)
        if not callable(function):
            raise NameError(f"the program defines no function {name!r}")
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    for index, arguments in enumerate(inputs):
        try:
            line = json.dumps(function(*arguments))
        except BaseException:
            traceback.print_exc()
            line = "!"
        try:
            sys.stdout.flush()
        except BaseException:
            pass
        os.write(1, f"\n{token} {index} {line}\n".encode())
    os._exit(0)

_main()
"""


def extract_code(response: str) -> str:
    """The last fenced code block tagged python/py (else the last fenced block of any language);
    the whole response when it has no fence."""
    blocks = _FENCE.findall(response)
    if not blocks:
        return response
    python_blocks = [code for language, code in blocks if language.lower() in ("python", "py")]
    return (python_blocks or [code for _, code in blocks])[-1]


def _same_output(actual: str, expected: str) -> bool:
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(actual) == lines(expected)


def _as_json_value(value: Any) -> Any:
    """``value`` as the JSON round trip gives it (tuples become lists)."""
    return json.loads(json.dumps(value))


def code_reward(
    sample: RewardInput,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    tests_key: str = "tests",
    isolation: str = "bubblewrap",
    max_processes: int = 8,
    max_output_mb: int = 16,
) -> float:
    """Score of the response's code on the sample's tests (forms and scores in the module
    docstring). A response without code scores 0; a sample without tests raises (a data error).

    ``max_output_mb``: the most a program may write (each file, stdout and stderr included), all
    of which is read back and compared; an expected output longer than that raises."""
    tests = sample.metadata.get(tests_key)
    if tests is None:
        raise ValueError(
            f"the code reward needs tests in metadata[{tests_key!r}] (keys present: "
            f"{sorted(sample.metadata)})"
        )
    form = _test_form(tests, tests_key)
    if max_output_mb <= 0:
        raise ValueError(f"the code reward's max_output_mb must be > 0, got {max_output_mb}")
    if form == "stdio":
        if isinstance(tests, Mapping):
            tests = [{"input": i, "output": o} for i, o in zip(tests["inputs"], tests["outputs"])]
        _check_expected_outputs(tests, max_output_mb)
    code = extract_code(sample.response)
    if not code.strip():
        return 0.0
    limits = SandboxLimits(
        wall_time_s=timeout_s,
        cpu_time_s=max(1, int(timeout_s + 0.999)),
        memory_mb=memory_mb,
        max_processes=max_processes,
        isolation=isolation,
        # What the program may write is what is read back: a correct answer is never cut.
        max_file_mb=max_output_mb,
        max_output_bytes=max_output_mb * 1024 * 1024,
    )
    if form == "stdio":
        passed = 0
        for case in tests:
            result = run_python(code, stdin=str(case["input"]), limits=limits)
            _note_truncation(result.output_truncated, max_output_mb)
            passed += result.passed and _same_output(result.stdout, str(case["output"]))
        return passed / len(tests)
    if form == "function_call":
        return _function_call_score(code, tests, limits)
    test_code = tests if isinstance(tests, str) else "\n".join(tests)
    judged_outside = assertions.assertion_checks(test_code)
    if judged_outside is not None:
        return _assertion_score(code, judged_outside, limits)
    token = secrets.token_hex(16)
    result = run_python(
        _TEST_CODE_DRIVER,
        limits=limits,
        files={"solution.py": code, "tests.py": test_code + "\n", "token": token},
    )
    last_line = result.stdout_tail.rstrip("\n").rpartition("\n")[2]
    return float(result.passed and last_line == token)


def _check_expected_outputs(cases: Sequence[Mapping[str, Any]], max_output_mb: int) -> None:
    """A case whose expected output is longer than a program may write can never pass: a data
    (or configuration) error, raised rather than scored 0."""
    limit = max_output_mb * 1024 * 1024
    for index, case in enumerate(cases):
        size = len(str(case["output"]).encode("utf-8"))
        if size > limit:
            raise ValueError(
                f"the expected output of case {index} is {size} bytes, over the code reward's "
                f"output limit of {limit} bytes (max_output_mb={max_output_mb}): no program could "
                "pass it; raise reward.options.code.max_output_mb"
            )


_truncation_noted = False


def _note_truncation(truncated: bool, max_output_mb: int) -> None:
    """Say once per process that output past the limit was cut (such a run fails its case)."""
    global _truncation_noted
    if truncated and not _truncation_noted:
        _truncation_noted = True
        logger.warning(
            "code reward: a program wrote more than the output limit of %d MB "
            "(reward.options.code.max_output_mb); its output was cut and the case failed "
            "(said once)",
            max_output_mb,
        )


def _token_lines(result_stdout: str, stdout_tail: str, token: str) -> dict[int, list[str]]:
    """Lines a driver printed: ``<token> <case> <json>`` -> case -> the values printed for it.
    A case printed twice with different values (the program forging lines) counts as failed."""
    answers: dict[int, list[str]] = {}
    for line in result_stdout.splitlines() + stdout_tail.splitlines():
        head, _, rest = line.partition(" ")
        if head == token:
            index, _, value = rest.partition(" ")
            if index.isdigit():
                answers.setdefault(int(index), []).append(value)
    return answers


def _function_call_score(code: str, tests: Mapping[str, Any], limits: SandboxLimits) -> float:
    inputs, outputs = tests["inputs"], tests["outputs"]
    token = secrets.token_hex(16)
    result = run_python(
        _FUNCTION_CALL_DRIVER,
        limits=limits,
        files={"solution.py": code, "inputs.json": json.dumps(list(inputs))},
        argv=[token, str(tests["fn_name"])],
    )
    _note_truncation(result.output_truncated, limits.max_file_mb)
    answers = _token_lines(result.stdout, result.stdout_tail, token)
    passed = 0
    for index, expected in enumerate(outputs):
        values = set(answers.get(index, ()))
        if len(values) != 1:
            continue
        (value,) = values
        try:
            passed += value != "!" and json.loads(value) == _as_json_value(expected)
        except ValueError:
            continue
    return passed / len(outputs)


def _assertion_score(code: str, tests: assertions.AssertionTests, limits: SandboxLimits) -> float:
    """1.0 when every assertion holds for the values the program's code computed in the
    sandbox, compared here (:mod:`megatron_gspo.reward.assertions`)."""
    token = secrets.token_hex(16)
    checks = {"setup": tests.setup, "expressions": [check.expression for check in tests.checks]}
    result = run_python(
        assertions.DRIVER,
        limits=limits,
        files={"solution.py": code, "checks.json": json.dumps(checks)},
        argv=[token],
    )
    _note_truncation(result.output_truncated, limits.max_file_mb)
    answers = _token_lines(result.stdout, result.stdout_tail, token)
    for index, check in enumerate(tests.checks):
        values = set(answers.get(index, ()))
        if len(values) != 1:
            return 0.0
        (value,) = values
        if value == "!":
            return 0.0
        try:
            decoded = assertions.decode(value)
        except ValueError:
            return 0.0
        if not check.passes(decoded):
            return 0.0
    return 1.0


def _test_form(tests: Any, tests_key: str) -> str:
    """``stdio``, ``function_call`` or ``test_code``; ValueError for anything else."""
    if isinstance(tests, str):
        return "test_code"
    if isinstance(tests, Mapping) and {"inputs", "outputs"} <= set(tests):
        inputs, outputs = tests["inputs"], tests["outputs"]
        if isinstance(inputs, Sequence) and isinstance(outputs, Sequence):
            if len(inputs) != len(outputs) or not inputs:
                raise ValueError(
                    f"metadata[{tests_key!r}] has {len(inputs)} inputs and {len(outputs)} "
                    "outputs; give one output per input, at least one case"
                )
            if "fn_name" not in tests:
                return "stdio"
            if all(isinstance(arguments, list) for arguments in inputs):
                return "function_call"
    if isinstance(tests, Sequence) and tests:
        if all(isinstance(test, str) for test in tests):
            return "test_code"
        if all(_is_io_case(test) for test in tests):
            return "stdio"
    raise ValueError(
        f"metadata[{tests_key!r}] must be test code (a string or a list of strings), "
        '[{"input": ..., "output": ...}, ...], {"inputs": [...], "outputs": [...]} or '
        '{"fn_name": ..., "inputs": [[args], ...], "outputs": [...]}; got '
        f"{type(tests).__name__} {str(tests)[:80]!r}"
    )


def _is_io_case(test: Any) -> bool:
    return isinstance(test, Mapping) and "input" in test and "output" in test


def check_code_reward(*, isolation: str = "bubblewrap", **_other_options: Any) -> None:
    """Called once by the runner at start: a :class:`ConfigError` when ``isolation`` is unknown
    or the kernel cannot provide it here (the run stops before its first step rather than
    scoring every sample as a failure)."""
    if isolation not in ISOLATION_MODES:
        raise ConfigError(
            "reward.options.code.isolation",
            f"{isolation!r} is not one of {list(ISOLATION_MODES)}",
            "generated code runs under bubblewrap, or without isolation when it is trusted",
            "set isolation=bubblewrap (the default), or none for trusted code only",
        )
    if isolation == "none":
        return
    try:
        check_isolation()
    except SandboxUnavailableError as error:
        raise ConfigError(
            "reward.options.code.isolation",
            "the code sandbox cannot isolate code on this machine",
            str(error),
            "install bubblewrap and allow unprivileged user namespaces (docs/code-sandbox.md), "
            "or set reward.options.code.isolation=none if every program it runs is trusted",
        ) from None


code_reward.check = check_code_reward  # type: ignore[attr-defined]  # see functions.py
