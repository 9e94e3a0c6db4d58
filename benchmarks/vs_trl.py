"""Our trainer against TRL's ``GRPOTrainer`` in GSPO mode, on the same job, one process each,
at several model sizes.

The job (identical on both sides; every TRL default that would change it is set explicitly, see
``vs_trl_job.trl_config`` and benchmarks/README.md, "vs TRL"):

* model: a random-init Qwen3-MoE of the chosen ``--size`` (``vs_trl_job.SIZES``: ``tiny``
  hidden 64 / 2 layers / 8 experts top-2 / vocab 64 / 16 generated tokens; ``small`` hidden 256
  / 4 layers / 16 experts top-4 / vocab 8,192 / 64 tokens; ``medium`` hidden 512 / 8 layers / 32
  experts top-4, expert intermediate 256, 8 query / 4 KV heads / vocab 32,768 / 128 tokens),
  untied embeddings, fp32, no router aux loss, built ONCE from ``--seed`` and saved with
  ``save_pretrained``; our trainer starts from it with ``model.hf_path``, TRL loads the same
  directory;
* task: digit reversal, 8 random digits and ``<sep>`` as the prompt; reward = mean over the 8
  answer positions of 1 (right digit), 0.1 (wrong digit), 0 (no digit)
  (``megatron_gspo.data.synthetic.score_digit_response``); the same prompts in the same order;
* per rollout step: 8 prompts x 8 samples x exactly the size's generated tokens (EOS cannot be
  sampled before: ours ``rollout.min_new_tokens``, TRL ``generation_kwargs={"min_new_tokens"}``),
  then 4 mini-batches of 16 samples, one AdamW step each (lr 1e-3 constant, grad clip 1.0);
* loss: GSPO (sequence ratio, clip 3e-4 / 4e-4, per-sequence token mean then sequence mean,
  beta = 0, group advantages (r - mean) / (std + 1e-4)), temperature 1, no top-p / top-k.

Old log-probs: TRL recomputes them with a no-grad forward of the policy over the 64 samples (it
must, since ``steps_per_generation > gradient_accumulation_steps``). Ours run twice
(``--old-log-probs``): ``ours`` takes them from the rollout engine (``old_log_prob_source=
rollout``, GSPO's natural source, no old-log-prob forward), ``ours_recompute`` recomputes them
like TRL (like for like).

The variants alternate A B C A B C ... (``--repeats`` each), every run in a fresh subprocess
with the same thread count (``--threads``, default 1: on a shared, oversubscribed CPU box the
OpenMP barriers of 2 threads cost far more than they gain), and before each round a fresh
process times a large fp32 and bf16 matmul at that thread count: this machine's peak. Reported
per variant (medians over runs and over rollout steps after the first, which carries one-time
costs):

* time per rollout step, start of one generation to the start of the next (the last step: to
  the end of its last optimizer step), and its split: rollout (generation), old log-probs,
  reward, forward+backward, optimizer (grad clip + step), weight sync and the rest (framework
  overhead: data, advantages, packing, logging, ...);
* training utilisation: the model FLOPs of the step's training (forward + backward of the
  active parameters of every sample, attention included, ``vs_trl_job.training_flops``) over
  forward+backward+optimizer time, as a percentage of the measured fp32 (and bf16) matmul peak;
* generated tokens per second;
* peak RSS (``VmHWM``) absolute, and above the RSS right after the libraries were imported
  (before any model, data or trainer is built; the peak counter is reset there), and, for ours,
  the size of the rollout engine's own copy of the weights (included in the peak; TRL has none);
* mean reward of the first and of the last rollout step;
* the ratios of each of ours over TRL (``summary.ratio_<variant>_over_trl``).

Usage (from the repository root)::

    python benchmarks/vs_trl.py                      # tiny: 8 rollout steps, 2 runs each
    python benchmarks/vs_trl.py --size medium        # the medium MoE (see README for the time)
    python benchmarks/vs_trl.py --size tiny,small,medium   # the sweep, one block per size
    python benchmarks/vs_trl.py --quick              # 3 steps (medium: 2), 1 run each
    python benchmarks/vs_trl.py --vocab 151936       # tiny at Qwen3's vocabulary
    python benchmarks/vs_trl.py --json               # one JSON object on stdout
    python benchmarks/vs_trl.py --checkout before=/path/to/old/checkout   # before/after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

BENCHMARKS = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS.parent
for _path in (str(BENCHMARKS), str(REPO_ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from vs_trl_job import SAMPLES_PER_STEP, SIZES, write_job  # noqa: E402
from vs_trl_workers import PHASES  # noqa: E402

FRAMEWORKS = ("ours", "trl")
OLD_LOG_PROBS = ("rollout", "recompute")
DEFAULT_STEPS = {"tiny": 8, "small": 4, "medium": 3}
"""Rollout steps per run (the first is left out of the medians)."""
DEFAULT_REPEATS = {"tiny": 2, "small": 2, "medium": 1}
DTYPE_SUFFIX = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Variant:
    """One column: a framework, and for ours its old-log-prob source and checkout."""

    name: str
    framework: str
    old_log_probs: Optional[str] = None
    repo_root: Optional[str] = None
    rollout_dtype: Optional[str] = None
    """Our embedded engine's ``rollout.dtype``; None: not set (the trainer's float32)."""


def variants_for(args: argparse.Namespace) -> list[Variant]:
    """``LABEL[_recompute]`` for each checkout and this tree (float32 engine), ``ours_bf16`` etc.
    for this tree's other engine dtypes (the natural source only: that is where the engine's
    precision shows; older checkouts have no ``rollout.dtype``), then ``trl``."""
    result = []
    for label, root in [*args.checkout, ("ours", None)]:
        if "ours" not in args.frameworks:
            continue
        for dtype in args.rollout_dtype if root is None else ["float32"]:
            for source in args.old_log_probs if dtype == "float32" else ["rollout"]:
                name = label + ("_recompute" if source == "recompute" else "")
                name += "" if dtype == "float32" else f"_{DTYPE_SUFFIX[dtype]}"
                result.append(
                    Variant(name, "ours", source, root, None if dtype == "float32" else dtype)
                )
    if "trl" in args.frameworks:
        result.append(Variant("trl", "trl"))
    return result


def _worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",
        PYTHONWARNINGS="ignore",
    )
    return env


def run_worker(
    variant: Variant,
    job: dict[str, Any],
    args: argparse.Namespace,
) -> dict:
    """One run in a fresh interpreter, importing ``megatron_gspo`` from the variant's checkout
    (this one by default); returns its measurements (raises with its log on error)."""
    with tempfile.TemporaryDirectory(prefix=f"vs_trl_{variant.name}_") as work_dir:
        result_path = Path(work_dir) / "result.json"
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            variant.framework,
            "--job",
            job["dir"],
            "--result",
            str(result_path),
            "--threads",
            str(args.threads),
            "--repo-root",
            str(variant.repo_root or REPO_ROOT),
        ]
        if variant.framework == "ours":
            command += ["--old-log-probs", variant.old_log_probs]
            if variant.rollout_dtype:
                command += ["--rollout-dtype", variant.rollout_dtype]
        started = time.perf_counter()
        process = subprocess.run(
            command,
            cwd=work_dir,
            env=_worker_env(args.threads),
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if process.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"{variant.name} run failed (exit {process.returncode}):\n{process.stderr[-6000:]}"
            )
        result = json.loads(result_path.read_text())
        result["wall_s"] = time.perf_counter() - started
        return result


def measure_peak(threads: int) -> dict[str, Any]:
    """The matmul peak in a fresh process at ``threads`` threads (``vs_trl_workers.run_peak``)."""
    code = (
        "import json, sys, torch; torch.set_num_threads(int(sys.argv[1])); "
        "from vs_trl_workers import run_peak; print(json.dumps(run_peak()))"
    )
    process = subprocess.run(
        [sys.executable, "-c", code, str(threads)],
        cwd=str(BENCHMARKS),
        env=_worker_env(threads),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(process.stdout.strip().splitlines()[-1])


def _median(values: list[Optional[float]]) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def summarize(
    runs: dict[str, list[dict]], job: dict[str, Any], peaks: list[dict[str, Any]]
) -> dict[str, Any]:
    """Medians per variant over runs x steps (the first step of each run left out), training
    utilisation against the median measured peak, and the ratios of each of ours over TRL."""
    summary: dict[str, Any] = {}
    peak = {
        name: _median([p[name] for p in peaks])
        for name in ("fp32_gflops", "bf16_gflops", "fp32_gflops_cpu", "bf16_gflops_cpu")
    }
    peak["measurements"] = len(peaks)
    flops = job["training_flops_per_step"]
    generated = SAMPLES_PER_STEP * job["response_tokens"]
    for name, results in runs.items():
        steps = [step for result in results for step in result["steps"][1:]]
        if not steps:  # a one-step run: keep its only step
            steps = [step for result in results for step in result["steps"]]
        median_step = _median([s["step"] for s in steps])
        train_s = _median([s["forward_backward"] + s["optimizer"] for s in steps])
        train_gflops = flops / train_s / 1e9 if train_s else None
        # The same by CPU time (all threads): much less disturbed by a busy machine.
        train_cpu_s = _median(
            [
                s["cpu_phases"].get("forward_backward", 0.0) + s["cpu_phases"].get("optimizer", 0.0)
                for s in steps
            ]
        )
        train_gflops_cpu = flops / train_cpu_s / 1e9 if train_cpu_s else None
        summary[name] = {
            "runs": len(results),
            "steps_measured": len(steps),
            "step_s": median_step,
            "step_s_min": min(s["step"] for s in steps),
            "step_s_max": max(s["step"] for s in steps),
            "cpu_s": _median([s["cpu"] for s in steps]),
            "phases_s": {phase: _median([s[phase] for s in steps]) for phase in PHASES},
            "train_s": train_s,
            "train_gflops_per_s": train_gflops,
            "utilisation_fp32": _ratio(train_gflops, peak["fp32_gflops"]),
            "utilisation_bf16": _ratio(train_gflops, peak["bf16_gflops"]),
            "train_cpu_s": train_cpu_s,
            "utilisation_fp32_cpu": _ratio(train_gflops_cpu, peak["fp32_gflops_cpu"]),
            "phases_cpu_s": {
                phase: _median([s["cpu_phases"].get(phase, 0.0) for s in steps])
                for phase in PHASES
                if phase != "other"
            },
            "generated_tokens_per_s": generated / median_step,
            "peak_rss_mb": _median([r["peak_rss_mb"] for r in results]),
            "rss_post_import_mb": _median([r["rss_post_import_mb"] for r in results]),
            "peak_above_import_mb": _median([r["peak_above_import_mb"] for r in results]),
            "engine_weights_mb": _median([r.get("engine_weights_mb") for r in results]),
            "engine_dtype": results[0].get("engine_dtype"),
            "reward_first": _median([r["rewards"][0] for r in results]),
            "reward_last": _median([r["rewards"][-1] for r in results]),
            "run_wall_s": [round(r["wall_s"], 1) for r in results],
        }
    summary["machine_peak"] = peak
    if "trl" in runs:
        theirs = summary["trl"]
        for name in runs:
            if name == "trl":
                continue
            ours = summary[name]
            summary[f"ratio_{name}_over_trl"] = {
                "step_s": _ratio(ours["step_s"], theirs["step_s"]),
                "cpu_s": _ratio(ours["cpu_s"], theirs["cpu_s"]),
                "train_s": _ratio(ours["train_s"], theirs["train_s"]),
                "train_cpu_s": _ratio(ours["train_cpu_s"], theirs["train_cpu_s"]),
                "peak_rss_mb": _ratio(ours["peak_rss_mb"], theirs["peak_rss_mb"]),
                "peak_above_import_mb": _ratio(
                    ours["peak_above_import_mb"], theirs["peak_above_import_mb"]
                ),
                **{
                    f"{phase}_s": _ratio(ours["phases_s"][phase], theirs["phases_s"][phase])
                    for phase in PHASES
                },
            }
    return summary


def format_table(summary: dict[str, Any], job: dict[str, Any], threads: int) -> str:
    variants = [name for name, value in summary.items() if "runs" in value]
    ratio_names = [name for name in variants if f"ratio_{name}_over_trl" in summary]
    peak = summary["machine_peak"]

    def cell(value, digits=3):
        return "-" if value is None else f"{value:,.{digits}f}"

    def row(label, key, digits=3, ratio_key=None):
        values = [cell(key(summary[v]), digits) for v in variants]
        ratios = [
            cell(summary[f"ratio_{v}_over_trl"].get(ratio_key), 2) if ratio_key else ""
            for v in ratio_names
        ]
        return [label, *values, *ratios]

    def percent(value):
        return None if value is None else 100 * value

    header = ["per rollout step", *variants, *[f"{v}/trl" for v in ratio_names]]
    rows = [row("time (s)", lambda s: s["step_s"], ratio_key="step_s")]
    for phase in PHASES:
        rows.append(
            row(f"  {phase} (s)", lambda s, p=phase: s["phases_s"][p], ratio_key=f"{phase}_s")
        )
    rows.append(row("CPU time (s)", lambda s: s["cpu_s"], ratio_key="cpu_s"))
    # Process CPU time per phase: on a shared machine the steadier split (no "other": the rest
    # of the step is not timed by CPU clock).
    for phase in PHASES:
        if phase == "other":
            continue

        def cpu(s, p=phase):
            return s["phases_cpu_s"].get(p)

        values = [cell(cpu(summary[v])) for v in variants]
        theirs = cpu(summary["trl"]) if "trl" in summary else None
        ratios = [
            cell(cpu(summary[v]) / theirs, 2) if theirs and cpu(summary[v]) is not None else "-"
            for v in ratio_names
        ]
        rows.append([f"  {phase} CPU (s)", *values, *ratios])
    rows += [
        row("training: fwd+bwd+opt (s)", lambda s: s["train_s"], ratio_key="train_s"),
        row("training GFLOP/s", lambda s: s["train_gflops_per_s"], 1),
        row("utilisation, % of fp32 peak", lambda s: percent(s["utilisation_fp32"]), 1),
        row("utilisation, % of bf16 peak", lambda s: percent(s["utilisation_bf16"]), 1),
        row("training CPU time (s)", lambda s: s["train_cpu_s"], ratio_key="train_cpu_s"),
        row("utilisation by CPU time, % fp32", lambda s: percent(s["utilisation_fp32_cpu"]), 1),
        row("generated tokens / s", lambda s: s["generated_tokens_per_s"], 0),
        row("peak RSS (MB)", lambda s: s["peak_rss_mb"], 0, "peak_rss_mb"),
        row("RSS after imports (MB)", lambda s: s["rss_post_import_mb"], 0),
        row(
            "peak above imports (MB)",
            lambda s: s["peak_above_import_mb"],
            0,
            "peak_above_import_mb",
        ),
        row("  of which engine copy (MB)", lambda s: s["engine_weights_mb"], 0),
        row("reward first step", lambda s: s["reward_first"]),
        row("reward last step", lambda s: s["reward_last"]),
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    shape = job["shape"]
    dtypes = sorted({summary[v]["engine_dtype"] for v in variants if summary[v]["engine_dtype"]})
    lines = [
        f"size {job['size']}: hidden {shape['hidden']}, {shape['layers']} layers, "
        f"{shape['experts']} experts top-{shape['topk']} (intermediate {shape['expert_ffn']}), "
        f"{shape['heads']} q / {shape['kv_heads']} kv heads of {shape['head_dim']}, vocab "
        f"{job['vocab_size']:,}, {job['response_tokens']} generated tokens; "
        f"{job['num_parameters'] / 1e6:.1f} M parameters, "
        f"{job['training_flops_per_step'] / 1e12:.3f} TFLOP of training per rollout step",
        f"{job['steps']} rollout steps per run, {summary[variants[0]]['runs']} run(s) each "
        f"(alternating), {threads} thread(s); medians over runs x steps 2..{job['steps']}; "
        f"matmul peak {cell(peak['fp32_gflops'], 0)} GFLOP/s fp32, "
        f"{cell(peak['bf16_gflops'], 0)} bf16, by CPU time {cell(peak['fp32_gflops_cpu'], 0)} "
        f"fp32, {cell(peak['bf16_gflops_cpu'], 0)} bf16 ({peak['measurements']} measurement(s)); "
        f"rollout engine dtype {', '.join(dtypes) or '-'}",
        "  ".join(h.ljust(w) for h, w in zip(header, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size",
        default="tiny",
        help=f"comma-separated sizes among {', '.join(SIZES)}, one interleaved block each "
        "(default tiny)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"rollout steps per run (default per size: {DEFAULT_STEPS}; --quick: 3, medium 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"runs per variant, alternating (default per size: {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help="vocabulary size (default: the size's)"
    )
    parser.add_argument(
        "--old-log-probs",
        default=",".join(OLD_LOG_PROBS),
        help="comma-separated old-log-prob sources of our runs: rollout (column 'ours'), "
        "recompute (column 'ours_recompute'); default both",
    )
    parser.add_argument(
        "--rollout-dtype",
        default="float32",
        help="comma-separated dtypes of our embedded engine (rollout.dtype), each a set of our "
        "columns: float32 (default, the trainer's), bfloat16 (columns ..._bf16)",
    )
    parser.add_argument("--seed", type=int, default=1234, help="model, prompts and run seed")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch / OpenMP threads per run (default 1)"
    )
    parser.add_argument(
        "--frameworks",
        default="ours,trl",
        help="comma-separated subset of ours,trl (default both)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="3 rollout steps per run (medium: 2), 1 run each"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, no table")
    parser.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per run before it is killed"
    )
    parser.add_argument(
        "--keep-job", metavar="DIR", default=None, help="write the job to DIR and keep it"
    )
    parser.add_argument(
        "--checkout",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="also run our trainer from the checkout in DIR, as column LABEL (and "
        "LABEL_recompute), interleaved with the others (repeatable): before/after tables on "
        "the same machine state",
    )
    parser.add_argument("--worker", choices=FRAMEWORKS, help=argparse.SUPPRESS)
    parser.add_argument("--repo-root", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    checkouts = []
    for item in args.checkout:
        label, _, directory = item.partition("=")
        if not label or not directory or label in FRAMEWORKS or "_" in label:
            parser.error(
                f"--checkout {item!r}: expected LABEL=DIR with LABEL not in {FRAMEWORKS} and "
                "without '_'"
            )
        if not (Path(directory) / "megatron_gspo").is_dir():
            parser.error(f"--checkout {item!r}: {directory} has no megatron_gspo package")
        checkouts.append((label, str(Path(directory).resolve())))
    args.checkout = checkouts
    args.sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    unknown = set(args.sizes) - set(SIZES)
    if unknown or not args.sizes:
        parser.error(f"--size: unknown {sorted(unknown)}; choose from {list(SIZES)}")
    args.rollout_dtype = [s.strip() for s in args.rollout_dtype.split(",") if s.strip()]
    if set(args.rollout_dtype) - set(DTYPE_SUFFIX) - {"float32"}:
        parser.error(f"--rollout-dtype: choose among float32, {', '.join(DTYPE_SUFFIX)}")
    args.old_log_probs = [s.strip() for s in args.old_log_probs.split(",") if s.strip()]
    if not args.old_log_probs or set(args.old_log_probs) - set(OLD_LOG_PROBS):
        parser.error(f"--old-log-probs: choose among {OLD_LOG_PROBS}")
    for name in ("steps", "repeats", "vocab", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} must be >= 1")
    if args.vocab is not None and args.vocab < 15:
        parser.error("--vocab must be >= 15 (the synthetic tokenizer has 15 tokens)")
    args.frameworks = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    unknown = set(args.frameworks) - set(FRAMEWORKS)
    if unknown:
        parser.error(f"unknown frameworks {sorted(unknown)}; choose from {FRAMEWORKS}")
    return args


def worker_main(args: argparse.Namespace) -> int:
    if args.repo_root:
        # Nothing of megatron_gspo is imported yet: this decides which checkout is measured.
        sys.path.insert(0, args.repo_root)
    import torch
    from vs_trl_workers import run_ours, run_trl

    torch.set_num_threads(args.threads)
    job = json.loads((Path(args.job) / "job.json").read_text())
    if args.worker == "ours":
        result = run_ours(
            job,
            os.getcwd(),
            old_log_probs=args.old_log_probs[0],
            # float32 is left unset: checkouts older than rollout.dtype have no such key.
            rollout_dtype=None if args.rollout_dtype == ["float32"] else args.rollout_dtype[0],
        )
    else:
        result = run_trl(job, os.getcwd())
    Path(args.result).write_text(json.dumps(result))
    return 0


def run_size(size: str, args: argparse.Namespace) -> dict[str, Any]:
    """One interleaved block: the job of ``size``, every variant ``repeats`` times."""
    steps = args.steps or ((2 if size == "medium" else 3) if args.quick else DEFAULT_STEPS[size])
    repeats = args.repeats or (1 if args.quick else DEFAULT_REPEATS[size])
    job_dir = Path(args.keep_job or tempfile.mkdtemp(prefix="vs_trl_job_")) / size
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        job = write_job(job_dir, size_name=size, vocab_size=args.vocab, seed=args.seed, steps=steps)
        variants = variants_for(args)
        runs: dict[str, list[dict]] = {v.name: [] for v in variants}
        peaks = []
        for repeat in range(repeats):
            peaks.append(measure_peak(args.threads))
            for variant in variants:
                if not args.json:
                    print(f"[{size}] run {repeat + 1}/{repeats}: {variant.name} ...", flush=True)
                runs[variant.name].append(run_worker(variant, job, args))
        return {
            "job": job,
            "threads": args.threads,
            "summary": summarize(runs, job, peaks),
            "peaks": peaks,
            "runs": runs,
        }
    finally:
        if args.keep_job is None:
            shutil.rmtree(job_dir.parent, ignore_errors=True)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    results = {}
    for size in args.sizes:
        results[size] = run_size(size, args)
        if not args.json:
            print(format_table(results[size]["summary"], results[size]["job"], args.threads))
            print(flush=True)
    if args.json:
        only = len(results) == 1
        print(json.dumps(next(iter(results.values())) if only else {"sizes": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
