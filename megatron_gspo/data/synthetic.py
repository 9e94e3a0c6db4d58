"""Built-in verifiable tasks on the synthetic tokenizer (:mod:`megatron_gspo.data.tokenizer`).

Each prompt is ``NUM_DIGITS`` = 8 uniformly random digit tokens followed by ``<sep>``; the answer
is 8 digits the policy must emit, then ``<eos>``:

- ``digit_copy``: the prompt's digits in the same order (``31415926<sep>`` -> ``31415926<eos>``);
  every answer digit sits at the same distance behind it, which a rotary-position attention head
  learns quickly (the CPU demo's task);
- ``digit_reversal``: the prompt's digits in reverse order (``31415926<sep>`` -> ``62951413<eos>``);
  answer digit j sits 2j + 1 tokens back, a different offset per position, so it is much harder;
- ``digit_sort``: the prompt's digits in ascending order (``31415926<sep>`` -> ``11234569<eos>``).
- ``multiply``: the 8 digits as two 4-digit numbers to multiply (``3141*5926<sep>`` ->
  ``18613566``); a task for a tool (:mod:`megatron_gspo.envs.multiply`): a tiny model cannot
  multiply, it can call the calculator and copy its result.

Reward (:func:`score_digit_response`; the TRL benchmark uses the same definition)::

    reward = (1 / 8) * sum_{i < 8} c_i,   c_i = 1    if response token i is the right digit
                                               0.1  if it is a digit, but the wrong one
                                               0    if it is not a digit or does not exist

where the response is cut at its first ``<eos>`` (tokens after it do not exist). Tokens after
position 8 and the presence of ``<eos>`` do not change the reward.

Prompt ``k`` of a stream is drawn from ``numpy.random.default_rng([seed, stream, k])``: the train
stream (0) and the held-out eval stream (1) never share a generator, and the train stream skips
any prompt that also appears in the eval set, so the two are disjoint.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megatron_gspo.config import ConfigError
from megatron_gspo.data.tokenizer import (
    EOS_TOKEN,
    EOS_TOKEN_ID,
    SEP_TOKEN,
    SEP_TOKEN_ID,
    TOOL_TASKS,
    TOOL_TOKENS,
)

NUM_DIGITS = 8
TRAIN_STREAM, EVAL_STREAM = 0, 1


def _reverse(digits: Sequence[int]) -> list[int]:
    return list(reversed(digits))


def _multiply(digits: Sequence[int]) -> list[int]:
    left, right = _operands(digits)
    return [int(character) for character in str(left * right)]


def _operands(digits: Sequence[int]) -> tuple[int, int]:
    half = len(digits) // 2
    return int("".join(map(str, digits[:half]))), int("".join(map(str, digits[half:])))


SYNTHETIC_TASKS = {
    "digit_copy": list,
    "digit_reversal": _reverse,
    "digit_sort": sorted,
    "multiply": _multiply,
}
"""Task name -> function from the prompt's digits to the answer's digits."""

TASK_SUMMARIES = {
    "digit_copy": "repeat 8 random digits",
    "digit_reversal": "reverse 8 random digits",
    "digit_sort": "sort 8 random digits",
    "multiply": "multiply two 4-digit numbers with a calculator tool",
}
"""Task name -> what the policy learns, in the words every description of a task uses (the CPU
demo's in README, ``--help``, examples/moe/cpu_demo.yaml; tests/docs/test_docs.py checks them)."""


def check_task(task: str) -> None:
    if task not in SYNTHETIC_TASKS:
        raise ConfigError(
            "data.task",
            f"unknown synthetic task {task!r}",
            f"the built-in tasks are {', '.join(SYNTHETIC_TASKS)}",
            "set data.task to one of them, or data.train_path to a prompt file",
        )


def draw_digits(seed: int, stream: int, index: int, num_digits: int = NUM_DIGITS) -> list[int]:
    """The digits of prompt ``index`` of ``stream`` (deterministic in ``seed, stream, index``)."""
    generator = np.random.default_rng([seed, stream, index])
    return generator.integers(0, 10, size=num_digits).tolist()


def task_example(task: str, digits: Sequence[int]) -> tuple[list[int], str, str]:
    """``(prompt_ids, prompt_text, answer)`` of one prompt: ids ``digits + [<sep>]``, the text
    ``"31415926<sep>"`` and the answer digits as a string (``"62951413"``), without ``<eos>``.
    ``multiply`` puts ``*`` between the two halves (``"3141*5926<sep>"``)."""
    check_task(task)
    answer = "".join(str(digit) for digit in SYNTHETIC_TASKS[task](list(digits)))
    if task in TOOL_TASKS:
        half = len(digits) // 2
        prompt_ids = [*digits[:half], TOOL_TOKENS["*"], *digits[half:], SEP_TOKEN_ID]
        text = "".join(map(str, digits[:half])) + "*" + "".join(map(str, digits[half:]))
        return prompt_ids, text + SEP_TOKEN, answer
    prompt_text = "".join(str(digit) for digit in digits) + SEP_TOKEN
    return [*digits, SEP_TOKEN_ID], prompt_text, answer


def correct_response_ids(answer: str) -> list[int]:
    """The ideal response of an answer string: its digit ids then ``<eos>``."""
    return [int(character) for character in answer] + [EOS_TOKEN_ID]


def score_digit_response(response_ids: Sequence[int], answer: str) -> float:
    """Reward of one response (token ids of the synthetic tokenizer) against ``answer`` (digits).

    Formula in the module docstring; result in ``[0, 1]``, 1 only for the exact answer.
    """
    if not answer or not answer.isdigit():
        raise ValueError(f"the answer must be a non-empty digit string, got {answer!r}")
    response = list(response_ids)
    if EOS_TOKEN_ID in response:
        response = response[: response.index(EOS_TOKEN_ID)]
    total = 0.0
    for position, expected in enumerate(answer):
        if position >= len(response) or not 0 <= response[position] <= 9:
            continue
        total += 1.0 if response[position] == int(expected) else 0.1
    return total / len(answer)


def response_ids_from_text(text: str) -> list[int]:
    """Token ids of a response given as text (what a text-only engine returns): each character is
    one token, ``<eos>`` (and the other special tokens) one token each. Only digits and ``<eos>``
    matter to :func:`score_digit_response`, so other characters map to -1."""
    ids: list[int] = []
    position = 0
    while position < len(text):
        if text.startswith(EOS_TOKEN, position):
            ids.append(EOS_TOKEN_ID)
            position += len(EOS_TOKEN)
            continue
        if text[position] == "<":
            end = text.find(">", position)
            if end > position:
                ids.append(-1)
                position = end + 1
                continue
        ids.append(int(text[position]) if text[position] in "0123456789" else -1)
        position += 1
    return ids
