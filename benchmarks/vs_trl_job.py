"""The job of ``vs_trl.py``: model sizes, the model and prompts on disk, both frameworks' settings,
and the model FLOPs of a training step (see benchmarks/README.md, "vs TRL")."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

TASK = "digit_reversal"
PROMPTS_PER_STEP = 8
GROUP_SIZE = 8
SAMPLES_PER_STEP = PROMPTS_PER_STEP * GROUP_SIZE
MINI_BATCHES = 4
CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4
LEARNING_RATE = 1e-3
GRAD_CLIP = 1.0
STD_EPS = 1e-4
"""TRL's hard-wired epsilon of (r - mean) / (std + eps); ours is set to match."""


@dataclass(frozen=True)
class Size:
    """A Qwen3-MoE shape of the sweep (untied embeddings, every layer MoE, fp32)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    topk: int
    expert_ffn: int
    vocab: int
    response_tokens: int
    """Generated tokens per sample (exactly: EOS is masked until then)."""


SIZES = {
    # The job of the earlier tables (2026-11-21).
    "tiny": Size(64, 2, 4, 2, 16, 8, 2, 48, 64, 16),
    # Between: about the geometric middle of tiny and medium in parameters and tokens.
    "small": Size(256, 4, 8, 4, 32, 16, 4, 128, 8192, 64),
    # Issue 19's medium MoE: 141 M parameters, 36 M active per token (lm head included).
    "medium": Size(512, 8, 8, 4, 64, 32, 4, 256, 32768, 128),
}


def model_config(size: Size, vocab_size: Optional[int] = None):
    """The benchmark model as our :class:`~megatron_gspo.config.ModelConfig`."""
    from megatron_gspo.config import ModelConfig

    # Every field that shapes the network is spelled out: schema defaults change with the demo.
    return ModelConfig(
        architecture="qwen3_moe",
        vocab_size=vocab_size or size.vocab,
        hidden_size=size.hidden,
        num_layers=size.layers,
        num_attention_heads=size.heads,
        num_query_groups=size.kv_heads,
        head_dim=size.head_dim,
        ffn_hidden_size=2 * size.hidden,  # unused: no dense layers
        num_experts=size.experts,
        moe_ffn_hidden_size=size.expert_ffn,
        moe_router_topk=size.topk,
        moe_renormalize_topk=True,
        shared_expert_intermediate_size=0,
        first_k_dense_layers=0,
        qk_layernorm=True,
        add_qkv_bias=False,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        moe_aux_loss_coef=0.0,
        dtype="float32",
    )


def write_job(
    job_dir: Path, *, size_name: str, vocab_size: Optional[int], seed: int, steps: int
) -> dict[str, Any]:
    """Save the seeded HF model, the synthetic tokenizer and the prompts of ``steps`` rollout
    steps (our prompt stream's, in its order) under ``job_dir``; returns the job description."""
    import torch
    import transformers

    from megatron_gspo.config import AlgoConfig, DataConfig
    from megatron_gspo.convert.hf_config import hf_config_from_model_config
    from megatron_gspo.data import build_prompt_stream, build_synthetic_tokenizer

    size = SIZES[size_name]
    hf_config = hf_config_from_model_config(model_config(size, vocab_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, hf_config.architectures[0])(hf_config)
    model.save_pretrained(job_dir)
    tokenizer = build_synthetic_tokenizer()
    tokenizer.save_pretrained(job_dir)
    stream = build_prompt_stream(
        DataConfig(task=TASK),
        AlgoConfig(rollout_batch_size=PROMPTS_PER_STEP, response_length=size.response_tokens),
        tokenizer,
        seed=seed,
    )
    prompts = stream.next_batch(PROMPTS_PER_STEP * steps)
    rows = [
        {"prompt": p.prompt_text, "prompt_ids": list(p.prompt_ids), "answer": p.answer}
        for p in prompts
    ]
    (job_dir / "prompts.json").write_text(json.dumps(rows))
    job = {
        "dir": str(job_dir),
        "size": size_name,
        "shape": asdict(size),
        "vocab_size": vocab_size or size.vocab,
        "response_tokens": size.response_tokens,
        "seed": seed,
        "steps": steps,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    prompt_lengths = [len(row["prompt_ids"]) for row in rows[:PROMPTS_PER_STEP]]
    job["training_flops_per_step"] = training_flops(
        size, job["vocab_size"], prompt_lengths, size.response_tokens
    )
    (job_dir / "job.json").write_text(json.dumps(job))
    return job


def training_flops(
    size: Size, vocab_size: int, prompt_lengths: list[int], response_tokens: int
) -> float:
    """Model FLOPs of the training of one rollout step: forward + backward (3x the forward) of
    every sample once (each of the ``GROUP_SIZE`` samples of each prompt in ``prompt_lengths``).

    Per sample of ``P`` prompt and ``R`` response tokens, the model reads ``n = P + R - 1``
    positions (the last token predicts nothing) and scores the ``R`` response positions:

        forward = 2 n L (h (H + 2 G) d + H d h + h E + k 3 h F)  q, k, v, o, router, top-k experts
                + L 4 H d n (n + 1) / 2                          q k^T and p v, causal triangle
                + 2 R h V                                        output layer at the R positions

    Embedding lookups, norms, softmax, activations and the loss are left out (as MFU counts).
    """
    h, layers, d = size.hidden, size.layers, size.head_dim
    heads, groups = size.heads, size.kv_heads
    per_token = (
        h * (heads + 2 * groups) * d
        + heads * d * h
        + h * size.experts
        + size.topk * 3 * h * size.expert_ffn
    )
    forward = 0.0
    for prompt in prompt_lengths:
        n = prompt + response_tokens - 1
        forward += 2 * n * layers * per_token
        forward += layers * 4 * heads * d * n * (n + 1) / 2
        forward += 2 * response_tokens * h * vocab_size
    return 3.0 * forward * GROUP_SIZE


def our_overrides(
    job: dict[str, Any], output_dir: str, *, old_log_probs: str, rollout_dtype: Optional[str]
) -> list[str]:
    """Hydra overrides of our trainer for the job. Everything the job depends on is set here,
    not left to the schema defaults (those are the CPU demo's and change with it)."""
    response_tokens = job["response_tokens"]
    overrides = [
        f"model.hf_path={job['dir']}",
        f"model.vocab_size={job['vocab_size']}",
        f"steps={job['steps']}",
        f"seed={job['seed']}",
        f"output_dir={output_dir}",
        "sft_warmup_steps=0",  # RL from the saved weights, as TRL starts
        f"data.task={TASK}",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.ep=1",
        "parallel.cp=1",
        # One micro-batch per mini-batch (16 samples of 25, 73 or 137 tokens), as TRL's one
        # forward of per_device_train_batch_size samples.
        "parallel.micro_batch_tokens=4096",
        f"algo.rollout_batch_size={PROMPTS_PER_STEP}",
        f"algo.num_return_sequences_in_group={GROUP_SIZE}",
        f"algo.response_length={response_tokens}",
        f"algo.num_mini_batches={MINI_BATCHES}",
        "algo.ppo_epochs=1",
        "algo.importance_sampling=seq",
        f"algo.clip_low={CLIP_LOW}",
        f"algo.clip_high={CLIP_HIGH}",
        "algo.loss_agg_mode=seq-mean-token-mean",
        "algo.adv_estimator=grpo",
        "algo.std_unbiased=true",
        f"algo.std_eps={STD_EPS}",
        "algo.reward_norm=null",
        "algo.whiten_advantages=false",
        "algo.advantage_clip=null",
        "algo.reward_clip=null",
        "algo.dual_clip_loss=false",
        "algo.use_kl_loss=false",
        "algo.add_token_level_kl=false",
        "algo.entropy_coef=0.0",
        "algo.routing_replay=none",
        # rollout: the engine's log-probs (GSPO's natural source); recompute: a no-grad forward
        # of the trainer over the step's samples, as TRL does.
        f"algo.old_log_prob_source={old_log_probs}",
        # A metric (top-k overlap with the old routes) TRL does not compute.
        "algo.log_routing_change=false",
        f"optim.lr={LEARNING_RATE}",
        "optim.lr_decay_style=constant",
        "optim.lr_warmup_steps=0",
        "optim.weight_decay=0.0",
        f"optim.clip_grad={GRAD_CLIP}",
        "optim.min_lr=0.0",
        "optim.adam_beta1=0.9",
        "optim.adam_beta2=0.999",
        "optim.adam_eps=1e-8",
        "rollout.engine=embedded",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=-1",
        f"rollout.min_new_tokens={response_tokens}",
        # In-process rewards, as TRL computes them (worker processes would hide their memory).
        "reward.executor=thread",
        "reward.functions=[synthetic]",
        "reward.weights=[]",
        "eval.interval=0",
        "checkpoint.interval=0",
        "logging.tensorboard=false",
        "logging.wandb=false",
        "logging.progress_bar=false",
        "logging.log_level=WARNING",
    ]
    if rollout_dtype is not None:
        overrides.append(f"rollout.dtype={rollout_dtype}")
    return overrides


def trl_config(job: dict[str, Any], output_dir: str) -> dict[str, Any]:
    """``GRPOConfig`` keyword arguments. Each line overrides a TRL default that would make the
    job differ (its default in the comment), or pins one that matters (same value)."""
    response_tokens = job["response_tokens"]
    return dict(
        output_dir=output_dir,
        use_cpu=True,
        seed=job["seed"],
        data_seed=job["seed"],
        max_steps=job["steps"] * MINI_BATCHES,  # counts optimizer steps
        # Precision and memory savers.
        bf16=False,  # default True
        fp16=False,
        gradient_checkpointing=False,  # default True
        model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
        cast_lm_head_to_fp32=False,
        # Batch geometry: 4 mini-batches of 16 per generation of 8 prompts x 8.
        per_device_train_batch_size=SAMPLES_PER_STEP // MINI_BATCHES,  # default 8
        gradient_accumulation_steps=1,
        steps_per_generation=MINI_BATCHES,  # default 1
        num_generations=GROUP_SIZE,
        num_iterations=1,
        shuffle_dataset=False,  # default True: same prompt order as ours
        # GSPO loss.
        loss_type="grpo",  # default "dapo"
        importance_sampling_level="sequence",  # default "token"
        epsilon=CLIP_LOW,  # default 0.2
        epsilon_high=CLIP_HIGH,  # default None (= epsilon)
        delta=None,
        beta=0.0,
        scale_rewards="group",
        mask_truncated_completions=False,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        use_adaptive_entropy=False,
        off_policy_mask_threshold=None,
        router_aux_loss_coef=0.0,  # default: the model's own coefficient (0.001 for Qwen3-MoE)
        disable_dropout=True,  # default False (the model has no dropout anyway)
        # Optimizer and schedule.
        learning_rate=LEARNING_RATE,  # default 1e-6
        lr_scheduler_type="constant",  # default "linear" decay
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=GRAD_CLIP,
        optim="adamw_torch_fused",
        # Generation: plain transformers generate, exactly response_tokens tokens.
        use_vllm=False,
        use_transformers_paged=False,
        use_transformers_continuous_batching=False,
        max_completion_length=response_tokens,  # default 512
        generation_kwargs={"min_new_tokens": response_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        # No logging, evaluation or checkpoints inside the timed loop.
        report_to=[],
        logging_strategy="no",
        eval_strategy="no",
        save_strategy="no",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        torch_compile=False,
        use_liger_kernel=False,
    )
