"""Worker for the layout-equivalence tests (run under torchrun, or alone for the reference).

Reference mode (one process): for each case, seed-initialise the model, run one GSPO
forward/backward and optimizer step on a fixed batch of variable-length samples, and save the
full weights, gradients, metrics and log-probs by global name. It also checks that 1 and 4
micro-batches give the same gradient.

Layout mode (several processes): for each ``case:layout`` run the same step and compare with the
reference; every rank writes what it measured (max errors per check) to ``--out``/rank{r}.json.

Layouts are dot-separated: ``tp2.pp2.ep2.cp2.etp2.vpp2.distopt`` (data parallel is what is left).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")

from megatron_gspo.algo import RunningMoments, advantage_settings  # noqa: E402
from megatron_gspo.algo import distillation_settings as make_distillation_settings  # noqa: E402
from megatron_gspo.config import TrainConfig, from_dict  # noqa: E402
from megatron_gspo.engine.optimizer_state import sub_optimizers  # noqa: E402
from megatron_gspo.engine.parallel import destroy_parallel  # noqa: E402
from megatron_gspo.engine.sharding import gather_full_state, iter_global_parameters  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402
from megatron_gspo.samples import TrainSample  # noqa: E402
from megatron_gspo.trainer.stages import assign_advantages  # noqa: E402

VOCAB = 64
MODELS = {
    # Qwen3-MoE: QK-norm, renormalised top-2 of 8 experts, load-balancing loss on.
    "moe": dict(
        architecture="qwen3_moe",
        num_layers=4,
        num_experts=8,
        moe_router_topk=2,
        moe_aux_loss_coef=0.01,
    ),
    # Qwen2-MoE: q/k/v bias, gated shared expert, top-k without renormalisation, a dense first
    # layer.
    "qwen2": dict(
        architecture="qwen2_moe",
        num_layers=2,
        num_experts=4,
        moe_router_topk=2,
        moe_renormalize_topk=False,
        qk_layernorm=False,
        add_qkv_bias=True,
        shared_expert_intermediate_size=32,
        first_k_dense_layers=1,
    ),
    # Dense Qwen3 with tied embeddings (a tied copy on the last stage under pp).
    "dense": dict(architecture="qwen3", num_layers=2, tie_word_embeddings=True),
    # GLM-4.5: a dense first layer, then sigmoid routing with a correction bias (set non-zero
    # by set_expert_bias, updated by the step: aux-loss-free balancing from the token counts
    # all-reduced over tp x cp x dp), top-1 of 2 groups, scaled top-2, an un-gated shared
    # expert, partial RoPE, q/k/v bias.
    "glm4": dict(
        architecture="glm4_moe",
        num_layers=2,
        num_experts=8,
        moe_router_topk=2,
        first_k_dense_layers=1,
        shared_expert_intermediate_size=48,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_router_bias_update_rate=1e-3,
        rotary_percent=0.5,
        add_qkv_bias=True,
    ),
    # DeepSeek-V3: GLM-4.5's router (correction bias updated by the step, groups, scaling,
    # shared expert, dense first layer) with multi-head latent attention (low-rank query,
    # key/value latent, a value width of its own) and YaRN with the softmax mscale.
    "deepseek": dict(
        architecture="deepseek_v3",
        num_layers=2,
        num_query_groups=4,
        num_experts=8,
        moe_router_topk=2,
        first_k_dense_layers=1,
        shared_expert_intermediate_size=48,
        moe_router_num_groups=2,
        moe_router_group_topk=1,
        moe_router_topk_scaling_factor=2.5,
        moe_router_bias_update_rate=1e-3,
        qk_layernorm=False,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=12,
        rope_theta=10000.0,
        rope_scaling_factor=4.0,
        rope_scaling_original_max_position_embeddings=32,
        yarn_mscale_all_dim=1.0,
    ),
}
VARIANTS = {
    # The MoE case with a rollout correction (bounds that bind on make_samples' behaviour
    # log-probs: token ratios spread ~e^+-0.5, geometric means ~e^+-0.2) or another surrogate.
    "tis": dict(rollout_correction=dict(level="token", mode="truncate", high=1.5)),
    "icepop": dict(rollout_correction=dict(level="token", mode="mask", low=0.7, high=1.5)),
    "geo_truncate": dict(rollout_correction=dict(level="sequence", mode="truncate", high=1.05)),
    "geo_mask": dict(rollout_correction=dict(level="sequence", mode="mask", low=0.95, high=1.05)),
    "cispo": dict(importance_sampling="token", surrogate="cispo", cispo=dict(weight_high=1.005)),
    "gmpo": dict(importance_sampling="token", surrogate="gmpo", gmpo=dict(log_clip=0.01)),
    # On-policy distillation's teacher term added to the RL advantages, per token (GSPO-token);
    # run_case computes the advantages with the trainer's stage from make_samples' teacher
    # log-probs.
    "distill": dict(importance_sampling="seq_token", distillation=dict(mode="added", kl_coef=0.5)),
}
"""Case name -> algo overrides on the ``moe`` model."""
DISTILLATION_CASES = ("distill",)
"""Cases whose samples get the teacher's term in their (per-token) advantages."""
BF16_CASES = {"bf16": "moe"}
"""Case name -> the model case it runs with ``model.dtype=bfloat16`` (bf16 parameters and compute,
fp32 main parameters in the optimizer, gradients accumulated and reduced in fp32)."""


def parallel_overrides(layout: str, micro_batch_tokens: int) -> dict:
    """``ParallelConfig`` fields of a layout name such as ``tp2.pp2.ep2.distopt``."""
    parallel: dict = {"micro_batch_tokens": micro_batch_tokens}
    for part in filter(None, layout.split(".")):
        if part == "distopt":
            parallel["use_distributed_optimizer"] = True
        elif part.startswith("dp"):
            continue  # data parallel is what the world size leaves; named for readability
        else:
            name = part.rstrip("0123456789")
            parallel[name] = int(part[len(name) :])
    return parallel


def make_config(case: str, layout: str, micro_batch_tokens: int) -> TrainConfig:
    parallel = parallel_overrides(layout, micro_batch_tokens)
    variant = VARIANTS.get(case, {})
    model_case = "moe" if case in VARIANTS else BF16_CASES.get(case, case)
    dtype = "bfloat16" if case in BF16_CASES else "float32"
    model = dict(vocab_size=VOCAB, hidden_size=64, head_dim=16, dtype=dtype, **MODELS[model_case])
    return from_dict(
        TrainConfig,
        dict(
            seed=7,
            model=model,
            parallel=parallel,
            algo=dict(
                rollout_batch_size=2,
                num_return_sequences_in_group=4,
                num_mini_batches=1,
                clip_low=0.01,
                clip_high=0.01,
                response_length=12,
                entropy_coef=0.01,
                **variant,
            ),
            optim=dict(lr=1e-3, clip_grad=1.0, adam_eps=1e-6),
            rollout=dict(temperature=0.9),
            # The teacher's engine is never built here: the samples carry its log-probs.
            models={"teacher": {"hf_path": "unused"}} if case in DISTILLATION_CASES else {},
        ),
    )


def add_teacher_term(samples: list[TrainSample], cfg: TrainConfig) -> None:
    """Teacher log-probs ~0.3 per token away from the old ones, and the advantages of the
    trainer's stage (rewards by group, the teacher's term per token) in place of make_samples'."""
    generator = torch.Generator().manual_seed(11)
    for index, sample in enumerate(samples):
        sample.reward = float(index % 3)
        noise = torch.randn(sample.response_length, generator=generator)
        sample.teacher_log_probs = sample.old_log_probs + 0.3 * noise
    assign_advantages(
        samples,
        advantage_settings(cfg.algo),
        RunningMoments(),
        make_distillation_settings(cfg.algo),
    )
    assert all(sample.advantages.dim() == 1 for sample in samples)


def make_samples(seed: int = 0) -> list[TrainSample]:
    """8 samples of different prompt and response lengths; one has masked tokens, one is fully
    masked (no loss token), advantages are per sequence; the rollout's behaviour log-probs are
    the old ones moved by ~0.5 per token (NaN at masked positions: never read)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(8):
        prompt = 2 + (index * 3) % 5
        response = 3 + (index * 5) % 9
        tokens = torch.randint(0, VOCAB, (prompt + response,), generator=generator)
        mask = torch.ones(response, dtype=torch.bool)
        if index == 2:
            mask[1::2] = False
        if index == 5:
            mask[:] = False
        old = -math.log(VOCAB) + 0.02 * torch.randn(response, generator=generator)
        behaviour = old - 0.5 * torch.randn(response, generator=generator)
        behaviour[~mask] = math.nan
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=prompt,
                group_id=index // 4,
                advantages=torch.randn((), generator=generator),
                loss_mask=mask,
                old_log_probs=old,
                rollout_log_probs=behaviour,
            )
        )
    return samples


def expert_biases(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """This rank's routers' correction biases (replicated buffers) by global name."""
    return {
        name: tensor.detach().clone()
        for name, tensor, _ in iter_global_parameters(engine.model, buffers=True)
        if name.endswith("expert_bias")
    }


def set_expert_bias(engine: TrainEngine) -> None:
    """A correction bias of the order of the sigmoid scores' spread, the same in every layout
    (a function of the global expert index), so that it changes which experts are selected."""
    with torch.no_grad():
        for name, tensor, _ in iter_global_parameters(engine.model, buffers=True):
            if name.endswith("expert_bias"):
                experts = torch.arange(tensor.numel(), dtype=torch.float32)
                tensor.copy_(0.01 * torch.cos(3.0 * experts))


def run_case(case: str, layout: str, micro_batch_tokens: int) -> dict:
    """One optimizer step; returns full tensors (this rank's parameters) and metrics."""
    if dist.is_initialized():
        destroy_parallel(destroy_process_group=False)
    cfg = make_config(case, layout, micro_batch_tokens)
    engine = TrainEngine(cfg)
    set_expert_bias(engine)
    samples = make_samples()
    if case in DISTILLATION_CASES:
        add_teacher_term(samples, cfg)
    start = time.perf_counter()
    weights0 = gather_full_state(engine.model)
    metrics = engine.forward_backward(samples)
    grads = gather_full_state(engine.model, grads=True)
    metrics = engine.optimizer_step(metrics)
    weights1 = gather_full_state(engine.model)
    log_probs = engine.forward_log_probs(samples).log_probs
    seconds = time.perf_counter() - start
    return dict(
        expert_bias1=expert_biases(engine),
        precision=precision(engine),
        weights0=weights0,
        grads=grads,
        weights1=weights1,
        metrics=metrics,
        log_probs=log_probs,
        seconds=seconds,
    )


def precision(engine: TrainEngine) -> dict[str, list[str]]:
    """The dtypes this rank holds: model parameters, their DDP gradient buffers (``main_grad``),
    the tensors the inner torch optimizer updates (Megatron's main parameters) and the log-probs."""
    parameters = [p for chunk in engine.model for p in chunk.parameters()]
    main = [
        p
        for sub in sub_optimizers(engine.optimizer)
        for group in sub.optimizer.param_groups
        for p in group["params"]
    ]
    return dict(
        params=sorted({str(p.dtype) for p in parameters}),
        main_grads=sorted({str(p.main_grad.dtype) for p in parameters}),
        main_params=sorted({str(p.dtype) for p in main}),
    )


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.double().norm().item()
    error = (value.double() - reference.double()).norm().item()
    return error / scale if scale > 1e-12 else error


def compare(result: dict, reference: dict, *, distributed_optimizer: bool) -> dict:
    """Max errors of this rank's tensors against the one-process reference. The distributed
    optimizer reduce-scatters gradients (each rank keeps only its shard of ``main_grad``), so
    there only the step's outcome (grad norm, new weights) is compared."""
    report: dict = {
        "names": sorted(result["grads"]),
        "seconds": result["seconds"],
        "precision": result["precision"],
    }
    report["weights0_max_abs"] = max(
        (result["weights0"][n] - reference["weights0"][n]).abs().max().item()
        for n in result["weights0"]
    )
    if not distributed_optimizer:
        errors = {
            n: relative_error(result["grads"][n], reference["grads"][n]) for n in result["grads"]
        }
        worst = max(errors, key=errors.get)
        report["grad_max_rel"] = errors[worst]
        report["grad_worst"] = worst
    report["weights1_max_abs"] = max(
        (result["weights1"][n] - reference["weights1"][n]).abs().max().item()
        for n in result["weights1"]
    )
    report["log_probs_max_abs"] = max(
        (a - b).abs().max().item() for a, b in zip(result["log_probs"], reference["log_probs"])
    )
    if result["expert_bias1"]:
        # Updated from token counts summed over tp x cp x dp: bit for bit.
        report["expert_bias_max_abs"] = max(
            (tensor - reference["expert_bias1"][name]).abs().max().item()
            for name, tensor in result["expert_bias1"].items()
        )
    report["metrics"] = result["metrics"]
    report["metric_rel"] = {
        name: abs(value - reference["metrics"][name]) / max(abs(reference["metrics"][name]), 1e-8)
        for name, value in result["metrics"].items()
        if name not in ("padding_tokens", "tokens", "num_micro_batches")
    }
    return report


# Token budget: every layout (dp x k = 2 micro-batches in all) groups the 8 samples the same way,
# so the per-micro-batch MoE load-balancing loss is identical too.
MICRO_BATCH_TOKENS = 60


def reference_mode(cases: list[str], out: Path) -> None:
    for case in cases:
        result = run_case(case, "", MICRO_BATCH_TOKENS)
        torch.save(result, out / f"reference_{case}.pt")
    # 1 vs 4 micro-batches (load-balancing loss off: it is a per-micro-batch statistic); the
    # loss variants' micro-batch invariance is tested on the loss itself (tests/algo).
    invariance = {}
    for case in (case for case in cases if case in MODELS):
        grads = {}
        for tokens in (10_000, 22):
            if dist.is_initialized():
                destroy_parallel(destroy_process_group=False)
            cfg = make_config(case, "", tokens)
            cfg.model.moe_aux_loss_coef = 0.0
            engine = TrainEngine(cfg)
            set_expert_bias(engine)
            metrics = engine.forward_backward(make_samples())
            grads[tokens] = (gather_full_state(engine.model, grads=True), metrics)
        (one, m1), (many, m4) = grads[10_000], grads[22]
        invariance[case] = dict(
            micro_batches=[m1["num_micro_batches"], m4["num_micro_batches"]],
            grad_max_rel=max(relative_error(many[n], one[n]) for n in one),
            loss=[m1["loss"], m4["loss"]],
        )
    (out / "micro_batch_invariance.json").write_text(json.dumps(invariance, indent=1))
    # bf16 against fp32 from the same seed (the fp32 weights rounded to bf16 at the start).
    gaps = {
        case: compare(
            torch.load(out / f"reference_{case}.pt", weights_only=False),
            torch.load(out / f"reference_{model_case}.pt", weights_only=False),
            distributed_optimizer=False,
        )
        for case, model_case in BF16_CASES.items()
        if case in cases and model_case in cases
    }
    (out / "bf16_vs_fp32.json").write_text(json.dumps(gaps, indent=1))


def layout_mode(runs: list[str], out: Path) -> None:
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
    reports = {}
    references: dict = {}
    for run in runs:
        case, layout = run.split(":")
        if case not in references:
            references[case] = torch.load(out / f"reference_{case}.pt", weights_only=False)
        result = run_case(case, layout, MICRO_BATCH_TOKENS)
        reports[run] = compare(result, references[case], distributed_optimizer="distopt" in layout)
    (out / f"rank{rank}.json").write_text(json.dumps(reports, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reference", nargs="*", default=None, help="cases to compute")
    parser.add_argument("--runs", nargs="*", default=[], help="case:layout to compare")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reference is not None:
        reference_mode(args.reference, args.out)
    else:
        layout_mode(args.runs, args.out)
    if dist.is_initialized():
        destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
