#!/usr/bin/env python
"""The CPU tool-use task trained synchronously and one step off-policy: the reward curves over
seeds, and the paired difference.

    python tools/agentic_async_curve.py --out docs/agentic_async --seeds 3

Runs ``python -m megatron_gspo.train --preset cpu_tool_use`` once per seed and variant (the
calculator unconfined, ``env.options.isolation=none``; the sandbox does not change the numbers).
``--variants`` picks them (default: ``sync async``):

* ``sync``: the preset as it is (``rollout.max_staleness=0``), the baseline of every comparison;
* ``async``: ``rollout.max_staleness=1`` with the sequence-level correction toward the engine's
  per-token behaviour log-probs (``algo.rollout_correction.level=sequence``, what docs/async.md
  recommends for GSPO one step off-policy); the old log-probs are recomputed (the preset's);
* ``async_token``: ``rollout.max_staleness=1`` with one truncated weight per token,
  ``min(pi_prox / mu, 2)`` (``algo.rollout_correction.level=token``: the decoupled objective's
  per-token behaviour weight, docs/async.md).

``--seeds N`` runs the seeds 1234 (the preset's), 1235, ... (``--seed-list`` names them); all
variants of a seed start from the same supervised cold start (the preset's 100 steps: the same
weights at RL step 0), so the runs of a seed are paired. The default, ``--seeds 1``, is the
preset's seed alone.

Every variant evaluates its weights on the same held-out prompts every ``--eval-every`` steps
(``eval.interval``; ``--eval-prompts`` prompts, ``data.num_eval_prompts``): one greedy episode
and ``eval.num_samples`` (4) sampled at ``eval.temperature`` (1.0, the training temperature)
per prompt. The training reward of step ``s`` is that of the episodes step ``s`` trains on,
which an asynchronous run sampled with the weights of the step before (and, for a turn after a
weight sync, of step ``s``): its training curve lags by up to one update for that reason alone.
The held-out reward is measured on the weights after the same number of updates in every run,
so it compares how much they learned, not when they sampled.

Writes ``OUT/summary.json`` (per variant and seed every step's reward and tool metrics, the mean
reward of the last ``--last`` steps, the area under the reward curve, the held-out rewards, the
wall time; per variant their means over seeds with a 95% interval; the paired difference of
each variant from sync per seed with its interval: ``tools/compare_statistics.py``),
``OUT/summary.md`` (the tables docs/agentic.md shows) and ``OUT/reward.png`` (each variant's
mean curve, with its 95% band over seeds). The runs go to ``--runs DIR``
(``DIR/seed_S/VARIANT``; default ``outputs/agentic_async``); ``--plot-only`` re-reads runs
already made, ``--reuse`` runs only the runs the tool has not finished before; ``--parallel``
runs a seed's variants at once (the seeds one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
from compare_statistics import (  # noqa: E402
    mean_interval,
    paired_difference,
    reward_curve_statistics,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

COMMON = ["--preset", "cpu_tool_use", "env.options.isolation=none", "logging.progress_bar=false"]
VARIANTS = {
    "sync": [],
    "async": ["rollout.max_staleness=1", "algo.rollout_correction.level=sequence"],
    "async_token": ["rollout.max_staleness=1", "algo.rollout_correction.level=token"],
}
DEFAULT_VARIANTS = ["sync", "async"]
BASELINE = "sync"
# The preset does not set ``seed``: TrainConfig's default (tests/tools checks they agree), so
# ``--seeds 1`` is the preset's own run.
PRESET_SEED = 1234
KEYS = (
    "reward_mean",
    "env/tool_success_frac",
    "env/done_frac",
    "staleness_mean",
    "partial_sample_frac",
    "eval/sampled_reward_mean",
    "eval/greedy_reward_mean",
)
# The held-out statistics, from the runs' evaluations (none in runs made without them).
HELD_OUT_KEYS = ("heldout_sampled_final", "heldout_sampled_mean", "heldout_greedy_final")
HELD_OUT_NAMES = {
    "heldout_sampled_final": "held-out reward, final weights",
    "heldout_sampled_mean": "held-out reward, mean over evaluations",
    "heldout_greedy_final": "held-out greedy reward, final weights",
}
# A finished run's record (its wall time and command), written by the tool after the run.
RUN_RECORD = "run.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="tools/agentic_async_curve.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, required=True, help="summary, table and plot")
    parser.add_argument(
        "--runs",
        type=Path,
        default=REPO_ROOT / "outputs" / "agentic_async",
        help="the runs' output directories (DIR/seed_S/VARIANT)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=DEFAULT_VARIANTS,
        help=f"the variants to run and compare (default: {' '.join(DEFAULT_VARIANTS)}; "
        f"{BASELINE} is the baseline and always runs)",
    )
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument(
        "--seeds", type=int, default=1, help=f"seeds {PRESET_SEED}, {PRESET_SEED + 1}, ..."
    )
    seeds.add_argument("--seed-list", type=int, nargs="+", default=None, help="these seeds")
    parser.add_argument("--steps", type=int, default=None, help="RL steps (default: the preset's)")
    parser.add_argument("--last", type=int, default=10, help="steps of the final mean reward")
    parser.add_argument("--every", type=int, default=3, help="table rows every this many steps")
    parser.add_argument(
        "--eval-every", type=int, default=5, help="evaluate every this many steps (eval.interval)"
    )
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=32,
        help="held-out prompts of each evaluation (data.num_eval_prompts)",
    )
    parser.add_argument("--parallel", action="store_true", help="run a seed's variants at once")
    parser.add_argument("--plot-only", action="store_true", help="only read the runs in --runs")
    parser.add_argument(
        "--reuse", action="store_true", help="skip the runs this tool already finished in --runs"
    )
    parser.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.seed_list is None:
        if args.seeds < 1:
            parser.error("--seeds must be at least 1")
        args.seed_list = [PRESET_SEED + index for index in range(args.seeds)]
    if args.eval_every < 1 or args.eval_prompts < 1:
        parser.error("--eval-every and --eval-prompts must be at least 1")
    if len(set(args.seed_list)) != len(args.seed_list):
        parser.error(f"--seed-list repeats a seed: {args.seed_list}")
    # The baseline first: the tables and the paired differences are read against it.
    args.variants = [BASELINE, *dict.fromkeys(v for v in args.variants if v != BASELINE)]
    return args


def run_directory(runs: Path, seed: int, variant: str) -> Path:
    return runs / f"seed_{seed}" / variant


def command(variant: str, seed: int, output_dir: Path, args: argparse.Namespace) -> list[str]:
    steps = [] if args.steps is None else [f"steps={args.steps}"]
    return [
        sys.executable,
        "-m",
        "megatron_gspo.train",
        *COMMON,
        f"eval.interval={args.eval_every}",
        f"data.num_eval_prompts={args.eval_prompts}",
        *VARIANTS[variant],
        *steps,
        f"seed={seed}",
        *args.overrides,  # after seed=: an explicit override wins
        "overwrite_output_dir=true",
        f"output_dir={output_dir}",
    ]


def run_seed(args: argparse.Namespace, seed: int) -> None:
    """Run one seed's variants (one after the other, or ``--parallel``); each finished run
    leaves its :data:`RUN_RECORD` (wall seconds, command) beside its metrics."""
    environment = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    pending = {}
    for variant in args.variants:
        directory = run_directory(args.runs, seed, variant)
        if args.reuse and (directory / RUN_RECORD).exists():
            continue
        directory.parent.mkdir(parents=True, exist_ok=True)
        arguments = command(variant, seed, directory, args)
        log = (directory.parent / f"{variant}.log").open("w")
        process = subprocess.Popen(
            arguments, cwd=REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT
        )
        pending[variant] = (process, time.time(), arguments)
        if not args.parallel:
            finish(variant, seed, *pending.pop(variant), args.runs)
    while pending:  # --parallel: each run's own end
        for variant in [v for v, (process, _, _) in pending.items() if process.poll() is not None]:
            finish(variant, seed, *pending.pop(variant), args.runs)
        time.sleep(1.0)


def finish(
    variant: str,
    seed: int,
    process: subprocess.Popen,
    started: float,
    arguments: list[str],
    runs: Path,
) -> None:
    directory = run_directory(runs, seed, variant)
    if process.wait() != 0:
        raise SystemExit(
            f"the {variant} run of seed {seed} failed ({process.returncode}): "
            f"{directory.parent / variant}.log"
        )
    record = {"wall_s": time.time() - started, "command": arguments[1:]}
    (directory / RUN_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(rows: list[dict], last: int) -> dict:
    """One run: every step's :data:`KEYS`, the reward of the first step (the cold start's,
    before any RL update), the mean reward of the last ``last`` steps, and the area under the
    reward curve per step (``reward_auc``: how much reward the run earned on its way). With
    evaluations, :data:`HELD_OUT_KEYS`: the held-out sampled reward of the last evaluation and
    its mean over the evaluations, and the last evaluation's greedy reward."""
    final = rows[-last:]
    rewards = [r["reward_mean"] for r in rows]
    # Only the area is used: the threshold and the collapse drop do not enter it.
    curve = reward_curve_statistics(rewards, threshold=1.0, collapse_drop=1.0)
    summary = {
        "steps": [{"step": r["step"], **{k: r[k] for k in KEYS if k in r}} for r in rows],
        "reward_first": rewards[0],
        f"reward_mean_last_{last}": sum(r["reward_mean"] for r in final) / len(final),
        "reward_last": rewards[-1],
        "reward_auc": curve["reward_auc"],
    }
    evaluations = [r for r in rows if "eval/sampled_reward_mean" in r]
    if evaluations:
        sampled = [r["eval/sampled_reward_mean"] for r in evaluations]
        summary["heldout_sampled_final"] = sampled[-1]
        summary["heldout_sampled_mean"] = sum(sampled) / len(sampled)
        summary["heldout_greedy_final"] = evaluations[-1]["eval/greedy_reward_mean"]
    return summary


def statistics_keys(last: int, held_out: bool = False) -> tuple[str, ...]:
    keys = ("reward_first", f"reward_mean_last_{last}", "reward_auc")
    return keys + HELD_OUT_KEYS if held_out else keys


def summarize(records: dict[str, dict[int, list[dict]]], last: int) -> dict:
    """``records``: per variant, per seed, the run's metrics rows. Per variant each seed's
    :func:`summarize_run` and their means over seeds (95% Student-t intervals); the paired
    difference of each variant from :data:`BASELINE` over the seeds both have."""
    summary: dict = {"last": last, "seeds": [], "variants": {}, "paired": {}}
    per_seed: dict[str, dict[int, dict]] = {
        variant: {seed: summarize_run(rows, last) for seed, rows in by_seed.items()}
        for variant, by_seed in records.items()
    }
    # The held-out statistics only when every run evaluated.
    summary["held_out"] = all(
        HELD_OUT_KEYS[0] in values for runs in per_seed.values() for values in runs.values()
    )
    keys = statistics_keys(last, summary["held_out"])
    for variant in records:
        summary["variants"][variant] = {
            "per_seed": {str(seed): values for seed, values in per_seed[variant].items()},
            **{key: mean_interval([v[key] for v in per_seed[variant].values()]) for key in keys},
        }
    summary["seeds"] = sorted(set().union(*(set(by_seed) for by_seed in records.values())))
    for variant in records:
        if variant == BASELINE or BASELINE not in records:
            continue
        summary["paired"][f"{variant} - {BASELINE}"] = {
            key: paired_difference(
                {seed: values[key] for seed, values in per_seed[variant].items()},
                {seed: values[key] for seed, values in per_seed[BASELINE].items()},
            )
            for key in keys
        }
    return summary


def mean_curves(summary: dict, key: str) -> dict[str, dict[int, dict]]:
    """Per variant, per step: ``key``'s mean over the seeds with its interval."""
    curves = {}
    for variant, data in summary["variants"].items():
        by_step: dict[int, list[float]] = {}
        for values in data["per_seed"].values():
            for row in values["steps"]:
                if key in row:
                    by_step.setdefault(row["step"], []).append(row[key])
        curves[variant] = {step: mean_interval(by_step[step]) for step in sorted(by_step)}
    return curves


def interval_text(interval: dict, digits: int = 3) -> str:
    if interval["mean"] is None:
        return "n/a"
    if interval["low"] is None:
        return f"{interval['mean']:.{digits}f} (n={interval['n']})"
    return f"{interval['mean']:.{digits}f} [{interval['low']:.{digits}f}, {interval['high']:.{digits}f}]"


def verdict(difference: dict, name: str) -> str:
    """What the paired interval of ``name`` (``variant - baseline``) says, in words."""
    variant, baseline = name.split(" - ")
    if difference["excludes_zero"] is None:
        return "one seed: no interval, so no conclusion"
    if difference["low"] > 0:
        return f"{variant} above {baseline} (the interval excludes zero)"
    if difference["high"] < 0:
        return f"{variant} below {baseline} (the interval excludes zero)"
    return (
        f"no difference detected: the interval contains zero; {variant} is at most "
        f"{-difference['low']:.3f} below {baseline} at 95%"
    )


def markdown(summary: dict, every: int) -> str:
    """The mean curves every ``every`` steps, the per-seed values, and the statistics over
    seeds with the paired difference."""
    last = summary["last"]
    final_key = f"reward_mean_last_{last}"
    variants = list(summary["variants"])
    rewards = mean_curves(summary, "reward_mean")
    tools = mean_curves(summary, "env/tool_success_frac")
    seeds = summary["seeds"]
    lines = [
        f"Seeds {seeds}; values are means over the seeds (n={len(seeds)}).",
        "",
        "| step | " + " | ".join(f"{v} reward_mean | {v} tool_success" for v in variants) + " |",
        "|---:|" + "---:|---:|" * len(variants),
    ]
    steps = sorted(set.intersection(*(set(rewards[v]) for v in variants)))
    for step in [s for s in steps if s % every == 0 or s == steps[-1]]:
        cells = []
        for variant in variants:
            tool = tools[variant].get(step, {"mean": 0.0})["mean"]
            cells.append(f"{rewards[variant][step]['mean']:.3f} | {tool:.3f}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Per seed: the mean reward of the last {last} steps and the area under the reward "
        "curve per step (AUC).",
        "",
        "| seed | "
        + " | ".join(f"{v} last {last} | {v} AUC" for v in variants)
        + "".join(f" | {name} last {last}" for name in summary["paired"])
        + " |",
        "|---:|" + "---:|---:|" * len(variants) + "---:|" * len(summary["paired"]),
    ]
    for seed in seeds:
        cells = []
        values = {v: summary["variants"][v]["per_seed"].get(str(seed)) for v in variants}
        for variant in variants:
            if values[variant] is None:
                cells.append("n/a | n/a")
            else:
                cells.append(
                    f"{values[variant][final_key]:.3f} | {values[variant]['reward_auc']:.3f}"
                )
        for name in summary["paired"]:
            first, second = (values[v] for v in name.split(" - "))
            present = first is not None and second is not None
            cells.append(f"{first[final_key] - second[final_key]:+.3f}" if present else "n/a")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Over the seeds: mean [95% Student-t interval]; the paired difference is taken seed by "
        "seed (the same seed's runs share their cold start).",
        "",
        f"| | reward at step 0 | reward, last {last} steps | reward AUC |",
        "|---|---:|---:|---:|",
    ]
    lines += statistics_rows(summary, statistics_keys(last))
    lines.append("")
    for name, differences in summary["paired"].items():
        lines.append(f"- `{name}`, last {last} steps: {verdict(differences[final_key], name)}")
        lines.append(f"- `{name}`, reward AUC: {verdict(differences['reward_auc'], name)}")
    if summary.get("held_out"):
        lines += ["", *held_out_markdown(summary)]
    return "\n".join(lines) + "\n"


def statistics_rows(summary: dict, keys: tuple[str, ...]) -> list[str]:
    """Per variant and per paired difference, ``keys``' means with their intervals."""
    rows = []
    for variant, data in summary["variants"].items():
        rows.append(f"| `{variant}` | " + " | ".join(interval_text(data[k]) for k in keys) + " |")
    for name, differences in summary["paired"].items():
        cells = " | ".join(interval_text(differences[k]) for k in keys)
        rows.append(f"| `{name}` (paired) | {cells} |")
    return rows


def held_out_markdown(summary: dict) -> list[str]:
    """The evaluations: the mean held-out rewards after each evaluated step, and their
    statistics over the seeds with the paired difference."""
    variants = list(summary["variants"])
    sampled = mean_curves(summary, "eval/sampled_reward_mean")
    greedy = mean_curves(summary, "eval/greedy_reward_mean")
    lines = [
        "Held-out evaluation: the weights after the same number of updates in every run, on the "
        "same held-out prompts (sampled episodes at the training temperature, and greedy ones).",
        "",
        "| updates | " + " | ".join(f"{v} held-out reward | {v} greedy" for v in variants) + " |",
        "|---:|" + "---:|---:|" * len(variants),
    ]
    for step in sorted(set.intersection(*(set(sampled[v]) for v in variants))):
        cells = [
            f"{sampled[v][step]['mean']:.3f} | {greedy[v][step]['mean']:.3f}" for v in variants
        ]
        lines.append(f"| {step + 1} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| | " + " | ".join(HELD_OUT_NAMES[key] for key in HELD_OUT_KEYS) + " |",
        "|---|" + "---:|" * len(HELD_OUT_KEYS),
        *statistics_rows(summary, HELD_OUT_KEYS),
        "",
    ]
    for name, differences in summary["paired"].items():
        for key in HELD_OUT_KEYS:
            lines.append(f"- `{name}`, {HELD_OUT_NAMES[key]}: {verdict(differences[key], name)}")
    return lines


def plot(summary: dict, path: Path) -> None:
    """Each variant's mean curve over the seeds, with its 95% interval as a band (none with
    one seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("reward_mean", "env/tool_success_frac")
    if summary.get("held_out"):
        keys += ("eval/sampled_reward_mean",)
    figure, axes = plt.subplots(1, len(keys), figsize=(5.0 * len(keys), 3.4), squeeze=False)
    for axis, key in zip(axes[0], keys):
        # An evaluation logged with step s is of the weights after s + 1 updates (the table's).
        shift = 1 if key.startswith("eval/") else 0
        for variant, curve in mean_curves(summary, key).items():
            steps = list(curve)
            line = axis.plot(
                [s + shift for s in steps],
                [curve[s]["mean"] for s in steps],
                marker=".",
                label=variant,
            )
            banded = [s for s in steps if curve[s]["low"] is not None]
            if banded:
                axis.fill_between(
                    [s + shift for s in banded],
                    [curve[s]["low"] for s in banded],
                    [curve[s]["high"] for s in banded],
                    color=line[0].get_color(),
                    alpha=0.2,
                )
        axis.set_xlabel("updates" if shift else "RL step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
        axis.legend()
    seeds = len(summary["seeds"])
    band = ", 95% band" if seeds > 1 else ""
    figure.suptitle(
        f"cpu_tool_use: synchronous against max_staleness=1 (mean of {seeds} seeds{band})"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not args.plot_only:
        for seed in args.seed_list:
            run_seed(args, seed)
    records = {
        variant: {
            seed: read_records(run_directory(args.runs, seed, variant) / "metrics.jsonl")
            for seed in args.seed_list
        }
        for variant in args.variants
    }
    summary = summarize(records, args.last)
    for variant in args.variants:
        for seed in args.seed_list:
            record = run_directory(args.runs, seed, variant) / RUN_RECORD
            if record.exists():  # runs made by this tool; none for runs made otherwise
                wall = json.loads(record.read_text())["wall_s"]
                summary["variants"][variant]["per_seed"][str(seed)]["wall_s"] = wall
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    table = markdown(summary, args.every)
    (args.out / "summary.md").write_text(table)
    plot(summary, args.out / "reward.png")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
