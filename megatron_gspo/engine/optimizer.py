"""The optimizer and learning-rate schedule of the policy: Megatron's AdamW, global grad-norm
clipping with the norm computed once, and the warm-up / decay schedule over the run's optimizer
steps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig, clip_grads, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_gspo.config import TrainConfig
from megatron_gspo.engine.compat import cuda_available
from megatron_gspo.engine.optimizer_state import sub_optimizers


def build_optimizer(cfg: TrainConfig, model: Sequence[torch.nn.Module]):
    """Megatron AdamW (distributed optimizer when ``parallel.use_distributed_optimizer``) with
    global grad-norm clipping ``optim.clip_grad``.

    Checkpoints do not use Megatron's optimizer ``sharded_state_dict`` (whose distributed
    variants do not resume exactly on megatron-core 0.16.1): ``engine/optimizer_state.py`` saves
    the Adam state sharded like the parameters, so both optimizers resume exactly at any layout.
    """
    optim = cfg.optim
    bf16 = cfg.model.dtype == "bfloat16"
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=bf16,
        fp16=False,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    # Gloo sub-groups are not created on CPU (every group already is gloo there).
    optimizer = get_megatron_optimizer(
        config, list(model), use_gloo_process_groups=cuda_available()
    )
    if not cuda_available():
        # Without TE/apex Megatron falls back to torch.optim.AdamW with neither `foreach` nor
        # `fused`: a Python loop over tensors. Torch's fused CPU kernel applies the same update
        # (equal to float rounding: ~1 ulp per step) several times faster. Set before the first
        # step, which creates the state.
        for sub in sub_optimizers(optimizer):
            for group in sub.optimizer.param_groups:
                group["fused"] = True
    return optimizer


def clip_gradients(optimizer: Any, total_norm: float) -> None:
    """Scale the main gradients by ``min(1, clip_grad / total_norm)``: what Megatron's
    ``ChainedOptimizer.step`` does after computing the global norm a second time (two more
    all-reduces per sub-optimizer), with the norm the caller already has.

    On CPU the scaling is one ``_foreach_mul_`` with Megatron's coefficient ``clip_grad /
    (total_norm + 1e-6)`` (the same products as ``clip_grad_by_total_norm_fp32``, without its
    per-parameter DTensor, detach and type checks: ~0.4 ms per optimizer step of the tiny model).
    """
    for sub in sub_optimizers(optimizer):
        parameters = sub.get_parameters()
        if not parameters or sub.config.clip_grad <= 0.0:
            continue
        decoupled = sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
        if not cuda_available() and not decoupled:
            coefficient = sub.config.clip_grad / (total_norm + 1.0e-6)
            grads = [p.grad for p in parameters if p.grad is not None]
            if coefficient < 1.0 and grads:
                torch._foreach_mul_(grads, coefficient)
            continue
        clip_grads.clip_grad_by_total_norm_fp32(
            parameters,
            max_norm=sub.config.clip_grad,
            total_norm=total_norm,
            use_decoupled_grad=decoupled,
        )


def optimizer_steps_per_run(cfg: TrainConfig) -> int:
    return cfg.steps * cfg.algo.ppo_epochs * cfg.algo.num_mini_batches


def build_scheduler(cfg: TrainConfig, optimizer: Any) -> OptimizerParamScheduler:
    """Linear warm-up over ``optim.lr_warmup_steps`` then ``lr_decay_style`` to ``min_lr`` at the
    last optimizer step of the run. Optimizer step ``k`` (0-based) of the warm-up uses
    ``lr (k + 1) / warmup`` (Megatron's would use 0 at the first step)."""
    optim = cfg.optim
    total = max(optimizer_steps_per_run(cfg), optim.lr_warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_steps,
        lr_decay_steps=total,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    scheduler.step(1)
    return scheduler
