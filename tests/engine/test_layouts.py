"""Every parallel layout gives the loss, gradients, updated weights and log-probs of one process.

One torchrun launch per entry of ``LAUNCHES`` runs several layouts one after the other (Megatron
groups are rebuilt between them); ``layout_worker.py`` compares each with the one-process
reference and writes its errors per rank. CI runs ``TWO_PROCESS_CI_RUNS``; the full run adds the
other two-process layouts and the 4- and 8-process ones.

Model: tiny Qwen3-MoE (4 layers, hidden 64, 8 experts top-2, vocab 64, load-balancing loss on),
Qwen2-MoE (shared expert, q/k/v bias, dense first layer) and dense Qwen3 with tied embeddings,
GLM-4.5 (``glm4``: sigmoid routing with a non-zero correction bias that the step updates from
token counts all-reduced over tp x cp x dp, groups, scaling, shared expert, partial RoPE; in dp2,
tp2, ep2, pp2 and cp2, the updated bias bit for bit), DeepSeek-V3
(``deepseek``: GLM-4.5's router with multi-head latent attention and YaRN; dp2, ep2, pp2; tp and cp
are refused at start on CPU); 8 samples of different lengths, two micro-batches in every layout.
The MoE case also runs with each rollout correction (token TIS, token mask, geometric-mean
sequence truncate and mask: the weights of sequences split by cp need the all-reduced mean) in
dp2, cp2 and pp2, with the CISPO and GMPO surrogates, and with on-policy distillation's
teacher term added to the advantages per token (``distill``: GSPO-token, dp2 and cp2).

The MoE case also runs in bf16 (``bf16``: ``model.dtype=bfloat16``, Megatron's mixed precision:
bf16 parameters and compute, fp32 main parameters, gradients accumulated and reduced in fp32)
against a one-process bf16 reference, in dp2, dp2 with the distributed optimizer, pp2, tp2, ep2,
cp2, tp2 x ep2 and tp2 x ep2 with the distributed optimizer. Tolerances (``BF16_*`` below, and
docs/megatron-cpu.md, "bf16 on CPU"): layouts that only move whole micro-batches or whole layers
(dp, the distributed optimizer, pp) compute every bf16 product on the same operands in the same
shapes, and their fp32 gradient reduction adds two per-micro-batch gradients in either order
(exact for two terms): they must match bit for bit. Layouts that split a product or move where a
bf16 rounding happens are not exact: tp2 rounds each rank's partial sum of a row-parallel GEMM to
bf16 before the all-reduce, ep2 rounds an expert's weight gradient once over both micro-batches'
tokens instead of once per micro-batch, cp2 splits the attention over key blocks. Each such
rounding is a relative error of at most the bf16 unit roundoff u = 2^-8; through 4 layers forward
and backward the measured worst (tp2 x ep2) is ~3.2 u on a gradient tensor (norm-relative) and
~1.5 u on a log-prob (absolute, log-probs ~ -4.2); the bounds are ~10 u and ~5 u. A wrong
gradient (a rank's micro-batch lost or counted twice, a missing tp all-reduce) is an O(1) error.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from worker_launch import run_worker, worker_command

WORKER = Path(__file__).with_name("layout_worker.py")

TOLERANCE = 1e-5
"""Relative (gradients: norm-relative per tensor) error allowed against one process, fp32."""

BF16_UNIT_ROUNDOFF = 2.0**-8
"""Relative error of one rounding to bf16 (8 significand bits)."""
BF16_GRAD_TOLERANCE = 10 * BF16_UNIT_ROUNDOFF
"""Norm-relative error per gradient tensor of a bf16 layout that moves roundings (measured on
CPU, megatron-core 0.16.1: worst 1.25e-2, tp2 and tp2 x ep2)."""
BF16_LOG_PROB_TOLERANCE = 5 * BF16_UNIT_ROUNDOFF
"""Absolute log-prob error of such a layout (log-probs ~ -4.2; measured worst 5.9e-3)."""
BF16_METRIC_TOLERANCE = 10 * BF16_UNIT_ROUNDOFF
"""Relative error of the step's metrics (measured worst 5.4e-3: seq_log_ratio_mean, whose value
~0.05 is a difference of log-probs; a clip fraction may move by one token in 78: 1.3e-2)."""
BF16_WEIGHT_TOLERANCE = 2 * 1e-3 + 2.0**-12
"""Weights after the AdamW step (lr 1e-3): Adam's first step moves each element by ~lr in the
direction of its gradient's sign, so an element whose gradient is near 0 may move the other way
in another layout (2 lr), plus half a bf16 ulp of the weights (|w| < 0.125: 2^-12); measured worst
2^-9. The gradients, not the weights, are what catches a wrong step here."""
BF16_EXACT_LAYOUTS = frozenset({"dp2", "dp2.distopt", "pp2"})
"""bf16 layouts that must match one process bit for bit (whole micro-batches or layers moved)."""
BF16_EXACT_METRIC_TOLERANCE = 1e-6
"""Their metrics: the metric all-reduces sum per-rank fp32 partial sums in another order."""

CORRECTIONS = ("tis", "icepop", "geo_truncate", "geo_mask")
"""MoE cases with a rollout correction (layout_worker.VARIANTS), in dp2, cp2 and pp2."""
SURROGATES = ("cispo", "gmpo")
CASES = (
    "moe",
    "qwen2",
    "dense",
    "glm4",
    "deepseek",
    *CORRECTIONS,
    *SURROGATES,
    "distill",
    "bf16",
)

TWO_PROCESS_RUNS = [
    "moe:dp2",
    "moe:dp2.distopt",
    "moe:tp2",
    "moe:pp2",
    "moe:pp2.vpp2",
    "moe:ep2",
    "moe:cp2",
    "qwen2:tp2",
    "qwen2:ep2",
    "qwen2:pp2",
    "dense:pp2",
    "dense:cp2",
    *(f"glm4:{layout}" for layout in ("dp2", "tp2", "ep2", "pp2", "cp2")),
    # MLA: tp and cp are refused at start on CPU (test_deepseek_v3_refuses_tp_and_cp).
    *(f"deepseek:{layout}" for layout in ("dp2", "ep2", "pp2")),
    *(f"{case}:{layout}" for case in CORRECTIONS for layout in ("dp2", "cp2", "pp2")),
    "cispo:cp2",
    "gmpo:cp2",
    "gmpo:pp2",
    # On-policy distillation's per-token teacher term (GSPO-token): data and context
    # parallel split the samples and their tokens.
    "distill:dp2",
    "distill:cp2",
    *(f"bf16:{layout}" for layout in ("dp2", "dp2.distopt", "pp2", "tp2", "ep2", "cp2")),
]
TWO_PROCESS_CI_RUNS = [
    # Every dimension on the MoE case.
    *(f"moe:{layout}" for layout in ("dp2", "dp2.distopt", "tp2", "pp2", "pp2.vpp2", "ep2")),
    "moe:cp2",
    "qwen2:tp2",  # the shared expert and the q/k/v bias split by tp
    "dense:pp2",  # tied embeddings: the last stage's copy of the embedding
    "glm4:dp2",  # the correction bias's token counts all-reduced over dp
    "glm4:tp2",  # ... and over tp
    "deepseek:ep2",  # multi-head latent attention beside expert parallelism
    "tis:dp2",  # a token-level correction: weights of whole samples moved by dp
    "geo_mask:cp2",  # a sequence-level one: the all-reduced mean over cp's halves
    "gmpo:cp2",  # the geometric-mean surrogate over cp's halves
    "distill:cp2",  # the teacher term per token over cp's halves
    "bf16:dp2",  # bf16 bit for bit (whole micro-batches moved)
    "bf16:tp2",  # bf16 within the rounding bound (a product split)
]
"""What CI runs at 2 processes (``test_two_process_layouts``, about half the launch's time):
every dimension once, and each case's parallel-sensitive step in the layout that splits it.
The full run adds the rest of ``TWO_PROCESS_RUNS`` (``test_two_process_layouts_of_the_full_run``)."""
LAUNCHES = {
    "two": (2, TWO_PROCESS_CI_RUNS),
    "two_full": (2, [run for run in TWO_PROCESS_RUNS if run not in TWO_PROCESS_CI_RUNS]),
    "four": (
        4,
        [
            "moe:tp2.ep2",
            "moe:tp2.ep2.etp2",
            "moe:pp2.ep2",
            "moe:tp2.pp2",
            "moe:tp2.ep2.cp2",
            "moe:tp2.ep2.distopt",
            "qwen2:tp2.pp2",
            "dense:tp2.pp2",
            "bf16:tp2.ep2",
            "bf16:tp2.ep2.distopt",
        ],
    ),
    "eight": (8, ["moe:tp2.pp2.ep2.cp2"]),
}
"""One torchrun launch each: ``(world size, runs)``."""


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layouts")
    run_worker(
        [sys.executable, str(WORKER), "--out", str(out), "--reference", *CASES],
        timeout=300,
    )
    return out


def _launch(name: str, reference_dir: Path) -> dict:
    world, runs = LAUNCHES[name]
    out = reference_dir / name
    out.mkdir(exist_ok=True)
    for case in CASES:
        link = out / f"reference_{case}.pt"
        if not link.exists():
            link.symlink_to(reference_dir / f"reference_{case}.pt")
    run_worker(
        [*worker_command(WORKER, world), "--out", str(out), "--runs", *runs],
        timeout=600,
    )
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)}


def test_one_vs_four_micro_batches(reference_dir):
    """Same gradient whether the mini-batch is one micro-batch or four (global denominators)."""
    results = json.loads((reference_dir / "micro_batch_invariance.json").read_text())
    for case, result in results.items():
        assert result["micro_batches"] == [1.0, 4.0], case
        assert result["grad_max_rel"] < TOLERANCE, (case, result)
        assert math.isclose(*result["loss"], rel_tol=1e-6), (case, result)


def test_bf16_against_fp32(reference_dir):
    """The one-process bf16 step against the fp32 step of the same seed (the fp32 initial weights
    rounded to bf16). Measured on CPU (megatron-core 0.16.1; docs/megatron-cpu.md, "bf16 on CPU"):
    initial weights 2.4e-4 apart (half a bf16 ulp of |w| < 0.125), gradients 8.3e-3 apart
    relative to their global norm (per tensor: median 1.0e-2, worst 0.11 on an expert that gets
    few tokens, where a bf16 router score can flip a token's top-k choice), log-probs 6.1e-3
    (absolute), loss 2.4e-5 and grad norm 9.6e-4 (relative). The bounds: half an ulp for the
    weights, 10 u on the global gradient, 5 u on the log-probs, 1e-3 on the loss and 10 u on the
    grad norm; log-probs come out in fp32."""
    import torch

    bf16 = torch.load(reference_dir / "reference_bf16.pt", weights_only=False)
    fp32 = torch.load(reference_dir / "reference_moe.pt", weights_only=False)
    assert {tensor.dtype for tensor in bf16["weights1"].values()} == {torch.bfloat16}
    assert {tensor.dtype for tensor in bf16["log_probs"]} == {torch.float32}
    assert bf16["precision"]["main_params"] == ["torch.float32"]
    gap = json.loads((reference_dir / "bf16_vs_fp32.json").read_text())["bf16"]
    assert gap["weights0_max_abs"] <= 2.0**-12
    squared_error = sum(
        (bf16["grads"][n].double() - fp32["grads"][n].double()).square().sum()
        for n in fp32["grads"]
    )
    squared_norm = sum(fp32["grads"][n].double().square().sum() for n in fp32["grads"])
    assert math.sqrt(squared_error / squared_norm) < BF16_GRAD_TOLERANCE
    assert 0.0 < gap["log_probs_max_abs"] < BF16_LOG_PROB_TOLERANCE
    assert gap["metric_rel"]["loss"] < 1e-3
    assert gap["metric_rel"]["grad_norm"] < BF16_GRAD_TOLERANCE


def _check_bf16_report(layout: str, report: dict, where: str) -> None:
    """A bf16 layout against the one-process bf16 step (tolerances above)."""
    assert report["weights0_max_abs"] == 0.0, where
    # Megatron's mixed precision: bf16 parameters, fp32 gradient buffers and main parameters.
    assert report["precision"] == dict(
        params=["torch.bfloat16"], main_grads=["torch.float32"], main_params=["torch.float32"]
    ), where
    exact = layout in BF16_EXACT_LAYOUTS
    if "grad_max_rel" in report:
        bound = 0.0 if exact else BF16_GRAD_TOLERANCE
        assert report["grad_max_rel"] <= bound, (
            where,
            report["grad_max_rel"],
            report["grad_worst"],
        )
    assert report["weights1_max_abs"] <= (0.0 if exact else BF16_WEIGHT_TOLERANCE), where
    assert report["log_probs_max_abs"] <= (0.0 if exact else BF16_LOG_PROB_TOLERANCE), where
    bound = BF16_EXACT_METRIC_TOLERANCE if exact else BF16_METRIC_TOLERANCE
    for name, error in report["metric_rel"].items():
        assert error < bound, (where, name, report["metrics"][name])
    assert report["metrics"]["skipped"] == 0.0


def _check_launch(name: str, reports: dict, reference_dir: Path) -> None:
    import torch

    for run in LAUNCHES[name][1]:
        case, layout = run.split(":")
        reference = torch.load(reference_dir / f"reference_{case}.pt", weights_only=False)
        names = set()
        for rank, per_run in reports.items():
            report = per_run[run]
            where = f"{run} rank {rank}"
            names.update(report["names"])
            if case == "bf16":
                _check_bf16_report(layout, report, where)
                continue
            # Seed-determined init: the same full weights in every layout, bit for bit.
            assert report["weights0_max_abs"] == 0.0, where
            if "grad_max_rel" in report:
                assert report["grad_max_rel"] < TOLERANCE, (where, report["grad_worst"])
            # After one AdamW step (lr 1e-3): a wrong gradient moves weights by ~lr.
            assert report["weights1_max_abs"] < 5e-6, where
            assert report["log_probs_max_abs"] < TOLERANCE, where
            for name, error in report["metric_rel"].items():
                assert error < TOLERANCE, (where, name, report["metrics"][name])
            assert report["metrics"]["skipped"] == 0.0
            if "expert_bias_max_abs" in report:
                assert report["expert_bias_max_abs"] == 0.0, where
        # Every parameter of the one-process model was compared somewhere.
        assert names == set(reference["grads"]), (run, set(reference["grads"]) ^ names)


@pytest.mark.distributed
def test_two_process_layouts(reference_dir):
    _check_launch("two", _launch("two", reference_dir), reference_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_process_layouts_of_the_full_run(reference_dir):
    """The other cases at 2 processes (the full run: CI runs every dimension and each case's
    parallel-sensitive step above)."""
    _check_launch("two_full", _launch("two_full", reference_dir), reference_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_four_process_layouts(reference_dir):
    """The pairs of dimensions (the full run: CI runs each dimension at 2 processes, above, and
    tp2 x ep2 at 4 in tests/engine/test_checkpoint.py and the conversion's gather)."""
    _check_launch("four", _launch("four", reference_dir), reference_dir)


@pytest.mark.slow
@pytest.mark.distributed
def test_eight_process_layout(reference_dir):
    """tp2 + pp2 + ep2 + cp2: every kind of parallelism at once (the full run, as the pairs
    above)."""
    _check_launch("eight", _launch("eight", reference_dir), reference_dir)


def test_glm4_correction_bias_moved_in_the_reference(reference_dir):
    """The layouts' bias comparison means something: the one-process step moved the non-zero
    correction bias by exactly +-rate (1e-3) where experts were under- or over-loaded."""
    import torch

    reference = torch.load(reference_dir / "reference_glm4.pt", weights_only=False)
    ((name, bias),) = reference["expert_bias1"].items()
    assert name == "decoder.layers.1.mlp.router.expert_bias"
    initial = 0.01 * torch.cos(3.0 * torch.arange(bias.numel(), dtype=torch.float32))
    delta = (bias - initial).double()
    assert (delta > 0).any() and (delta < 0).any()
    torch.testing.assert_close(delta.abs(), torch.full_like(delta, 1e-3), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "layout, key, cause",
    [
        # The rotary key's gradient misses the other tensor-parallel ranks' heads (local spec).
        (dict(tp=2), "parallel.tp", "k_pos_emb"),
        # YaRN's table for a context-parallel rank is built in pinned memory (CUDA only).
        (dict(cp=2), "parallel.cp", "pin_memory"),
    ],
)
def test_deepseek_v3_refuses_tp_and_cp(layout, key, cause):
    """MLA layouts megatron-core 0.16.1 gets wrong or cannot build on CPU fail before any model is
    built, naming the upstream place (docs/deepseek-v3.md, "Not supported")."""
    sys.path.insert(0, str(WORKER.parent))
    from layout_worker import MODELS

    from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig
    from megatron_gspo.engine.model import transformer_config

    model = ModelConfig(vocab_size=64, hidden_size=64, head_dim=16, **MODELS["deepseek"])
    with pytest.raises(ConfigError, match=key) as error:
        transformer_config(model, ParallelConfig(**layout))
    assert cause in str(error.value)
    transformer_config(model, ParallelConfig(ep=2))  # what the layouts above run
