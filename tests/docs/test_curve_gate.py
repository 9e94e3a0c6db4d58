"""The CPU demo's learning curves, and each variant's of the compare tool's quick suite, stay
within the band of the stored reference's seeds (``tools/curve_gate.py``; ``--update`` rewrites
a reference, deliberately)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))
import curve_gate  # noqa: E402  (a script of tools/, not a package)

sys.path.remove(str(REPO_ROOT / "tools"))


def test_the_demo_stays_within_the_band_of_its_seeds(cpu_demo_metrics):
    result = subprocess.run(
        [sys.executable, "tools/curve_gate.py", "--check", "--metrics", str(cpu_demo_metrics)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "within the band of" in result.stdout


def test_the_quick_compare_suite_stays_within_the_band_of_its_seeds(tmp_path):
    """One run of ``tools/compare_grpo_gspo.py --quick`` (one process, no plots), every variant's
    reward and clipped-token curves against ``tools/curve_references/compare_quick.json``."""
    result = subprocess.run(
        [sys.executable, "tools/curve_gate.py", "--gate", "compare_quick", "--check"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compare_quick curves are within the band of" in result.stdout


def test_the_quick_suites_gate_fails_gspo_clipping_like_grpo(tmp_path):
    """Runs written from the reference's mean curves pass through the gate's own reading of a
    ``--out`` folder; GSPO clipping GRPO's share of tokens (its sequence clip gone) fails,
    named by step and the clip ratio; a variant that did not run fails, named."""
    gate = curve_gate.GATES["compare_quick"]
    reference = json.loads(gate.reference.read_text())
    assert set(reference["metrics"]) == set(gate.gated) and len(reference["seeds"]) >= 3

    def write_runs(out: Path, clip_of: dict[str, str]) -> None:
        for variant in curve_gate.COMPARE_VARIANTS:
            series = {
                metric: _undo_trailing_mean(
                    reference["metrics"][f"{clip_of.get(variant, variant)}/{metric}"]["mean"]
                    if metric == "clip_frac_token"
                    else reference["metrics"][f"{variant}/{metric}"]["mean"]
                )
                for metric in curve_gate.COMPARE_METRICS
            }
            steps = len(series["reward_mean"])
            (out / variant).mkdir(parents=True)
            (out / variant / "metrics.jsonl").write_text(
                "".join(
                    json.dumps({"step": step, **{m: v[step] for m, v in series.items()}}) + "\n"
                    for step in range(steps)
                )
            )

    write_runs(tmp_path / "as_reference", {})
    records = gate.read(tmp_path / "as_reference")
    assert curve_gate.band_violations(reference, records) == []
    write_runs(tmp_path / "gspo_clips_like_grpo", {"gspo": "grpo"})
    problems = curve_gate.band_violations(reference, gate.read(tmp_path / "gspo_clips_like_grpo"))
    assert problems and all(problem.split()[2] == curve_gate.CLIP_RATIO for problem in problems)
    assert problems[0].startswith("steps ")
    without_r3 = [
        {key: value for key, value in record.items() if not key.startswith("grpo_r3/")}
        for record in records
    ]
    missing = curve_gate.band_violations(reference, without_r3)
    assert missing and all(problem.startswith("grpo_r3/") for problem in missing)
    assert "the run has 0 steps" in missing[0]


def test_a_curve_that_stops_learning_is_named_by_step_and_metric():
    """The gate can fail: the reference's own mean curve passes; a run whose reward stays at its
    first step's value leaves the band, and the failures name the step and the metric."""
    reference = json.loads(curve_gate.REFERENCE.read_text())
    band = reference["metrics"]["reward_mean"]
    assert len(band["mean"]) == 40 and len(reference["seeds"]) >= 3
    # A run whose trailing means are the reference's mean curves.
    rewards = _undo_trailing_mean(band["mean"])
    entropies = _undo_trailing_mean(reference["metrics"]["entropy"]["mean"])
    records = [
        {"step": step, "reward_mean": reward, "entropy": entropy}
        for step, (reward, entropy) in enumerate(zip(rewards, entropies))
    ]
    assert curve_gate.band_violations(reference, records) == []
    flat = [{**record, "reward_mean": records[0]["reward_mean"]} for record in records]
    problems = curve_gate.band_violations(reference, flat)
    assert problems and all("reward_mean" in problem for problem in problems)
    assert problems[0].startswith("steps ") and "outside" in problems[0]
    # One step out of the band is noise, not a regression.
    blip = [dict(record) for record in records]
    blip[30]["reward_mean"] -= 5 * (band["high"][30] - band["low"][30])
    assert len(curve_gate.band_violations(reference, blip)) == 0 or all(
        not problem.startswith("steps 30-30")
        for problem in curve_gate.band_violations(reference, blip)
    )


def _undo_trailing_mean(means: list[float]) -> list[float]:
    """Values whose trailing means (window ``curve_gate.WINDOW``) are ``means``."""
    values: list[float] = []
    window = curve_gate.WINDOW
    for index, mean in enumerate(means):
        count = min(index + 1, window)
        earlier = values[max(0, index - window + 1) : index]
        values.append(mean * count - sum(earlier))
    return values
