"""Arithmetic word problems with known answers: a text math task for real tokenizers.

Each problem is one English sentence pair built from a template (addition, subtraction,
multiplication, or a two-step sum and product) with random names, objects and numbers; its answer
is an integer, and the prompt asks for it in ``\\boxed{}``, which the math reward
(:mod:`megatron_gspo.reward.math_answer`, ``reward.functions=[math]``) checks. Problem ``k`` is drawn
from ``numpy.random.default_rng([seed, k])``, so a file is reproducible from ``(count, seed)``.

The problems are written as a prompt file (JSONL rows ``{"prompt", "answer", "operation"}``) that
the ordinary data path reads (``data.train_path``, ``data.apply_chat_template``, a tokenizer
directory)::

    python -m megatron_gspo.data.arithmetic_text train.jsonl --count 1000 --seed 0
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

INSTRUCTION = "Solve the problem and give the final answer as \\boxed{number}."
NAMES = ("Ana", "Bilal", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ines", "Jun")
OBJECTS = ("apples", "marbles", "stamps", "pencils", "shells", "coins", "books", "stickers")
OPERATIONS = ("add", "subtract", "multiply", "two_step")


def arithmetic_problem(seed: int, index: int) -> dict[str, Any]:
    """Problem ``index`` of the set drawn with ``seed``: ``{"prompt", "answer", "operation"}``,
    the answer an integer written as a string."""
    rng = np.random.default_rng([seed, index])
    operation = OPERATIONS[int(rng.integers(len(OPERATIONS)))]
    name = NAMES[int(rng.integers(len(NAMES)))]
    thing = OBJECTS[int(rng.integers(len(OBJECTS)))]
    first, second, third = (int(value) for value in rng.integers(2, 60, size=3))
    if operation == "add":
        question = f"{name} has {first} {thing} and gets {second} more. How many {thing} now?"
        answer = first + second
    elif operation == "subtract":
        first, second = max(first, second), min(first, second)  # answers stay non-negative
        question = f"{name} has {first} {thing} and gives away {second}. How many are left?"
        answer = first - second
    elif operation == "multiply":
        first, second = first % 12 + 2, second % 12 + 2  # times tables: small numbers
        question = f"{name} fills {first} bags with {second} {thing} each. How many {thing}?"
        answer = first * second
    else:
        second = second % 9 + 2
        question = (
            f"{name} has {first} {thing} and buys {second} packs of {third % 9 + 2}. "
            f"How many {thing} does {name} have?"
        )
        answer = first + second * (third % 9 + 2)
    return {"prompt": f"{question} {INSTRUCTION}", "answer": str(answer), "operation": operation}


def arithmetic_problems(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Problems ``0 .. count - 1`` of the set drawn with ``seed``."""
    if count < 1:
        raise ValueError(f"count={count}: at least one problem")
    return [arithmetic_problem(seed, index) for index in range(count)]


def boxed_answer(answer: Union[int, str]) -> str:
    """A response that states ``answer`` the way the prompt asks (the reward's full score)."""
    return f"The answer is \\boxed{{{answer}}}."


def write_arithmetic_prompt_file(path: Union[str, Path], count: int, seed: int = 0) -> Path:
    """``count`` problems as a JSONL prompt file at ``path`` (parents created); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for row in arithmetic_problems(count, seed):
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description="Write arithmetic word problems as a prompt file.")
    parser.add_argument("path", help="the JSONL file to write")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    arguments = parser.parse_args(argv)
    path = write_arithmetic_prompt_file(arguments.path, arguments.count, arguments.seed)
    print(f"{path}: {arguments.count} problems (seed {arguments.seed})")


if __name__ == "__main__":
    main()
