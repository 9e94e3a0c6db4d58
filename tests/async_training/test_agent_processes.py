"""``rollout.producer_processes`` with an agent (``agent.function``): the agent's episodes run in
the child process, behind a chat endpoint of the child's own, and give the samples that the
trainer's own producer makes for the same call on the same server."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack

import torch

from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.data.tokenizer import CHATML_TOOLS_TEMPLATE, build_byte_tokenizer
from megatron_gspo.driver.build import build_rollout_driver
from megatron_gspo.rollout.embedded import EmbeddedEngine

BATCH = 2
GROUP = 2


def agent_config(directory) -> TrainConfig:
    build_byte_tokenizer(CHATML_TOOLS_TEMPLATE).save_pretrained(directory / "tokenizer")
    rows = [{"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(4)]
    (directory / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return from_dict(
        TrainConfig,
        {
            "output_dir": str(directory / "out"),
            "sft_warmup_steps": 0,
            "algo": {
                "rollout_batch_size": BATCH,
                "num_return_sequences_in_group": GROUP,
                "num_mini_batches": 1,
                "response_length": 32,
                "old_log_prob_source": "rollout",
            },
            "data": {
                "train_path": str(directory / "prompts.jsonl"),
                "tokenizer_path": str(directory / "tokenizer"),
                "apply_chat_template": False,
            },
            "model": {"vocab_size": 260, "init_std": 0.2},
            "reward": {"functions": [], "executor": "thread"},
            "agent": {
                "function": "tests.async_training.process_reporting_agent:run_episode",
                "max_tokens_per_turn": 8,
            },
            "logging": {"tensorboard": False, "progress_bar": False},
            "rollout": {
                "engine": "embedded_http",  # its loopback server in a thread of this process
                "max_staleness": 1,
                "producer_processes": 1,
            },
        },
    )


def test_agent_episodes_run_in_a_producer_process(tmp_path):
    cfg = agent_config(tmp_path)
    weights = list(EmbeddedEngine(cfg.model, seed=7).hf_state())
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
        (process,) = driver.source.processes
        driver.start(0, None)
        driver.sync_weights(iter(weights), version=0)
        batch = driver.rollout(0)
        step_prompts = driver.task.stream.prompts_by_id(sorted({s.group_id for s in batch.samples}))
        # The trainer's own producer (behind the driver's endpoint), the same call.
        again = driver.producer.produce(step_prompts, 0).samples
    assert len(batch.samples) == len(again) == BATCH * GROUP
    assert batch.metrics["agent/errors"] == 0
    for remote, local in zip(batch.samples, again):
        assert remote.reward == process.pid != os.getpid()
        assert local.reward == os.getpid()
        assert remote.loss_mask.sum() > 0, "the model's tokens are trained"
        assert torch.equal(remote.tokens, local.tokens) and remote.group_id == local.group_id
        assert torch.equal(remote.rollout_log_probs, local.rollout_log_probs)
        assert torch.equal(remote.rollout_weight_versions, local.rollout_weight_versions)
        assert torch.equal(remote.loss_mask, local.loss_mask)
