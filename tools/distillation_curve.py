#!/usr/bin/env python
"""The CPU distillation preset's curve: a teacher trained on the CPU demo, a student distilled
from it (``examples/moe/cpu_demo_distill.yaml``), the student's reward and reverse KL per step
against the teacher's reward. docs/distillation.md's curve and table come from this script:

    python tools/distillation_curve.py --out outputs/distillation_curve --docs

1. The teacher: the CPU demo (``--preset cpu_demo``, its schema defaults: a 20-step supervised
   cold start, then 40 GSPO steps), its last checkpoint exported to Hugging Face format with
   the synthetic tokenizer (``OUT/teacher_hf``); ``--teacher-hf DIR`` uses an existing one.
2. The teacher's reward: its samples at the student's temperature on the task's held-out
   prompts, scored by the task's reward (the level the student can reach).
3. The student: ``--preset cpu_demo_distill models.teacher.hf_path=OUT/teacher_hf`` plus the
   ``--set`` overrides (a 10-step cold start, then pure on-policy distillation).

Writes ``OUT/curve.json`` (the numbers), ``OUT/curve.png`` (the plot), ``OUT/curve.md`` (the
table) and, with ``--docs``, the plot and the table into docs/ (between the markers of
docs/distillation.md). Every run is a real ``python -m megatron_gspo.train`` process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import megatron_gspo  # noqa: F401
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS_PAGE = REPO_ROOT / "docs" / "distillation.md"
DOCS_PLOT = REPO_ROOT / "docs" / "distillation_curve.png"
TABLE_START = "<!-- distillation_curve: start -->"
TABLE_END = "<!-- distillation_curve: end -->"
STUDENT_PRESET = "cpu_demo_distill"
TEACHER_PRESET = "cpu_demo"
CURVE_KEYS = ("reward_mean", "teacher_kl_per_token", "teacher_kl_per_sequence")
TEACHER_EVAL_PROMPTS = 64
"""Held-out prompts the teacher's reward is measured on (x the group size in samples)."""


def train_command(preset: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "megatron_gspo.train", "--preset", preset, *overrides]


def run(command: list[str], log_path: Path) -> None:
    """Run ``command`` with its output in ``log_path``; raise with the log's tail on failure."""
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    # One thread: the curve is measured as CI runs it (2 cores, one process).
    env.setdefault("OMP_NUM_THREADS", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        code = subprocess.call(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT
        )
    if code != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{' '.join(command)} exited with {code}:\n{tail}")


def train_teacher(out: Path, overrides: list[str]) -> Path:
    """The CPU demo trained and exported to ``out/teacher_hf`` (weights, config.json and the
    synthetic tokenizer); returns that directory."""
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.convert.export import (
        convert_torch_dist_to_hf,
        model_config_for_export,
        resolve_checkpoint_dir,
    )
    from megatron_gspo.data.tokenizer import build_synthetic_tokenizer

    run_dir = out / "teacher_run"
    steps = load_config(TEACHER_PRESET, overrides).steps
    run(
        train_command(
            TEACHER_PRESET,
            [
                f"output_dir={run_dir}",
                "overwrite_output_dir=true",
                f"checkpoint.interval={steps}",
                "logging.progress_bar=false",
                *overrides,
            ],
        ),
        out / "teacher_run.log",
    )
    checkpoint = resolve_checkpoint_dir(str(run_dir / "checkpoints"))
    hf_dir = out / "teacher_hf"
    model = model_config_for_export(checkpoint_dir=checkpoint)
    convert_torch_dist_to_hf(checkpoint, str(hf_dir), model, overwrite=True)
    build_synthetic_tokenizer().save_pretrained(str(hf_dir))
    return hf_dir


def teacher_reward(teacher_hf: Path, student_overrides: list[str]) -> float:
    """The teacher's mean reward over its samples (the student's group size and temperature)
    on the task's held-out prompts."""
    from megatron_gspo.config import ExtraModelConfig
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.data.synthetic import (
        EVAL_STREAM,
        draw_digits,
        score_digit_response,
        task_example,
    )
    from megatron_gspo.data.tokenizer import EOS_TOKEN_ID
    from megatron_gspo.rollout import GenerateRequest
    from megatron_gspo.rollout.roles import build_role_engine

    cfg = load_config(STUDENT_PRESET, [f"models.teacher.hf_path={teacher_hf}", *student_overrides])
    group = cfg.algo.num_return_sequences_in_group
    examples = [
        task_example(cfg.data.task, draw_digits(cfg.seed, EVAL_STREAM, index))
        for index in range(TEACHER_EVAL_PROMPTS)
    ]
    requests = [
        GenerateRequest(
            input_ids=prompt_ids,
            max_new_tokens=cfg.algo.response_length,
            temperature=cfg.rollout.temperature,
            stop_token_ids=[EOS_TOKEN_ID],
            seed=cfg.seed + index,
        )
        for index, (prompt_ids, _, _) in enumerate(examples)
    ]
    with build_role_engine("teacher", ExtraModelConfig(hf_path=str(teacher_hf))) as engine:
        results = engine.generate(requests, n=group)
    rewards = [
        score_digit_response(result.output_ids, examples[index // group][2])
        for index, result in enumerate(results)
    ]
    return sum(rewards) / len(rewards)


def train_student(out: Path, teacher_hf: Path, overrides: list[str]) -> list[dict]:
    run_dir = out / "student"
    run(
        train_command(
            STUDENT_PRESET,
            [
                f"output_dir={run_dir}",
                "overwrite_output_dir=true",
                f"models.teacher.hf_path={teacher_hf}",
                "logging.progress_bar=false",
                *overrides,
            ],
        ),
        out / "student.log",
    )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summarize(records: list[dict], reward_of_teacher: float, seconds: float) -> dict:
    steps = [record["step"] for record in records]
    return {
        "steps": steps,
        **{key: [float(record[key]) for record in records] for key in CURVE_KEYS},
        "teacher_reward": reward_of_teacher,
        "wall_time_s": seconds,
    }


def markdown_table(summary: dict, every: int) -> str:
    lines = [
        "| step | student reward_mean | teacher_kl_per_token | teacher_kl_per_sequence |",
        "|---:|---:|---:|---:|",
    ]
    last = len(summary["steps"]) - 1
    for index, step in enumerate(summary["steps"]):
        if step % every and index != last:
            continue
        values = " | ".join(f"{summary[key][index]:.3f}" for key in CURVE_KEYS)
        lines.append(f"| {step} | {values} |")
    lines.append(f"\nThe teacher's reward on held-out prompts: {summary['teacher_reward']:.3f}.\n")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward_axis, kl_axis) = plt.subplots(1, 2, figsize=(10, 3.6))
    reward_axis.plot(summary["steps"], summary["reward_mean"], label="student")
    reward_axis.axhline(summary["teacher_reward"], color="black", linestyle="--", label="teacher")
    reward_axis.set_xlabel("step")
    reward_axis.set_ylabel("reward_mean")
    reward_axis.set_ylim(0, 1.05)
    reward_axis.legend()
    kl_axis.plot(summary["steps"], summary["teacher_kl_per_token"])
    kl_axis.set_xlabel("step")
    kl_axis.set_ylabel("teacher_kl_per_token")
    figure.suptitle("CPU demo: a student distilled from a trained teacher (cpu_demo_distill)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_docs(summary: dict, plot_path: Path, table: str) -> None:
    """The plot into docs/, the table between the markers of docs/distillation.md."""
    DOCS_PLOT.write_bytes(plot_path.read_bytes())
    page = DOCS_PAGE.read_text()
    begin, end = page.index(TABLE_START), page.index(TABLE_END)
    DOCS_PAGE.write_text(page[: begin + len(TABLE_START)] + "\n" + table + "\n" + page[end:])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("outputs/distillation_curve"))
    parser.add_argument(
        "--teacher-hf", type=Path, help="an existing teacher (HF directory with the tokenizer)"
    )
    parser.add_argument(
        "--teacher-set", action="append", default=[], help="override of the teacher's run"
    )
    parser.add_argument(
        "--set", action="append", default=[], dest="overrides", help="override of the student's"
    )
    parser.add_argument("--every", type=int, default=5, help="table rows every this many steps")
    parser.add_argument("--docs", action="store_true", help="write the plot and table into docs/")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    teacher_hf = args.teacher_hf or train_teacher(args.out, args.teacher_set)
    reward_of_teacher = teacher_reward(teacher_hf, args.overrides)
    records = train_student(args.out, teacher_hf, args.overrides)
    summary = summarize(records, reward_of_teacher, time.perf_counter() - started)
    (args.out / "curve.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = markdown_table(summary, args.every)
    (args.out / "curve.md").write_text(table)
    plot(summary, args.out / "curve.png")
    if args.docs:
        write_docs(summary, args.out / "curve.png", table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
