#!/usr/bin/env python
"""A judge whose verdict is checkable, and a task for it (docs/judges.md).

The judge is a tiny qwen3 model fine-tuned to answer ``yes`` exactly when the reference answer
and the response, shown as ``{answer}={response}?`` (:data:`JUDGE_TEMPLATE`), are the same digit
string, and ``no`` otherwise. Its inputs are every pair the policy of the task below can produce:
a one-digit answer against a one-digit or an empty response (10 x 11 = 110 pairs, one-digit near
misses included), so that the judge is trained and checked on the whole space, not a sample.

The task: one-digit copying (prompt ``7<sep>``, answer ``7``) in a prompt file, with the
synthetic tokenizer saved beside it; with ``algo.response_length=1`` a policy's response is one
digit, or empty (an ``<eos>`` or another special token, skipped when the response is decoded).

    python tools/digit_judge.py --out outputs/digit_judge

writes ``OUT/judge`` (the judge: Hugging Face directory and its byte-level tokenizer),
``OUT/tokenizer`` (the policy's synthetic tokenizer), ``OUT/prompts.jsonl`` and
``OUT/judge_training.json``: the judge's training steps, time and accuracy on every pair (its first
answer token, greedy), which it also prints.
tests/reward/test_digit_judge.py runs this command in a session fixture, checks the judge through
its engine, and runs docs/judges.md's training command on the directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import megatron_gspo  # noqa: F401
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_gspo.config import ModelConfig
from megatron_gspo.data.tokenizer import build_byte_tokenizer, build_synthetic_tokenizer
from megatron_gspo.rollout.hf_model import build_hf_model

JUDGE_TEMPLATE = "{answer}={response}?"
"""The judge's prompt (``reward.judge.template``): the two strings it compares and nothing else,
so that its inputs are few tokens and its whole input space can be enumerated."""
ANSWERS = tuple(str(digit) for digit in range(10))
RESPONSES = ("", *ANSWERS)
"""What a one-token response decodes to: a digit, or nothing (a special token)."""
JUDGE_MODEL = ModelConfig(
    architecture="qwen3",
    vocab_size=259,  # the byte-level tokenizer's 256 bytes and 3 special tokens
    hidden_size=64,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn_hidden_size=128,
    num_experts=0,
    max_position_embeddings=64,
)
LEARNING_RATE = 1e-3
"""Adam on the full batch of 110 pairs: every pair is judged right after 90-170 steps from seeds
0-5, the same step on AVX-512 and AVX2 kernels. At 3e-3 the loss spikes on its way down and
where training ends depends on the CPU's kernels: 230-400 steps with AVX-512, 330-460 with AVX2
(``ATEN_CPU_CAPABILITY=avx2``, the kernels of an AVX2-only CPU), whose judge stopped at 300
steps with 94% of the mismatching pairs right (1e-2 oscillates between the classes)."""
MAX_STEPS = 400
"""Where training stops at the latest (more than twice the 170 steps the slowest of seeds 0-5
needs)."""
CHECK_EVERY = 10
"""Training stops at the first check (every this many steps) where every pair is judged right."""
TRAINING_RECORD = "judge_training.json"
"""What the command writes beside the judge: its :class:`JudgeTraining`, as JSON."""


@dataclass(frozen=True)
class JudgeTraining:
    """How the fine-tuning went: its optimizer steps, its wall clock and CPU time (the wall clock
    of a loaded machine says little), and the first answer token's greedy accuracy on the
    matching pairs and on the others (all of each)."""

    steps: int
    seconds: float
    cpu_seconds: float
    match_accuracy: float
    mismatch_accuracy: float


def judge_pairs() -> list[tuple[str, str]]:
    """Every ``(answer, response)`` pair the task's policy can produce."""
    return [(answer, response) for answer in ANSWERS for response in RESPONSES]


def verdict(answer: str, response: str) -> str:
    """The right answer of the judge: what it is trained to say."""
    return "yes" if answer == response else "no"


def _batch(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input ids (right-padded), the targets (-100 where no loss), each pair's weight (the two
    classes weigh the same in the loss) and the position of each pair's first verdict token."""
    rows, targets, first = [], [], []
    for answer, response in judge_pairs():
        prompt = tokenizer.encode(
            JUDGE_TEMPLATE.format(answer=answer, response=response), add_special_tokens=False
        )
        reply = tokenizer.encode(verdict(answer, response), add_special_tokens=False)
        reply = reply + [tokenizer.eos_token_id]
        rows.append(prompt + reply)
        # Position i predicts token i + 1: the prompt's last position predicts the verdict.
        targets.append([-100] * (len(prompt) - 1) + reply + [-100])
        first.append(len(prompt) - 1)
    width = max(map(len, rows))
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for index, (row, target) in enumerate(zip(rows, targets)):
        input_ids[index, : len(row)] = torch.tensor(row)
        labels[index, : len(target)] = torch.tensor(target)
    matches = torch.tensor([answer == response for answer, response in judge_pairs()])
    weights = torch.where(matches, 1.0 / matches.sum(), 1.0 / (~matches).sum())
    return input_ids, labels, weights, torch.tensor(first)


def _accuracy(model, input_ids, labels, first) -> tuple[float, float]:
    """Greedy first verdict token right, on the matching pairs and on the others."""
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
    rows = torch.arange(len(first))
    right = logits[rows, first].argmax(-1) == labels[rows, first]
    matches = torch.tensor([answer == response for answer, response in judge_pairs()])
    return right[matches].float().mean().item(), right[~matches].float().mean().item()


def train_digit_judge(directory: str | Path, seed: int = 0) -> JudgeTraining:
    """Fine-tune the judge from a random initialisation (full batch, both classes weighted
    equally) until every pair is judged right, and save it with its tokenizer to
    ``directory``."""
    started, cpu_started = time.monotonic(), time.process_time()
    threads = torch.get_num_threads()
    # One thread: a batch of 110 x 8 tokens is too small to share between threads, which on a
    # loaded machine mostly wait for each other.
    torch.set_num_threads(1)
    try:
        training = _train(directory, seed)
    finally:
        torch.set_num_threads(threads)
    return dataclasses.replace(
        training,
        seconds=time.monotonic() - started,
        cpu_seconds=time.process_time() - cpu_started,
    )


def _train(directory: str | Path, seed: int) -> JudgeTraining:
    # The judge's tokenizer has no chat template: the template's text is its whole prompt, as
    # in training (reward.judge.chat_template applies a template only when there is one).
    tokenizer = build_byte_tokenizer(chat_template=None)
    input_ids, labels, weights, first = _batch(tokenizer)
    model = build_hf_model(JUDGE_MODEL, seed=seed)
    model.train()
    model.requires_grad_(True)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    accuracy = (0.0, 0.0)
    step = 0
    while step < MAX_STEPS:
        logits = model(input_ids=input_ids).logits
        # Per-token losses, summed per pair (its verdict tokens), weighted per class.
        losses = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
        ).sum(1)
        loss = (losses * weights).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % CHECK_EVERY == 0:
            model.eval()
            accuracy = _accuracy(model, input_ids, labels, first)
            model.train()
            if min(accuracy) == 1.0:
                break
    model.eval()
    model.requires_grad_(False)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return JudgeTraining(step, 0.0, 0.0, *accuracy)


def write_digit_task(directory: str | Path) -> None:
    """The policy's task: ``prompts.jsonl`` (each digit's copying prompt, with the digit as its
    answer) and the synthetic tokenizer in ``tokenizer/``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_synthetic_tokenizer().save_pretrained(directory / "tokenizer")
    with open(directory / "prompts.jsonl", "w", encoding="utf-8") as rows:
        for answer in ANSWERS:
            rows.write(json.dumps({"prompt": f"{answer}<sep>", "answer": answer}) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write judge/, tokenizer/ ...")
    parser.add_argument("--seed", type=int, default=0, help="the judge's initialisation")
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_digit_task(out)
    training = train_digit_judge(out / "judge", seed=args.seed)
    print(
        f"judge: {training.steps} steps in {training.seconds:.1f} s ({training.cpu_seconds:.1f} s "
        f"of CPU); first verdict token right "
        f"on {training.match_accuracy:.0%} of the {len(ANSWERS)} matching pairs and "
        f"{training.mismatch_accuracy:.0%} of the {len(judge_pairs()) - len(ANSWERS)} others"
    )
    (out / TRAINING_RECORD).write_text(json.dumps(dataclasses.asdict(training)) + "\n")
    print(
        f"wrote {out / 'judge'}, {out / 'tokenizer'}, {out / 'prompts.jsonl'}, {out / TRAINING_RECORD}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
