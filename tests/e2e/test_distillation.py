"""On-policy distillation end to end: a student distilled from a teacher that solves the CPU
demo's task, through ``tools/distillation_curve.py`` (the command docs/distillation.md's curve
comes from) and real ``python -m megatron_gspo.train`` runs.

CI (default tier): the teacher is the CPU demo's model fine-tuned on the task's reference
answers in the fixture (a few seconds of plain torch on the transformers model, no trainer
launch), the student the ``cpu_demo_distill`` preset cut to 20 steps. The full
curve (the teacher trained by the CPU demo's own run, the preset at its size) is slow-tier.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.data.synthetic import (
    TRAIN_STREAM,
    correct_response_ids,
    draw_digits,
    task_example,
)
from megatron_gspo.data.tokenizer import build_synthetic_tokenizer
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.weight_sync import write_hf_checkpoint

from .harness import REPO_ROOT, subprocess_env

TOOL = REPO_ROOT / "tools" / "distillation_curve.py"
SMALL = ("steps=20",)
"""The preset cut to 20 of its 30 steps (at a quarter of its batch, 14 steps of GSPO-token's
tight clip moved the student too little to tell from noise)."""


def fine_tuned_teacher(directory: Path, steps: int = 40, batch_size: int = 32) -> Path:
    """The CPU demo's model (the schema's model section) fine-tuned by maximum likelihood on
    digit_copy's reference answers (prompts of a seed the student never sees), saved as a
    Hugging Face directory with the synthetic tokenizer."""
    model_config = ModelConfig()
    engine = EmbeddedEngine(model_config, seed=7)
    model = engine.hf_model
    model.requires_grad_(True).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator_seed = 99
    for step in range(steps):
        rows = []
        for index in range(batch_size):
            digits = draw_digits(generator_seed, TRAIN_STREAM, step * batch_size + index)
            prompt_ids, _, answer = task_example("digit_copy", digits)
            rows.append(prompt_ids + correct_response_ids(answer))
        tokens = torch.tensor(rows)
        prompt_length = len(prompt_ids)
        # Position prompt_length - 1 + j predicts response token j.
        logits = model(input_ids=tokens).logits[:, prompt_length - 1 : -1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, prompt_length:].reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.requires_grad_(False).eval()
    write_hf_checkpoint(
        engine.hf_state(),
        str(directory),
        config_json=hf_config_from_model_config(model_config).to_json_string(),
    )
    build_synthetic_tokenizer().save_pretrained(str(directory))
    engine.close()
    return directory


@pytest.fixture(scope="module")
def teacher_hf(tmp_path_factory) -> Path:
    return fine_tuned_teacher(tmp_path_factory.mktemp("teacher") / "hf")


def run_tool(arguments: list[str], timeout: float) -> dict:
    result = subprocess.run(
        [sys.executable, str(TOOL), *arguments],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    out = Path(arguments[arguments.index("--out") + 1])
    return json.loads((out / "curve.json").read_text())


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_student_catches_up_with_the_teacher(teacher_hf, tmp_path):
    overrides = [argument for item in SMALL for argument in ("--set", item)]
    curve = run_tool(
        ["--out", str(tmp_path / "curve"), "--teacher-hf", str(teacher_hf), *overrides],
        timeout=900,
    )
    assert curve["steps"] == list(range(20))
    teacher = curve["teacher_reward"]
    assert teacher > 0.8, "the fixture's teacher does not solve the task"
    kl, reward = curve["teacher_kl_per_token"], curve["reward_mean"]
    first, last = slice(0, 3), slice(-3, None)
    # The reverse KL to the teacher falls, and the task reward rises towards the teacher's.
    assert mean(kl[last]) < 0.75 * mean(kl[first]), kl
    assert mean(reward[last]) > mean(reward[first]) + 0.15, reward
    assert teacher - mean(reward[last]) < 0.75 * (teacher - mean(reward[first])), (teacher, reward)
    # Per sequence: the sum over a response's tokens, so larger than per token.
    assert all(s > t for s, t in zip(curve["teacher_kl_per_sequence"], kl) if t > 0)
    assert (tmp_path / "curve" / "curve.png").stat().st_size > 0


@pytest.mark.slow
def test_full_distillation_curve(tmp_path):
    """The whole command of docs/distillation.md: the CPU demo trained as the teacher, the
    preset at its size; the student ends within reach of the teacher."""
    curve = run_tool(["--out", str(tmp_path / "curve")], timeout=3600)
    teacher, reward = curve["teacher_reward"], curve["reward_mean"]
    assert mean(curve["teacher_kl_per_token"][-5:]) < 0.5 * mean(curve["teacher_kl_per_token"][:3])
    assert mean(reward[-5:]) > 0.8 * teacher, (teacher, reward[-5:])
