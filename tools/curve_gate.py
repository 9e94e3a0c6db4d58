#!/usr/bin/env python
"""Learning curves as regression gates: a change that moves a curve out of the band that seed
variation spans fails, naming the step and the metric. Two gates (``--gate``): the CPU demo
(``demo``, the default) and the compare tool's quick suite (``compare_quick``:
``tools/compare_grpo_gspo.py --quick``, each variant's curves).

    python tools/curve_gate.py --check                 # run the demo, compare with the reference
    python tools/curve_gate.py --check --metrics FILE  # compare a finished demo's metrics.jsonl
    python tools/curve_gate.py --update --seeds 8      # rerun the reference (a deliberate act)
    python tools/curve_gate.py --gate compare_quick --check              # the quick suite
    python tools/curve_gate.py --gate compare_quick --check --metrics DIR  # a finished --out
    python tools/curve_gate.py --gate compare_quick --update --seeds 8

The reference (:data:`REFERENCE`) holds, for each gated metric and RL step, the mean and the
standard deviation across ``--seeds`` runs of the demo (seeds 1234, 1235, ...: the initial
weights, the prompt order and sampling all change with the seed) of the metric's trailing mean
over :data:`WINDOW` steps, and the band: a 99.9% Student-t prediction interval for one more
seed's curve, ``mean +- (t(0.9995, n - 1) * std * sqrt(1 + 1 / n) + FLOOR)``. ``--check`` runs
the demo at its default seed (1234, one of the reference's) and fails where a gated metric's
trailing mean stays out of the band for :data:`MIN_STEPS_OUT` steps in a row, naming the steps
and the metric. On the CPU that made the reference the default seed's curve is one of the
reference's curves; on another CPU class (AVX2 and AVX-512 kernels round differently, and
sampling amplifies rounding over tens of steps) it is another draw of the same spread, which the
prediction interval is made to hold: one step out of it happens for 1 in 1000 draws, several in a
row far less often, while a change that breaks learning leaves the band for tens of steps.
``tests/docs/test_curve_gate.py`` runs ``--check`` in CI.

The quick suite's gate is the same band over each variant's curves (``gspo/reward_mean``,
``grpo/clip_frac_token``, ...): its six RL steps of 16 samples after a 10-step cold start make
a wide band, which still fails a change that stops a variant learning or moves its clipping
(GSPO clips about two orders of magnitude more tokens than GRPO there) for three steps in a row.
It runs with ``--one-process --no-plots`` (the variants' curves are the same as one process
each: ``tests/tools/test_compare_families.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from compare_statistics import t_quantile, trailing_means
from readme_demo import REPO_ROOT, cpu_name, read_records, run_demo

REFERENCES = REPO_ROOT / "tools" / "curve_references"
REFERENCE = REFERENCES / "cpu_demo.json"
GATED = ("reward_mean", "entropy")
"""The demo's gated metrics: what the policy earns, and how sure it has become."""
COMPARE_VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2", "grpo_r3")
"""The quick suite's variants (``tools/compare_grpo_gspo.py``, suite ``standard``)."""
COMPARE_METRICS = ("reward_mean", "clip_frac_token")
"""Each variant's gated metrics: what it earns, and how much of it the clip removes."""
CLIP_RATIO = "gspo_over_grpo/log10_clip_frac_token"
"""The suite's point as one number per step: log10 of GSPO's clipped-token share over GRPO's
(about 1.5: GSPO's sequence clip removes some thirty times GRPO's tokens), each floored at
:data:`CLIP_FLOOR`; paired on one seed, so it spreads less across seeds than either share."""
CLIP_FLOOR = 1e-3
"""Below a fifth of one token of a quick step's ~190: a share of 0 counts as this."""
COMPARE_TOOL = REPO_ROOT / "tools" / "compare_grpo_gspo.py"
WINDOW = 5
"""Steps in the trailing mean (one step's reward over 8 samples is noisy)."""
COVERAGE = 0.999
"""Two-sided coverage of the band: the prediction interval of one more seed's value."""
FLOOR = 0.02
"""Added to the band's half-width: the spread between CPU classes at the first steps, where the
seeds' spread is smallest (tools/readme_demo.py's tolerance)."""
MIN_STEPS_OUT = 3
"""Steps in a row out of the band that fail the gate (one step out is noise at 1 in 1000)."""
DEFAULT_SEED = 1234


def curve(records: list[dict], metric: str) -> list[float]:
    """The trailing means of ``metric`` over a run's records, in step order (none when no record
    has it: a variant that did not run)."""
    ordered = sorted(
        (record for record in records if metric in record), key=lambda record: record["step"]
    )
    steps = [record["step"] for record in ordered]
    if steps != list(range(len(steps))):
        raise ValueError(f"the run's steps are not 0, 1, 2, ...: {steps}")
    return trailing_means([float(record[metric]) for record in ordered], WINDOW)


def half_width(std: float, runs: int) -> float:
    """Half the band's width at a step whose ``runs`` seeds spread by ``std``."""
    t = t_quantile((1 + COVERAGE) / 2, runs - 1)
    return t * std * math.sqrt(1 + 1 / runs) + FLOOR


def reference_from_runs(runs: list[list[dict]], seeds: list[int], gate: Gate | None = None) -> dict:
    """The reference of runs at ``seeds`` (each a list of metric records) for ``gate`` (the
    demo's when None)."""
    gate = gate or GATES["demo"]
    metrics = {}
    for metric in gate.gated:
        curves = [curve(records, metric) for records in runs]
        steps = min(len(c) for c in curves)
        means, stds, lows, highs = [], [], [], []
        for step in range(steps):
            values = [c[step] for c in curves]
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1))
            half = half_width(std, len(values))
            means.append(round(mean, 6))
            stds.append(round(std, 6))
            lows.append(round(mean - half, 6))
            highs.append(round(mean + half, 6))
        metrics[metric] = {"mean": means, "std": stds, "low": lows, "high": highs}
    return {
        "command": gate.command,
        "seeds": seeds,
        "window": WINDOW,
        "band": f"mean +- (t({(1 + COVERAGE) / 2}, n - 1) * std * sqrt(1 + 1/n) + {FLOOR})",
        "min_steps_out": MIN_STEPS_OUT,
        "cpu": cpu_name(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        "metrics": metrics,
        # Each seed's curves, so that a new gated metric's band needs no rerun.
        "runs": {
            str(seed): {
                metric: [round(v, 6) for v in curve(records, metric)] for metric in gate.gated
            }
            for seed, records in zip(seeds, runs)
        },
    }


def band_violations(reference: dict, records: list[dict]) -> list[str]:
    """Each stretch of at least ``min_steps_out`` steps in a row where a gated metric's trailing
    mean is out of the reference's band, named by its steps and its first value."""
    problems = []
    for metric, band in reference["metrics"].items():
        values = curve(records, metric)
        if len(values) < len(band["mean"]):
            problems.append(
                f"{metric}: the run has {len(values)} steps, the reference {len(band['mean'])}"
            )
        out = [
            step
            for step, (value, low, high) in enumerate(zip(values, band["low"], band["high"]))
            if not low <= value <= high
        ]
        for first, last in _stretches(out):
            if last - first + 1 < reference["min_steps_out"]:
                continue
            value, low, high = values[first], band["low"][first], band["high"][first]
            problems.append(
                f"steps {first}-{last} {metric} (mean of the last {reference['window']} steps): "
                f"out of the band of {len(reference['seeds'])} seeds; at step {first} {value:.4f} "
                f"is outside [{low:.4f}, {high:.4f}]"
            )
    return problems


def _stretches(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive numbers in the sorted ``steps`` as (first, last)."""
    stretches: list[tuple[int, int]] = []
    for step in steps:
        if stretches and stretches[-1][1] == step - 1:
            stretches[-1] = (stretches[-1][0], step)
        else:
            stretches.append((step, step))
    return stretches


def _commit() -> str:
    result = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    )
    return result.stdout.strip() or "unknown"


def _run_demo_seed(seed: int, folder: Path) -> list[dict]:
    extra = [] if seed == DEFAULT_SEED else [f"seed={seed}"]
    records, _ = run_demo(None, folder / f"seed_{seed}", extra)
    return records


def _run_compare_seed(seed: int, folder: Path) -> list[dict]:
    out = folder / f"seed_{seed}"
    subprocess.run(
        [sys.executable, str(COMPARE_TOOL), "--quick", "--one-process", "--no-plots"]
        + ["--seed", str(seed), "--out", str(out)],
        cwd=REPO_ROOT,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    return read_compare_records(out)


def read_compare_records(out: Path) -> list[dict]:
    """One record per RL step of a quick suite's ``--out``: each variant's gated metrics as
    ``variant/metric`` (a variant without a finished run is missing, which the gate names)."""
    by_step: dict[int, dict] = {}
    for variant in COMPARE_VARIANTS:
        path = out / variant / "metrics.jsonl"
        if not path.exists():
            continue
        for record in read_records(path):
            row = by_step.setdefault(record["step"], {"step": record["step"]})
            for metric in COMPARE_METRICS:
                if metric in record:
                    row[f"{variant}/{metric}"] = record[metric]
    for row in by_step.values():
        gspo, grpo = row.get("gspo/clip_frac_token"), row.get("grpo/clip_frac_token")
        if gspo is not None and grpo is not None:
            row[CLIP_RATIO] = math.log10(max(gspo, CLIP_FLOOR) / max(grpo, CLIP_FLOOR))
    return [by_step[step] for step in sorted(by_step)]


@dataclasses.dataclass(frozen=True)
class Gate:
    """A gated curve: its reference file, metrics, how one seed runs, and how a finished run's
    ``--metrics`` is read."""

    reference: Path
    gated: tuple[str, ...]
    command: str
    run_seed: Callable[[int, Path], list[dict]]
    read: Callable[[Path], list[dict]]


GATES = {
    "demo": Gate(
        REFERENCE, GATED, "python -m megatron_gspo.train seed=<seed>", _run_demo_seed, read_records
    ),
    "compare_quick": Gate(
        REFERENCES / "compare_quick.json",
        (*(f"{v}/{m}" for v in COMPARE_VARIANTS for m in COMPARE_METRICS), CLIP_RATIO),
        "python tools/compare_grpo_gspo.py --quick --one-process --no-plots --seed <seed>",
        _run_compare_seed,
        read_compare_records,
    ),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true", help="compare a run with the reference")
    action.add_argument("--update", action="store_true", help="rerun and rewrite the reference")
    parser.add_argument(
        "--gate",
        choices=list(GATES),
        default="demo",
        help="the CPU demo's curves (default) or each variant's of the compare tool's --quick",
    )
    parser.add_argument(
        "--metrics",
        type=Path,
        help="--check: a finished run's metrics.jsonl (demo) or --out folder (compare_quick)",
    )
    parser.add_argument("--seeds", type=int, default=8, help="--update: runs (default 8)")
    args = parser.parse_args(argv)
    gate = GATES[args.gate]
    if args.update:
        if args.seeds < 3:
            parser.error("--seeds must be at least 3: the band is a spread across seeds")
        seeds = [DEFAULT_SEED + index for index in range(args.seeds)]
        with tempfile.TemporaryDirectory() as folder:
            runs = [gate.run_seed(seed, Path(folder)) for seed in seeds]
        gate.reference.parent.mkdir(parents=True, exist_ok=True)
        reference = reference_from_runs(runs, seeds, gate)
        gate.reference.write_text(json.dumps(reference, indent=1) + "\n")
        print(f"wrote {gate.reference} from seeds {seeds}")
        return 0
    reference = json.loads(gate.reference.read_text())
    if args.metrics is not None:
        records = gate.read(args.metrics)
    else:
        with tempfile.TemporaryDirectory() as folder:
            records = gate.run_seed(DEFAULT_SEED, Path(folder))
    problems = band_violations(reference, records)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(
            f"the {args.gate} curves left the band of the reference: find what moved them; if "
            "the change is meant, rerun the reference with python tools/curve_gate.py "
            f"--gate {args.gate} --update",
            file=sys.stderr,
        )
        return 1
    print(f"the {args.gate} curves are within the band of {len(reference['seeds'])} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
