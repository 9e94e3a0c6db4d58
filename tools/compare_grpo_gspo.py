#!/usr/bin/env python
"""Compare GSPO with GRPO (with and without Routing Replay) on one task, seed, data and model.

Each variant is a normal training run (``python -m megatron_gspo.train``, or under the launcher you
give, e.g. torchrun on many nodes) with the same preset and overrides, plus the variant's own.

The standard suite (``--suite standard``, the default):

  gspo        importance_sampling=seq        clip 3e-4 / 4e-4 (GSPO paper, section 5.1)
  gspo_token  importance_sampling=seq_token  clip 3e-4 / 4e-4 (GSPO-token: same value and gradient
                                             as gspo with one advantage per sequence)
  grpo        importance_sampling=token      clip 0.2 / 0.27 (the paper's GRPO baseline)
  grpo_r2     grpo + routing_replay=r2       replay the routes recorded in the old-log-prob forward
  grpo_r3     grpo + routing_replay=r3       replay the rollout engine's routes

All variants recompute old log-probs (so R2 is possible and the trainer-vs-rollout gap is
measured) and default to 4 mini-batches per rollout batch (the paper's setting; an update is only
off-policy, and GSPO only differs from GRPO, with several optimizer steps per rollout batch).

The mismatch suite (``--suite mismatch``): the rollout engine samples in bfloat16
(``rollout.dtype=bfloat16``) while the trainer computes in fp32, a real training-inference
mismatch (precision and MoE routes):

  gspo_recompute  GSPO, old log-probs recomputed by the trainer
  gspo_rollout    GSPO, the engine's log-probs as the old policy (no recompute forward: the GSPO
                  paper's claim that sequence likelihoods tolerate the engine's precision)
  grpo_rollout    GRPO, the engine's log-probs as the old policy, no correction (the contrast)
  grpo_tis        GRPO, recomputed old log-probs, token-level TIS toward the engine's log-probs
                  (weight min(pi_old / mu, 2))
  grpo_r2         GRPO + R2 (the trainer's own routes: they differ from the engine's)
  grpo_r3         GRPO + R3 (the engine's routes: routing_mismatch_vs_rollout is 0)

With ``--rollout-engine sglang`` the mismatch suite's engine is a real SGLang server in bfloat16
instead of the embedded one: each variant launches its own server (``rollout.sglang.launch``) from
SGLang's environment (``--sglang-python``, default ``$MEGATRON_GSPO_SGLANG_VENV/bin/python``),
started from the same exported initial weights (``model.hf_path``, written to
``--out/initial_model`` unless the overrides give one) and synced from the trainer at start and
after every step by the disk transport; the server returns every sample's routes
(``rollout.sglang.return_routes``) so the routing metrics cover every variant. On CPU the server
runs SGLang's CPU backend (``--sglang-device cpu``): the AMX path on CPUs with AMX, whose expert
weights must all be packable (an expert size that is a multiple of 32; ``--quick`` uses 64),
plain torch elsewhere (docs/sglang-protocol.md section 7).

The async suite (``--suite async``, docs/async.md): the synchronous loop against one step
off-policy (``rollout.max_staleness=1``):

  gspo            as in the standard suite (synchronous)
  gspo_async      gspo + max_staleness=1, old log-probs recomputed (the proximal policy)
  gspo_async_mu   gspo_async with the engine's behaviour log-probs as the old policy (no
                  recompute forward; the clip range also has to absorb one update's drift)
  gspo_async_is   gspo_async + a sequence-level importance weight toward the engine's policy
                  (min(geometric mean of pi_prox / mu, 2), AReaL's decoupled weight per sequence)
  grpo            as in the standard suite (synchronous)
  grpo_async      grpo + max_staleness=1, old log-probs recomputed, no correction
  grpo_async_tis  grpo_async + token-level TIS toward the engine's policy (min(pi_prox / mu, 2))

The distillation suite (``--suite distillation``, docs/distillation.md): RL against on-policy
distillation from a teacher against both, all GSPO-token; the teacher is an override,
``-- models.teacher.hf_path=DIR`` (the one ``tools/distillation_curve.py`` exports):

  rl          GSPO-token on the task's reward
  distill     the advantage of each token is the teacher's -(log pi_student - log pi_teacher)
  rl_distill  GSPO-token's advantage plus that term (slime's --opd-kl-coef form)

The attribution suite (``--suite attribution``, tools/compare_attribution.py): starting from
the exact fp32 twin, one source of training-inference mismatch at a time and in combination (the
engine's precision, its batch composition, staleness; retokenization on a text model with Qwen's
vocabulary, against that model's own twin) crossed with the corrections (TIS, MIS,
geometric-mean sequence weights and masks, R3); ``--sources``, ``--corrections``. It writes
attribution.md / attribution.json (per-token gap, sequence log-ratio, routing flips, clip
fractions, reward with intervals over ``--seeds``) and attribution_gap.png /
attribution_reward.png beside the usual summary (docs/compare_grpo_gspo.md, "Mismatch
attribution").

Regimes (``--regime``): ``demo`` keeps the preset's learning rate (the CPU demo's 3e-3 moves
the policy so far per optimizer step that GRPO's token ratios leave [0.8, 1.27] for ~10% of
tokens); ``paper`` lowers it to 1e-3 so that one update moves token ratios little, as in the GSPO
paper (GRPO clips ~0.1-0.3% of tokens there); ``volatile`` gives routing room to move (4 MoE
layers of 32 experts, top-4, the demo's learning rate: about twice the demo's expert
volatility). ``--quick`` (what CI runs) uses ``paper``.

Model families (``--architecture``): ``qwen3_moe`` (the default: the CPU demo's tiny Qwen3-MoE,
or the preset's model), ``glm4_moe`` (the same tiny sizes as GLM-4.5: layer 0 dense, layer 1
routed by a sigmoid router with the correction bias, 8 experts in 2 groups with one group per
token, top-2 scaled by 2.5, a shared expert, partial RoPE, q/k/v bias) and ``deepseek_v3`` (the
same router with multi-head latent attention and YaRN). The routing metrics (expert volatility
``routing_change_frac``, R3's ``routing_mismatch_vs_rollout``) are reported for every family;
docs/compare_grpo_gspo.md, "Other model families".

Writes to --out: one run directory per variant, summary.json, summary.md and PNG plots (reward,
clip fraction on a log scale, routing change, trainer-vs-rollout log-prob gap).

Seeds (``--seeds N``): every variant runs at seeds S, S+1, ..., S+N-1 (S: ``--seed``, default
1234), each into ``--out/<variant>/seed_<seed>``; the seed changes the initial weights, the prompt
order and sampling (``rollout.seed`` follows it unless set). ``--jobs J`` runs J at once (each
with 1/J of the cores). A run that finished is kept (``compare_run.json`` beside its metrics), so a
killed comparison continues where it stopped when the same command runs again. The summary gives
each statistic as the mean across seeds with its 95% Student-t interval, and each variant's
paired difference from the first variant on the same seeds with its interval and whether that
excludes zero; the plots show the mean curve with the interval as a band. The statistics
(``tools/compare_statistics.py``): area under the reward curve per step, final reward (mean of
the last tenth of the steps), steps to ``--reward-threshold`` (trailing mean of 5 steps), clip
fractions, routing volatility (mean routing change), grad-norm spikes and collapse (the trailing
mean falls more than ``--collapse-drop`` below its best and stays down).

Examples:
  python tools/compare_grpo_gspo.py --quick --out compare/
  python tools/compare_grpo_gspo.py --suite mismatch --regime paper --steps 60 --out mismatch/
  python tools/compare_grpo_gspo.py --suite mismatch --quick --rollout-engine sglang \\
      --sglang-python /venvs/sglang/bin/python --out mismatch_sglang/
  python tools/compare_grpo_gspo.py --suite async --steps 20 --out async/
  python tools/compare_grpo_gspo.py --quick --seeds 4 --jobs 2 --out compare_seeds/
  python tools/compare_grpo_gspo.py --quick --architecture deepseek_v3 --out compare_deepseek/
  python tools/compare_grpo_gspo.py --suite attribution --quick --seeds 2 --jobs 2 \\
      --sources bf16,fp16,batch1,stale1 --corrections none,tis,r3 --out attribution/
  python tools/compare_grpo_gspo.py --out compare/ --steps 100 -- model.hf_path=/models/Qwen3-30B-A3B
  python tools/compare_grpo_gspo.py --preset qwen3_30b_a3b_gspo_4node --out /shared/compare \\
      --launcher "torchrun --nnodes 4 --node_rank $NODE_RANK --nproc_per_node 8 \\
                  --rdzv_backend c10d --rdzv_endpoint $MASTER_ADDR:29500"
    (run the same command on every node; the summary is written where the metrics are)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also when loaded by path (tests)
import compare_attribution  # noqa: E402
from compare_sglang import (  # noqa: E402
    QUICK_SGLANG,
    SGLANG_VENV_ENV,
    SGLangMode,
    prepare_sglang,
)
from compare_statistics import (  # noqa: E402
    mean_interval,
    paired_difference,
    reward_curve_statistics,
)

GSPO = ["algo.importance_sampling=seq", "algo.clip_low=3e-4", "algo.clip_high=4e-4"]
GRPO = ["algo.importance_sampling=token", "algo.clip_low=0.2", "algo.clip_high=0.27"]
RECOMPUTE = ["algo.old_log_prob_source=recompute"]
ROLLOUT = ["algo.old_log_prob_source=rollout"]
GSPO_TOKEN = ["algo.importance_sampling=seq_token", "algo.clip_low=3e-4", "algo.clip_high=4e-4"]
SUITES: dict[str, dict[str, list[str]]] = {
    "standard": {
        "gspo": [*GSPO, *RECOMPUTE],
        "gspo_token": [
            "algo.importance_sampling=seq_token",
            "algo.clip_low=3e-4",
            "algo.clip_high=4e-4",
            *RECOMPUTE,
        ],
        "grpo": [*GRPO, *RECOMPUTE],
        "grpo_r2": [*GRPO, *RECOMPUTE, "algo.routing_replay=r2"],
        "grpo_r3": [*GRPO, *RECOMPUTE, "algo.routing_replay=r3"],
    },
    "mismatch": {
        "gspo_recompute": [*GSPO, *RECOMPUTE],
        "gspo_rollout": [*GSPO, *ROLLOUT],
        "grpo_rollout": [*GRPO, *ROLLOUT],
        "grpo_tis": [*GRPO, *RECOMPUTE, "algo.rollout_correction.level=token"],
        "grpo_r2": [*GRPO, *RECOMPUTE, "algo.routing_replay=r2"],
        "grpo_r3": [*GRPO, *RECOMPUTE, "algo.routing_replay=r3"],
    },
    "async": {
        "gspo": [*GSPO, *RECOMPUTE],
        "gspo_async": [*GSPO, *RECOMPUTE, "rollout.max_staleness=1"],
        "gspo_async_mu": [*GSPO, *ROLLOUT, "rollout.max_staleness=1"],
        "gspo_async_is": [
            *GSPO,
            *RECOMPUTE,
            "rollout.max_staleness=1",
            "algo.rollout_correction.level=sequence",
        ],
        "grpo": [*GRPO, *RECOMPUTE],
        "grpo_async": [*GRPO, *RECOMPUTE, "rollout.max_staleness=1"],
        "grpo_async_tis": [
            *GRPO,
            *RECOMPUTE,
            "rollout.max_staleness=1",
            "algo.rollout_correction.level=token",
        ],
    },
    # RL against on-policy distillation against both (docs/distillation.md), all GSPO-token
    # (per-token advantages); the teacher comes with the overrides:
    # -- models.teacher.hf_path=DIR (tools/distillation_curve.py exports the CPU demo's).
    "distillation": {
        "rl": [*GSPO_TOKEN, *RECOMPUTE],
        "distill": [*GSPO_TOKEN, *RECOMPUTE, "algo.distillation.mode=pure"],
        "rl_distill": [*GSPO_TOKEN, *RECOMPUTE, "algo.distillation.mode=added"],
    },
    # Every (source, correction) pair; --sources and --corrections pick the runs.
    "attribution": compare_attribution.VARIANTS,
}
SUITE_COMMON = {
    "standard": [],
    "mismatch": ["rollout.dtype=bfloat16"],
    "async": [],
    "distillation": [],
    "attribution": [],  # the suite's own come from its options (compare_attribution)
}
REGIMES: dict[str, list[str]] = {
    "demo": [],
    # One optimizer step at lr 1e-3 moves the tiny demo's token ratios out of GRPO's [0.8, 1.27]
    # for ~0.3% of tokens (the GSPO paper's GRPO baseline: ~0.13%), against ~10% at the demo's
    # 3e-3 (docs/compare_grpo_gspo.md).
    "paper": ["optim.lr=1e-3"],
    # Room for routing to move: 4 MoE layers of 32 experts, top-4 (the demo: 2 layers of 8, top-2),
    # at the demo's learning rate, so that more of each token's experts are near a tie and one
    # update flips more of them; GRPO without Routing Replay then sees the most expert volatility
    # this model can give (docs/compare_grpo_gspo.md, "The volatile regime").
    "volatile": ["model.num_layers=4", "model.num_experts=32", "model.moe_router_topk=4"],
}
# The tiny models of the other MoE families (docs/glm4-moe.md, docs/deepseek-v3.md): the default
# tiny sizes (hidden 64, 2 layers, 8 experts of 48, top-2) with the family's own structure, as in
# tests/e2e/test_glm4_moe.py and the layout tests' models.
GLM4_MOE = [
    "model.architecture=glm4_moe",
    "model.first_k_dense_layers=1",
    "model.shared_expert_intermediate_size=48",
    "model.moe_router_num_groups=2",
    "model.moe_router_group_topk=1",
    "model.moe_router_topk_scaling_factor=2.5",
    "model.rotary_percent=0.5",
    "model.add_qkv_bias=true",
]
DEEPSEEK_V3 = [
    "model.architecture=deepseek_v3",
    "model.num_query_groups=4",  # MLA: one key/value per head
    "model.first_k_dense_layers=1",
    "model.shared_expert_intermediate_size=48",
    "model.moe_router_num_groups=2",
    "model.moe_router_group_topk=1",
    "model.moe_router_topk_scaling_factor=2.5",
    "model.qk_layernorm=false",
    "model.q_lora_rank=32",
    "model.kv_lora_rank=16",
    "model.qk_nope_head_dim=16",
    "model.qk_rope_head_dim=16",
    "model.v_head_dim=12",
    "model.rope_theta=10000",
    "model.rope_scaling_factor=4.0",
    "model.rope_scaling_original_max_position_embeddings=32",
    "model.yarn_mscale_all_dim=1.0",
]
ARCHITECTURES: dict[str, list[str]] = {
    "qwen3_moe": [],  # the schema's defaults: the CPU demo's tiny Qwen3-MoE
    "glm4_moe": GLM4_MOE,
    "deepseek_v3": DEEPSEEK_V3,
}
GROUPED_VOLATILE = ["model.moe_router_num_groups=4", "model.moe_router_group_topk=2"]
"""The volatile regime's top-4 of 32 experts for the grouped families: 4 groups of 8, 2 per
token, so that top-k / chosen groups stays 2, the one grouping Megatron and HF rank alike
(docs/glm4-moe.md, section 2)."""
# The tool owns the variant folders under --out: a rerun replaces a variant's previous run
# (--skip-existing keeps the finished ones instead).
COMMON = [
    "logging.progress_bar=false",
    "overwrite_output_dir=true",
]
QUICK = [
    "steps=6",
    "sft_warmup_steps=10",
    "algo.rollout_batch_size=4",
    "algo.num_return_sequences_in_group=4",
    "algo.num_mini_batches=4",
    "algo.response_length=12",
    "model.vocab_size=16",
]
DEFAULT_SEED = 1234
"""TrainConfig's seed: the first of ``--seeds`` unless ``--seed`` says otherwise."""
FINISHED = "compare_run.json"
"""Written beside a run's metrics when it finished (exit code 0): a rerun of the same comparison
keeps it instead of training it again."""
# A grad-norm spike: a step whose grad norm exceeds this multiple of the run's median.
SPIKE_FACTOR = 5.0
# Metrics averaged over the run for the summary (missing ones are reported as null).
MEAN_METRICS = (
    "clip_frac_token",
    "clip_frac_seq",
    "routing_change_frac",
    "routing_change_frac_vs_rollout",
    "routing_mismatch_vs_rollout",
    "kl",
    "rollout_kl_k3",
    "rollout_log_prob_abs_diff",
    "rollout_log_ppl_abs_diff",
    "seq_log_ratio_abs_mean",
    "rollout_correction/truncated_frac_token",
    "staleness_mean",
    "step_time_s",
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="tools/compare_grpo_gspo.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument(
        "--suite",
        choices=list(SUITES),
        default="standard",
        help="standard: GSPO vs GRPO (+R2/R3), fp32 engine; mismatch: a bfloat16 engine, old "
        "log-probs recomputed vs the engine's, TIS, R2, R3; async: synchronous vs "
        "rollout.max_staleness=1; attribution: the mismatch's sources one at a time, with "
        "and without corrections (--sources, --corrections)",
    )
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of the suite's variants (default: all); "
        + "; ".join(
            f"{name}: {', '.join(suite)}" for name, suite in SUITES.items() if name != "attribution"
        )
        + "; attribution: SOURCE or SOURCE+CORRECTION (rather --sources and --corrections)",
    )
    parser.add_argument(
        "--regime",
        choices=list(REGIMES),
        default=None,
        help="demo: the preset's learning rate; paper: lr 1e-3, one update moves token ratios "
        "little as in the GSPO paper (default: paper with --quick, else demo)",
    )
    parser.add_argument(
        "--rollout-engine",
        choices=("embedded", "sglang"),
        default="embedded",
        help="mismatch suite only: embedded (the project's engine with rollout.dtype=bfloat16) or "
        "sglang (a real SGLang server in bfloat16, one launched per variant)",
    )
    parser.add_argument(
        "--sglang-python",
        default=None,
        help="--rollout-engine sglang: the interpreter of SGLang's own environment (default: "
        f"${SGLANG_VENV_ENV}/bin/python when set, else this Python)",
    )
    parser.add_argument(
        "--sglang-device",
        choices=("cpu", "cuda"),
        default=None,
        help="--rollout-engine sglang: where SGLang runs (default: cuda when torch sees a GPU); "
        "cpu adds the CPU backend's flags and environment",
    )
    parser.add_argument(
        "--architecture",
        choices=list(ARCHITECTURES),
        default=None,
        help="the model family of every variant's tiny model: qwen3_moe (the CPU demo's), "
        "glm4_moe (GLM-4.5's router, shared expert, dense first layer, partial RoPE) or "
        "deepseek_v3 (the same router with multi-head latent attention and YaRN); default: the "
        "preset's model. Not with --preset or a model.hf_path override",
    )
    compare_attribution.add_arguments(parser)
    parser.add_argument("--preset", default=None, help="preset name or YAML path for every run")
    parser.add_argument("--steps", type=int, default=None, help="RL steps per variant")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed shared by every variant; with --seeds, the first seed (default 1234)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run every variant at this many seeds and report means with 95%% intervals and "
        "paired differences (default 1)",
    )
    parser.add_argument(
        "--jobs", type=int, default=1, help="runs at once, each with 1/jobs of the cores"
    )
    parser.add_argument(
        "--reward-threshold",
        type=float,
        default=0.5,
        help="steps to threshold: the first step whose 5-step mean reward reaches it",
    )
    parser.add_argument(
        "--collapse-drop",
        type=float,
        default=0.2,
        help="collapse: the 5-step mean reward falls this far below its best and stays down",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few minutes on CPU: 6 steps of the tiny demo with 4 prompts x 4 samples "
        "after a 10-step cold start, in the paper regime",
    )
    parser.add_argument(
        "--launcher",
        default="",
        help="command prefix that starts a run, e.g. 'torchrun --nproc_per_node 8' "
        "(default: the current Python)",
    )
    parser.add_argument(
        "--one-process",
        action="store_true",
        help="run the variants one after another in this process instead of one process each "
        "(tiny CPU runs: start-up paid once); one process, the embedded engine, one seed",
    )
    parser.add_argument(
        "--no-plots",
        action="store_true",
        help="summary.json and summary.md only, no PNG plots (matplotlib's import and drawing "
        "are a tiny run's slowest part after the start-up); one seed",
    )
    parser.add_argument(
        "--skip-existing",
        action="store_true",
        help="reuse a variant's metrics.jsonl if its run already finished",
    )
    parser.add_argument(
        "--summarize-only", action="store_true", help="only (re)write the summary and plots"
    )
    if "--" in argv:
        split = argv.index("--")
        return parser.parse_args(argv[:split]), argv[split + 1 :]
    return parser.parse_args(argv), []


def regime_of(args: argparse.Namespace) -> str:
    if args.regime is not None:
        return args.regime
    return "paper" if args.quick else "demo"


def base_overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """Every variant's overrides before its own: the tool's, the suite's, the user's."""
    run_overrides = list(COMMON)
    if args.rollout_engine == "embedded":
        run_overrides += SUITE_COMMON[args.suite]
    if args.quick:
        run_overrides += QUICK
        if args.rollout_engine == "sglang":
            run_overrides += QUICK_SGLANG
    run_overrides += architecture_overrides(args)
    run_overrides += REGIMES[regime_of(args)]
    if args.architecture in ("glm4_moe", "deepseek_v3") and regime_of(args) == "volatile":
        run_overrides += GROUPED_VOLATILE
    if args.steps is not None:
        run_overrides.append(f"steps={args.steps}")
    if args.seed is not None and seeds_of(args) is None:
        run_overrides.append(f"seed={args.seed}")
    if args.suite == "attribution":  # after --quick's mini-batches, before the user's
        run_overrides += compare_attribution.common_overrides(args)
    return run_overrides + overrides  # the user's overrides apply to every variant


def architecture_overrides(args: argparse.Namespace) -> list[str]:
    """The model family's tiny model (none without ``--architecture``: the preset's model)."""
    return list(ARCHITECTURES[args.architecture]) if args.architecture else []


def seeds_of(args: argparse.Namespace) -> list[int] | None:
    """The seeds of a ``--seeds`` comparison; None for one run per variant."""
    if args.seeds <= 1:
        return None
    first = DEFAULT_SEED if args.seed is None else args.seed
    return [first + index for index in range(args.seeds)]


def run_dir_of(out: Path, variant: str, seed: int | None) -> Path:
    return out / variant if seed is None else out / variant / f"seed_{seed}"


def run_command(
    args: argparse.Namespace,
    variant: str,
    overrides: list[str],
    sglang: SGLangMode | None = None,
    port: int = 0,
    seed: int | None = None,
) -> list[str]:
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    command = launcher + ["-m", "megatron_gspo.train"]
    if args.preset:
        command += ["--preset", args.preset]
    run_overrides = base_overrides(args, overrides)
    if sglang is not None:
        run_overrides += sglang.overrides(port)
    if seed is not None:
        run_overrides.append(f"seed={seed}")
    if args.suite == "attribution":  # its sources may run on a model of their own
        run_overrides += compare_attribution.variant_overrides(variant, Path(args.out))
    else:
        run_overrides += SUITES[args.suite][variant]  # the variant's own come last
    run_overrides.append(f"output_dir={run_dir_of(Path(args.out), variant, seed)}")
    return command + run_overrides


def run_in_this_process(command: list[str]) -> int:
    """One variant's run by ``megatron_gspo.train.main`` in the tool's own process
    (``--one-process``): the imports and Megatron's start-up, most of a tiny run's time, are paid
    once for all variants. The trainer tears its process group and engine down at the end of a
    run, so the next one starts as a fresh process would (a run's metrics are the same)."""
    from megatron_gspo.train import main as train_main

    arguments = command[command.index("megatron_gspo.train") + 1 :]
    try:
        return train_main(arguments)
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else 1
    except Exception:  # the variant failed; the others still run, as with a subprocess
        traceback.print_exc()
        return 1


def previous_engine(out: Path) -> str | None:
    """The engine an earlier summary of ``out`` named (kept by ``--summarize-only``)."""
    try:
        return json.loads((out / "summary.json").read_text()).get("rollout_engine")
    except (OSError, ValueError):
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _number(value) -> float | None:
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def summarize_variant(records: list[dict], wall_time_s: float | None, exit_code: int | None):
    def series(name: str) -> list[float]:
        return [v for v in (_number(r.get(name)) for r in records) if v is not None]

    rewards = series("reward_mean")
    tail = rewards[-max(1, len(rewards) // 10) :] if rewards else []
    grad_norms = series("grad_norm_max") or series("grad_norm")
    median_norm = statistics.median(grad_norms) if grad_norms else None
    summary = {
        "steps": len(records),
        "exit_code": exit_code,
        "final_reward": statistics.fmean(tail) if tail else None,
        "best_reward": max(rewards) if rewards else None,
        "first_reward": rewards[0] if rewards else None,
        "grad_norm_spikes": sum(n > SPIKE_FACTOR * median_norm for n in grad_norms)
        if median_norm
        else 0,
        "non_finite_steps": int(max(series("skipped_total"), default=0.0)),
        "wall_time_s": wall_time_s,
    }
    for name in MEAN_METRICS:
        values = series(name)
        summary[f"mean_{name}"] = statistics.fmean(values) if values else None
    prefix = "routing_mismatch_vs_rollout/layer_"
    layers = sorted({k for r in records for k in r if k.startswith(prefix)})
    summary["mean_routing_mismatch_vs_rollout_per_layer"] = {
        name[len(prefix) :]: statistics.fmean(series(name)) for name in layers if series(name)
    }
    return summary


def write_markdown(summary: dict, path: Path) -> None:
    columns = [
        ("final_reward", "final reward"),
        ("best_reward", "best reward"),
        ("mean_clip_frac_token", "clip frac (tokens)"),
        ("mean_clip_frac_seq", "clip frac (seqs)"),
        ("mean_routing_change_frac", "routing change"),
        ("mean_routing_mismatch_vs_rollout", "experts vs engine"),
        ("mean_rollout_kl_k3", "train-rollout KL"),
        ("mean_rollout_log_prob_abs_diff", "train-rollout abs dlp"),
        ("mean_seq_log_ratio_abs_mean", "abs seq log ratio"),
        ("mean_kl", "KL"),
        ("mean_staleness_mean", "staleness"),
        ("mean_step_time_s", "step time (s)"),
        ("grad_norm_spikes", "grad-norm spikes"),
        ("non_finite_steps", "non-finite steps"),
        ("wall_time_s", "wall time (s)"),
    ]
    lines = [
        "| variant | " + " | ".join(title for _, title in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for variant, values in summary["variants"].items():
        cells = []
        for key, _ in columns:
            value = values.get(key)
            if value is None:
                cells.append("n/a")
            elif isinstance(value, float):
                cells.append(f"{value:.4g}")
            else:
                cells.append(str(value))
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    ratio = summary.get("clip_frac_token_ratio_gspo_over_grpo")
    if ratio is not None:
        lines.append("")
        lines.append(
            f"GSPO clips {ratio:.3g}x the token fraction GRPO clips (the GSPO paper reports "
            "about two orders of magnitude more)."
        )
    elif summary["variants"].get("grpo", {}).get("mean_clip_frac_token") == 0.0:
        lines.append("")
        lines.append("GRPO clipped no token in these steps; GSPO's fraction is in the table.")
    if summary.get("rollout_engine"):
        lines.append("")
        lines.append(f"Rollout engine: {summary['rollout_engine']}.")
    path.write_text("\n".join(lines) + "\n")


def plot(runs: dict[str, list[list[dict]]], out: Path) -> list[str]:
    """The panels' PNGs in ``out``: each variant's curve (``runs``: its runs, one per seed),
    over several seeds the mean with its 95% interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward_mean", "mean reward", "reward.png", False),
        ("clip_frac_token", "clipped token fraction", "clip_fraction.png", True),
        ("routing_change_frac", "routing change fraction", "routing_change.png", False),
        ("rollout_kl_k3", "trainer vs rollout k3 KL", "logprob_gap.png", True),
        (
            "routing_mismatch_vs_rollout",
            "experts used by the trainer vs the engine's",
            "routing_vs_engine.png",
            False,
        ),
    ]
    written = []
    for key, title, filename, log_scale in panels:
        figure, axis = plt.subplots(figsize=(6, 4))
        drawn = False
        for variant, seed_runs in runs.items():
            by_step: dict[int, list[float]] = {}
            for records in seed_runs:
                for record in records:
                    value = _number(record.get(key))
                    if value is not None and (value > 0 or not log_scale):
                        by_step.setdefault(record["step"], []).append(value)
            if not by_step:
                continue
            steps = sorted(by_step)
            intervals = [mean_interval(by_step[step]) for step in steps]
            line = axis.plot(steps, [i["mean"] for i in intervals], label=variant, marker=".")
            banded = [(st, i) for st, i in zip(steps, intervals) if i["low"] is not None]
            if banded:
                low = [i["low"] if not log_scale else max(i["low"], 1e-12) for _, i in banded]
                axis.fill_between(
                    [st for st, _ in banded],
                    low,
                    [i["high"] for _, i in banded],
                    color=line[0].get_color(),
                    alpha=0.2,
                )
            drawn = True
        if not drawn:
            axis.text(0.5, 0.5, f"no {key} logged", ha="center", transform=axis.transAxes)
        if log_scale and drawn:
            axis.set_yscale("log")
        axis.set_xlabel("step")
        axis.set_ylabel(title)
        axis.set_title(title)
        if drawn:
            axis.legend()
        figure.tight_layout()
        figure.savefig(out / filename, dpi=110)
        plt.close(figure)
        written.append(filename)
    return written


def summarize(
    out: Path,
    variants: list[str],
    timing: dict[str, tuple],
    *,
    suite: str = "standard",
    regime: str = "demo",
    rollout_engine: str | None = None,
    architecture: str | None = None,
    plots: bool = True,
) -> dict:
    runs = {variant: read_metrics(out / variant) for variant in variants}
    summary: dict = {"suite": suite, "regime": regime, "variants": {}}
    if architecture is not None:
        summary["architecture"] = architecture
    if rollout_engine is not None:
        summary["rollout_engine"] = rollout_engine
    for variant in variants:
        wall, code = timing.get(variant, (None, None))
        summary["variants"][variant] = summarize_variant(runs[variant], wall, code)
    gspo = summary["variants"].get("gspo", {}).get("mean_clip_frac_token")
    grpo = summary["variants"].get("grpo", {}).get("mean_clip_frac_token")
    summary["clip_frac_token_ratio_gspo_over_grpo"] = (
        gspo / grpo if gspo is not None and grpo else None
    )
    summary["plots"] = (
        plot({variant: [records] for variant, records in runs.items()}, out) if plots else []
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_markdown(summary, out / "summary.md")
    return summary


SEED_STATISTICS = (
    ("final_reward", "final reward"),
    ("reward_auc", "reward AUC / step"),
    ("steps_to_threshold", "steps to threshold"),
    ("collapsed", "collapsed"),
    ("mean_clip_frac_token", "clip frac (tokens)"),
    ("mean_clip_frac_seq", "clip frac (seqs)"),
    ("mean_routing_change_frac", "routing volatility"),
    ("grad_norm_spikes", "grad-norm spikes"),
    ("mean_rollout_kl_k3", "train-rollout KL"),
)
"""The statistics a ``--seeds`` summary gives with intervals (key, title)."""


def summarize_seeds(
    out: Path,
    variants: list[str],
    seeds: list[int],
    timing: dict[tuple, tuple],
    *,
    suite: str,
    regime: str,
    threshold: float,
    collapse_drop: float,
    rollout_engine: str | None = None,
    architecture: str | None = None,
) -> dict:
    """summary.json, summary.md and the banded plots of a comparison over ``seeds``."""
    runs = {
        variant: {seed: read_metrics(run_dir_of(out, variant, seed)) for seed in seeds}
        for variant in variants
    }
    summary: dict = {
        "suite": suite,
        "regime": regime,
        "seeds": seeds,
        "interval": "95% Student-t over seeds",
        "reward_threshold": threshold,
        "collapse_drop": collapse_drop,
        **({"architecture": architecture} if architecture is not None else {}),
        "variants": {},
        "paired": {},
    }
    if rollout_engine is not None:
        summary["rollout_engine"] = rollout_engine
    per_seed: dict[str, dict[int, dict]] = {}
    for variant in variants:
        per_seed[variant] = {}
        for seed, records in runs[variant].items():
            if not records:
                continue
            wall, code = timing.get((variant, seed), (None, None))
            values = summarize_variant(records, wall, code)
            rewards = [_number(r.get("reward_mean")) for r in records]
            values.update(
                reward_curve_statistics(
                    [r for r in rewards if r is not None],
                    threshold=threshold,
                    collapse_drop=collapse_drop,
                )
            )
            per_seed[variant][seed] = values
        summary["variants"][variant] = {
            "per_seed": {str(seed): values for seed, values in per_seed[variant].items()},
            **{key: _across_seeds(per_seed[variant], key) for key, _ in SEED_STATISTICS},
        }
    baseline = variants[0]
    for variant in variants[1:]:
        summary["paired"][f"{variant} - {baseline}"] = {
            key: paired_difference(
                _by_seed(per_seed[variant], key), _by_seed(per_seed[baseline], key)
            )
            for key, _ in SEED_STATISTICS
        }
    summary["plots"] = plot({variant: list(runs[variant].values()) for variant in variants}, out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_seed_markdown(summary, out / "summary.md")
    return summary


def _by_seed(values_by_seed: dict[int, dict], key: str) -> dict[int, float]:
    return {
        seed: values[key]
        for seed, values in values_by_seed.items()
        if _number(values.get(key)) is not None
    }


def _across_seeds(values_by_seed: dict[int, dict], key: str) -> dict:
    return mean_interval(list(_by_seed(values_by_seed, key).values()))


def _interval_cell(interval: dict) -> str:
    if interval["mean"] is None:
        return "n/a"
    if interval["low"] is None:
        return f"{interval['mean']:.4g} (n={interval['n']})"
    return f"{interval['mean']:.4g} [{interval['low']:.3g}, {interval['high']:.3g}]"


def write_seed_markdown(summary: dict, path: Path) -> None:
    """Means with their intervals per variant, then each variant's paired difference from the
    first (a star where the interval excludes zero)."""
    titles = [title for _, title in SEED_STATISTICS]
    lines = [
        f"Seeds {summary['seeds']}: mean [95% Student-t interval over seeds]. Steps to threshold "
        f"(5-step mean reward >= {summary['reward_threshold']}) over the seeds that reached it "
        f"(n); collapsed: the fraction of seeds whose reward fell more than "
        f"{summary['collapse_drop']} below its best and stayed down.",
        "",
        "| variant | " + " | ".join(titles) + " |",
        "|---|" + "---:|" * len(titles),
    ]
    for variant, values in summary["variants"].items():
        cells = [_interval_cell(values[key]) for key, _ in SEED_STATISTICS]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    if summary["paired"]:
        lines += [
            "",
            "Paired differences on the same seeds (* : the interval excludes zero):",
            "",
            "| difference | " + " | ".join(titles) + " |",
            "|---|" + "---:|" * len(titles),
        ]
        for name, differences in summary["paired"].items():
            cells = []
            for key, _ in SEED_STATISTICS:
                difference = differences[key]
                star = " *" if difference["excludes_zero"] else ""
                cells.append(_interval_cell(difference) + star)
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if summary.get("rollout_engine"):
        lines += ["", f"Rollout engine: {summary['rollout_engine']}."]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    suite = SUITES[args.suite]
    variants = (
        [v.strip() for v in args.variants.split(",") if v.strip()] if args.variants else list(suite)
    )
    misplaced = compare_attribution.options_without_suite(args)
    if misplaced:
        print(
            f"compare_grpo_gspo.py: {', '.join(misplaced)} belong to --suite attribution, "
            f"not {args.suite}",
            file=sys.stderr,
        )
        return 2
    if args.suite == "attribution" and not args.variants:
        variants, problems = compare_attribution.selected_variants(args, overrides)
        if problems:
            print(
                "compare_grpo_gspo.py: --suite attribution: " + "; ".join(problems), file=sys.stderr
            )
            return 2
    if args.architecture and (
        args.preset or any(o.startswith(("model.hf_path=", "+model.hf_path=")) for o in overrides)
    ):
        print(
            "compare_grpo_gspo.py: --architecture builds a tiny model of that family; the preset "
            "or model.hf_path names a model already: give one or the other",
            file=sys.stderr,
        )
        return 2
    if args.one_process and (
        args.launcher
        or args.seeds > 1
        or args.rollout_engine != "embedded"
        or args.suite == "attribution"
    ):
        print(
            "compare_grpo_gspo.py: --one-process runs one seed of each variant in this process "
            "on the embedded engine: not with --launcher, --seeds, --rollout-engine sglang or "
            "--suite attribution",
            file=sys.stderr,
        )
        return 2
    if args.no_plots and (args.seeds > 1 or args.suite == "attribution"):
        print(
            "compare_grpo_gspo.py: --no-plots is for one seed outside the attribution suite",
            file=sys.stderr,
        )
        return 2
    if args.seeds < 1 or args.jobs < 1:
        print(
            f"--seeds ({args.seeds}) and --jobs ({args.jobs}) must be at least 1", file=sys.stderr
        )
        return 2
    unknown = [v for v in variants if v not in suite]
    if unknown:
        print(
            f"unknown variant(s) {unknown} of the {args.suite} suite; known: {', '.join(suite)}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sglang, problems = (
        prepare_sglang(args, overrides, base_overrides(args, overrides))
        if not args.summarize_only
        else (None, [])
    )
    if problems:
        print("compare_grpo_gspo.py: cannot run this combination:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    env = {**os.environ, **(sglang.env if sglang else {})}
    seeds = seeds_of(args)
    if args.suite == "attribution":
        return compare_attribution_runs(args, overrides, variants, env)
    if seeds is not None:
        return compare_over_seeds(args, overrides, variants, seeds, sglang, env)
    timing: dict[str, tuple] = {}
    failed = []
    for variant in variants if not args.summarize_only else []:
        run_dir = out / variant
        records = read_metrics(run_dir)
        if args.skip_existing and records:
            continue
        port = 0
        if sglang is not None:
            from megatron_gspo.weight_sync import free_port

            port = free_port("127.0.0.1")
        command = run_command(args, variant, overrides, sglang, port)
        print(f"[compare] {variant}: {shlex.join(command)}", flush=True)
        started = time.perf_counter()
        if args.one_process:
            code = run_in_this_process(command)
        else:
            code = subprocess.call(command, env=env)
        timing[variant] = (time.perf_counter() - started, code)
        if code != 0:
            failed.append(variant)
            print(f"[compare] {variant} failed with exit code {code}", file=sys.stderr)
    summary = summarize(
        out,
        variants,
        timing,
        suite=args.suite,
        regime=regime_of(args),
        rollout_engine=sglang.describe() if sglang else previous_engine(out),
        architecture=args.architecture,
        plots=not args.no_plots,
    )
    print((out / "summary.md").read_text())
    print(f"[compare] wrote {out / 'summary.json'}, summary.md and {', '.join(summary['plots'])}")
    return 1 if failed else 0


def compare_over_seeds(
    args: argparse.Namespace,
    overrides: list[str],
    variants: list[str],
    seeds: list[int],
    sglang: SGLangMode | None,
    env: dict[str, str],
) -> int:
    """Every variant at every seed, ``args.jobs`` at a time; finished runs are kept."""
    out = Path(args.out)
    if args.jobs > 1 and "OMP_NUM_THREADS" not in env:
        # Runs at once share the cores: each takes its part instead of every core.
        env = {**env, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs))}
    timing: dict[tuple, tuple] = {}
    waiting = []
    for variant in variants:
        for seed in seeds:
            finished = _finished(run_dir_of(out, variant, seed))
            if finished is not None:
                timing[(variant, seed)] = (finished["wall_time_s"], 0)
                print(f"[compare] {variant} seed {seed}: finished before, kept", flush=True)
            elif not args.summarize_only:
                waiting.append((variant, seed))
    running: dict[tuple, tuple] = {}
    failed = []
    while waiting or running:
        while waiting and len(running) < args.jobs:
            variant, seed = waiting.pop(0)
            port = 0
            if sglang is not None:
                from megatron_gspo.weight_sync import free_port

                port = free_port("127.0.0.1")
            command = run_command(args, variant, overrides, sglang, port, seed)
            log = None
            if args.jobs > 1:  # one log per run, not the runs' lines interleaved
                log_path = out / variant / f"seed_{seed}.log"
                log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(log_path, "w")  # noqa: SIM115 (closed when the run ends)
                print(f"[compare] {variant} seed {seed}: {shlex.join(command)} > {log_path}")
            else:
                print(f"[compare] {variant} seed {seed}: {shlex.join(command)}", flush=True)
            process = subprocess.Popen(command, env=env, stdout=log, stderr=log)
            running[(variant, seed)] = (process, time.perf_counter(), log, command)
        time.sleep(0.5)
        for key, (process, started, log, command) in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[key]
            if log is not None:
                log.close()
            wall = time.perf_counter() - started
            timing[key] = (wall, code)
            variant, seed = key
            if code == 0:
                marker = run_dir_of(out, variant, seed) / FINISHED
                marker.write_text(
                    json.dumps({"exit_code": 0, "wall_time_s": wall, "command": command}) + "\n"
                )
            else:
                failed.append(key)
                print(
                    f"[compare] {variant} seed {seed} failed with exit code {code}", file=sys.stderr
                )
    summary = summarize_seeds(
        out,
        variants,
        seeds,
        timing,
        suite=args.suite,
        regime=regime_of(args),
        threshold=args.reward_threshold,
        collapse_drop=args.collapse_drop,
        rollout_engine=sglang.describe() if sglang else previous_engine(out),
        architecture=args.architecture,
    )
    print((out / "summary.md").read_text())
    print(f"[compare] wrote {out / 'summary.json'}, summary.md and {', '.join(summary['plots'])}")
    return 1 if failed else 0


def compare_attribution_runs(
    args: argparse.Namespace, overrides: list[str], variants: list[str], env: dict[str, str]
) -> int:
    """The attribution suite: every variant at every seed (one seed without ``--seeds``, in the
    same ``<variant>/seed_<seed>`` layout), the usual summary, then ``attribution.md`` /
    ``attribution.json`` and its plots (tools/compare_attribution.py)."""
    seeds = seeds_of(args) or [DEFAULT_SEED if args.seed is None else args.seed]
    out = Path(args.out)
    problems = [] if args.summarize_only else compare_attribution.prepare_models(variants, out)
    if problems:
        print("compare_grpo_gspo.py: --suite attribution: " + "; ".join(problems), file=sys.stderr)
        return 2
    code = compare_over_seeds(args, overrides, variants, seeds, None, env)
    runs = {
        variant: {seed: read_metrics(run_dir_of(out, variant, seed)) for seed in seeds}
        for variant in variants
    }
    summary = compare_attribution.summarize(
        out,
        runs,
        algorithm=args.algorithm,
        mini_batches=args.attribution_mini_batches,
        threshold=args.reward_threshold,
        collapse_drop=args.collapse_drop,
    )
    print((out / "attribution.md").read_text())
    print(
        f"[compare] wrote {out / 'attribution.json'}, attribution.md and {', '.join(summary['plots'])}"
    )
    return code


def _finished(run_dir: Path) -> dict | None:
    """The record of a run of ``run_dir`` that finished, or None (never ran, failed, killed)."""
    try:
        record = json.loads((run_dir / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("exit_code") == 0 else None


if __name__ == "__main__":
    sys.exit(main())
