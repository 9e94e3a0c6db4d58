"""Our GSPO loss against TRL's ``GRPOTrainer._compute_loss`` in sequence mode (anchors C4).

A real ``GRPOTrainer`` (TRL 1.16, tiny random Qwen3-MoE) is configured as the paper's GSPO
(``importance_sampling_level="sequence"``, ``loss_type="grpo"``, ``beta=0``, clip 3e-4 / 4e-4);
its ``_compute_loss`` runs unchanged on a batch whose per-token log-probs are handed in as a
leaf tensor (the one method that runs the model is replaced, so both sides see the very same
log-probs). Our ``policy_loss`` (``importance_sampling=seq``, ``seq-mean-token-mean``) gets the
same log-probs, old log-probs, advantages and mask. Loss and gradient with respect to the
log-probs agree to 1e-6 (float64; in practice to rounding), with sequences of different
lengths, both advantage signs and ratios inside and outside the clip range.

What this does not cover: the model forward that produces the log-probs (our Megatron path vs
the transformers model), which ``tests/convert`` and ``tests/engine`` check separately.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from megatron_gspo.algo import PolicyLossSettings, policy_loss  # noqa: E402

CLIP_LOW, CLIP_HIGH = 3e-4, 4e-4
BATCH, LENGTH, PROMPT = 8, 12, 5


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    import datasets
    import transformers
    import trl

    from megatron_gspo.config import ModelConfig
    from megatron_gspo.convert.hf_config import hf_config_from_model_config
    from megatron_gspo.data import build_synthetic_tokenizer

    config = hf_config_from_model_config(ModelConfig(vocab_size=64))
    torch.manual_seed(0)
    model = getattr(transformers, config.architectures[0])(config)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=BATCH,
        num_generations=4,
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=CLIP_LOW,
        epsilon_high=CLIP_HIGH,
        beta=0.0,
        router_aux_loss_coef=0.0,
        max_completion_length=LENGTH,
        report_to=[],
        disable_tqdm=True,
    )
    dataset = datasets.Dataset.from_list([{"prompt": "12<sep>"}] * BATCH)
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        processing_class=build_synthetic_tokenizer(),
    )
    # What Trainer.train() sets before the first step (gradient_accumulation_steps=1).
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _batch(seed: int):
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(BATCH, LENGTH, generator=generator, dtype=torch.float64) * 3
    # Sequence log-ratios of about +-1e-3 straddle the clip range (3e-4, 4e-4).
    old = log_probs + torch.randn(BATCH, LENGTH, generator=generator, dtype=torch.float64) * 2e-3
    advantages = torch.randn(BATCH, generator=generator, dtype=torch.float64)
    lengths = torch.randint(3, LENGTH + 1, (BATCH,), generator=generator)
    mask = torch.arange(LENGTH).unsqueeze(0) < lengths.unsqueeze(1)
    return log_probs, old, advantages, mask


def _trl_loss(trainer, log_probs, old, advantages, mask):
    leaf = log_probs.clone().requires_grad_(True)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (
        leaf,
        torch.zeros_like(leaf),
        None,
    )
    inputs = {
        "prompt_ids": torch.ones(BATCH, PROMPT, dtype=torch.long),
        "prompt_mask": torch.ones(BATCH, PROMPT, dtype=torch.long),
        "completion_ids": torch.ones(BATCH, LENGTH, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
    }
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, inputs)
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), gradient


def _our_loss(log_probs, old, advantages, mask):
    leaf = log_probs.clone().requires_grad_(True)
    loss, metrics = policy_loss(
        leaf,
        old,
        advantages,
        mask,
        PolicyLossSettings(
            importance_sampling="seq",
            clip_low=CLIP_LOW,
            clip_high=CLIP_HIGH,
            loss_agg_mode="seq-mean-token-mean",
        ),
    )
    (gradient,) = torch.autograd.grad(loss, leaf)
    return loss.detach(), gradient, metrics


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_loss_and_gradient_match_trl(trainer, seed):
    log_probs, old, advantages, mask = _batch(seed)
    trl_loss, trl_gradient = _trl_loss(trainer, log_probs, old, advantages, mask)
    our_loss, our_gradient, metrics = _our_loss(log_probs, old, advantages, mask)

    # The batch really exercises both branches of the clip.
    seq_log_ratio = ((log_probs - old) * mask).sum(-1) / mask.sum(-1)
    ratio = seq_log_ratio.exp()
    out_of_range = (ratio < 1 - CLIP_LOW) | (ratio > 1 + CLIP_HIGH)
    assert 0 < int(out_of_range.sum()) < BATCH

    assert abs(float(our_loss) - float(trl_loss)) <= 1e-6
    assert float((our_gradient - trl_gradient).abs().max()) <= 1e-6
    assert torch.equal(our_gradient[~mask], torch.zeros_like(our_gradient[~mask]))
    assert float(trl_gradient.abs().sum()) > 0
