"""The checks tools/container_rehearsal.sh runs inside the image's containers, one subcommand each.

Each exits non-zero with a message naming what does not hold, and prints one line of what it
saw when everything holds:

- ``run OUTPUT_DIR --steps N``: a finished run logged steps 0..N-1 in metrics.jsonl, once each,
  with finite losses;
- ``exactly-once OUTPUT_DIR --steps N``: every RL step has one line in trained_prompts.jsonl, and
  the trained prompts and those still pending in the newest checkpoint are the served ones, each
  exactly once (the rule of tests/e2e/test_async.py, ``assert_exactly_once``);
- ``sandbox``: the code sandbox isolates here (bubblewrap's probe), as the image's non-root user,
  and the code reward scores a correct program 1 and a wrong one 0 through it;
- ``hf-load DIR``: an exported Hugging Face directory loads with transformers and runs a forward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from pathlib import Path


class CheckFailed(Exception):
    """What the check found that does not hold."""


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise CheckFailed(f"{path} does not exist")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run(output_dir: Path, steps: int) -> str:
    records = read_jsonl(output_dir / "metrics.jsonl")
    logged = [record.get("step") for record in records]
    if logged != list(range(steps)):
        raise CheckFailed(f"metrics.jsonl logs steps {logged}, expected 0..{steps - 1} once each")
    losses = [record.get("policy_loss") for record in records]
    if not all(isinstance(loss, float) and math.isfinite(loss) for loss in losses):
        raise CheckFailed(f"expected a finite policy_loss on each of the {steps} steps: {losses}")
    first, last = records[0]["reward_mean"], records[-1]["reward_mean"]
    return (
        f"{output_dir}: steps 0..{steps - 1} logged once each, finite losses, "
        f"reward_mean {first:.3f} at step 0, {last:.3f} at step {steps - 1}"
    )


def newest_data_state(output_dir: Path) -> dict:
    root = output_dir / "checkpoints"
    latest = (root / "latest").read_text().strip()
    return json.loads((root / latest / "checkpoint.json").read_text())["extra_state"]["data"]


def check_exactly_once(output_dir: Path, steps: int) -> str:
    from megatron_gspo.driver.ledger import read_trained_prompts

    lines = read_trained_prompts(str(output_dir))
    logged = [line["step"] for line in lines]
    if logged != list(range(steps)):
        raise CheckFailed(f"trained_prompts.jsonl has steps {logged}, expected 0..{steps - 1}")
    trained = [prompt for line in lines for prompt in line["prompt_ids"]]
    state = newest_data_state(output_dir)
    counts = Counter(trained + list(state["pending_prompt_ids"]))
    twice = sorted(prompt for prompt, count in counts.items() if count > 1)
    if twice:
        raise CheckFailed(f"prompts trained (or pending) more than once: {twice}")
    if sorted(counts) != list(range(state["consumed"])):
        lost = sorted(set(range(state["consumed"])) - set(counts))
        raise CheckFailed(f"served prompts neither trained nor pending: {lost}")
    return (
        f"{output_dir}: {steps} steps, {len(trained)} prompts trained once each, "
        f"{len(state['pending_prompt_ids'])} pending, {state['consumed']} served"
    )


def check_sandbox() -> str:
    from megatron_gspo.reward import RewardInput
    from megatron_gspo.reward.code_execution import code_reward
    from megatron_gspo.reward.sandbox import check_isolation, run_python

    if os.getuid() == 0:
        raise CheckFailed("running as root: the image must train as its non-root user")
    check_isolation()  # raises SandboxUnavailableError with bubblewrap's reason and the fix
    seen = run_python(
        "import os; print(os.getuid(), sum(name.isdigit() for name in os.listdir('/proc')))"
    )
    if seen.returncode != 0:
        raise CheckFailed(f"a sandboxed program failed: {seen.stderr.strip()}")
    uid, processes = (int(word) for word in seen.stdout.split())
    # The sandbox's own user and process namespace: the program is nobody and sees only the
    # sandbox's init and itself, not the trainer's processes.
    if uid == os.getuid() or processes > 3:
        raise CheckFailed(f"the program ran as uid {uid} and saw {processes} processes")
    tests = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]

    def score(program: str) -> float:
        response = f"```python\n{program}\n```"
        return code_reward(RewardInput(prompt="add", response=response, metadata={"tests": tests}))

    right = score("a, b = map(int, input().split())\nprint(a + b)")
    wrong = score("a, b = map(int, input().split())\nprint(a - b)")
    if (right, wrong) != (1.0, 0.0):
        raise CheckFailed(f"code reward: correct program {right} (want 1.0), wrong {wrong} (0.0)")
    return (
        f"sandbox isolates as uid {os.getuid()}: the program ran as uid {uid} and saw "
        f"{processes} processes; code reward: correct 1.0, wrong 0.0"
    )


def check_hf_load(directory: Path) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    tokens = torch.arange(min(8, config.vocab_size)).unsqueeze(0)
    with torch.no_grad():
        logits = model(tokens).logits
    if tuple(logits.shape) != (1, tokens.shape[1], config.vocab_size):
        raise CheckFailed(f"logits of shape {tuple(logits.shape)} for {tokens.shape[1]} tokens")
    if not torch.isfinite(logits).all():
        raise CheckFailed("the exported model's logits are not finite")
    parameters = sum(parameter.numel() for parameter in model.parameters())
    return (
        f"{directory}: {type(model).__name__} ({config.model_type}, {parameters} parameters) "
        "loaded with transformers, forward finite"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "exactly-once"):
        command = commands.add_parser(name)
        command.add_argument("output_dir", type=Path)
        command.add_argument("--steps", type=int, required=True)
    commands.add_parser("sandbox")
    commands.add_parser("hf-load").add_argument("directory", type=Path)
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "run":
            print(check_run(arguments.output_dir, arguments.steps))
        elif arguments.command == "exactly-once":
            print(check_exactly_once(arguments.output_dir, arguments.steps))
        elif arguments.command == "sandbox":
            print(check_sandbox())
        else:
            print(check_hf_load(arguments.directory))
    except CheckFailed as failure:
        print(f"check {arguments.command} failed: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
