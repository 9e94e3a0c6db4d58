"""Code reward: run the response's Python against the sample's tests, only in the sandbox
(:mod:`megatron_gspo.reward.sandbox`).

``metadata[tests_key]`` (``tests`` by default) holds the tests, in one of three forms:

- a string of Python test code (e.g. asserts, HumanEval's ``check``), run after the solution in
  the same program: 1.0 if it exits with status 0, else 0.0;
- a list of strings (MBPP's ``test_list``): joined into one test program, scored the same way;
- a list of ``{"input": ..., "output": ...}`` cases: the solution runs once per case with the
  input on stdin; the score is the fraction of cases whose stdout equals the output (trailing
  whitespace of each line ignored).

Each sandboxed run gets ``timeout_s`` of wall clock and CPU; keep ``reward.timeout_s`` above
``timeout_s`` x cases, or the runner stops the call first (counted as a time-out).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_gspo.reward.functions import RewardInput
from megatron_gspo.reward.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


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


def code_reward(
    sample: RewardInput,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    tests_key: str = "tests",
    network_isolation: str = "auto",
) -> float:
    """Score of the response's code on the sample's tests (forms and scores in the module
    docstring). A response without code scores 0; a sample without tests raises (a data error)."""
    tests = sample.metadata.get(tests_key)
    if tests is None:
        raise ValueError(
            f"the code reward needs tests in metadata[{tests_key!r}] (keys present: "
            f"{sorted(sample.metadata)})"
        )
    code = extract_code(sample.response)
    if not code.strip():
        return 0.0
    limits = SandboxLimits(
        wall_time_s=timeout_s,
        cpu_time_s=max(1, int(timeout_s + 0.999)),
        memory_mb=memory_mb,
        network_isolation=network_isolation,
    )
    if isinstance(tests, str):
        return float(run_python(f"{code}\n\n{tests}\n", limits=limits).passed)
    if isinstance(tests, Sequence) and tests and all(isinstance(test, str) for test in tests):
        return float(run_python(code + "\n\n" + "\n".join(tests) + "\n", limits=limits).passed)
    if isinstance(tests, Sequence) and tests and all(_is_io_case(test) for test in tests):
        passed = 0
        for case in tests:
            result = run_python(code, stdin=str(case["input"]), limits=limits)
            passed += result.passed and _same_output(result.stdout, str(case["output"]))
        return passed / len(tests)
    raise ValueError(
        f"metadata[{tests_key!r}] must be test code (a string), a list of test strings, or a list "
        f'of {{"input": ..., "output": ...}} cases; got {type(tests).__name__} {str(tests)[:80]!r}'
    )


def _is_io_case(test: Any) -> bool:
    return isinstance(test, Mapping) and "input" in test and "output" in test
