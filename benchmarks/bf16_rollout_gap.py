"""The train-rollout log-prob gap of a bf16 trainer (``model.dtype=bfloat16``) with a bf16 rollout
engine (``rollout.dtype=bfloat16``), against an fp32 trainer with the same bf16 engine.

Each combination of ``--pairs`` (trainer dtype / rollout dtype) is one run of
``python -m megatron_gspo.train`` with the same seed and overrides (default: the CPU demo, the
built-in synthetic task, ``--steps`` steps, old log-probs recomputed by the trainer). The runs
report, per step, on the tokens of the step's samples: ``rollout_log_prob_abs_diff`` (token mean
of ``|lp_trainer - lp_rollout|``) and ``rollout_kl_k3`` (token mean of the k3 KL estimate of the
rollout policy from the trainer's); the table gives their mean over the steps. The fp32 / fp32
pair is the control (the embedded engine in fp32 is the trainer's twin: ~1e-7).

Usage (from the repository root)::

    python benchmarks/bf16_rollout_gap.py
    python benchmarks/bf16_rollout_gap.py --steps 6 --override model.hidden_size=128
    python benchmarks/bf16_rollout_gap.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

REPOSITORY = Path(__file__).resolve().parents[1]
METRICS = ("rollout_log_prob_abs_diff", "rollout_kl_k3")
DEFAULT_PAIRS = "float32/float32,float32/bfloat16,bfloat16/bfloat16,bfloat16/float32"


def run_pair(trainer: str, rollout: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One training run; the per-step gap metrics from its ``metrics.jsonl``."""
    output = root / f"{trainer}-{rollout}"
    command = [
        sys.executable,
        "-m",
        "megatron_gspo.train",
        f"steps={args.steps}",
        f"model.dtype={trainer}",
        f"rollout.dtype={rollout}",
        "logging.progress_bar=false",
        f"output_dir={output}",
        *args.override,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        command, cwd=REPOSITORY, env=env, capture_output=True, text=True, timeout=1800
    )
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    per_step = {name: [record[name] for record in records if name in record] for name in METRICS}
    return {
        "trainer": trainer,
        "rollout": rollout,
        "per_step": per_step,
        "mean": {name: statistics.fmean(values) for name, values in per_step.items() if values},
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="trainer/rollout dtypes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--override", nargs="*", default=[], help="more train overrides")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    pairs = [tuple(pair.split("/")) for pair in args.pairs.split(",")]
    with tempfile.TemporaryDirectory(prefix="bf16_rollout_gap_") as root:
        results = [run_pair(trainer, rollout, args, Path(root)) for trainer, rollout in pairs]
    if args.json:
        print(json.dumps({"steps": args.steps, "override": args.override, "runs": results}))
        return 0
    print(f"{args.steps} steps, overrides: {' '.join(args.override) or '(the CPU demo)'}\n")
    print("| trainer | rollout engine | rollout_log_prob_abs_diff | rollout_kl_k3 |")
    print("|---|---|---|---|")
    for result in results:
        mean = result["mean"]
        print(
            f"| {result['trainer']} | {result['rollout']} | "
            f"{mean.get(METRICS[0], float('nan')):.3g} | {mean.get(METRICS[1], float('nan')):.3g} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
