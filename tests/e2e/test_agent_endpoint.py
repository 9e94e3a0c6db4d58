"""Agents written only against the ``openai`` client train through the endpoint.

The example agent (examples/agents/calculator_agent.py) runs every episode, and a GSPO step
learns from them (docs/agentic.md shows this command's overrides). One step (a second ran the
same path again; weight syncs between steps are covered by the other e2e tests); ``seed=1``
gives this step rewards that differ within a group, hence a real gradient.

The note-taking agent (examples/agents/note_taking_agent.py) rewrites its context between turns
and trains for two steps on per-turn samples (``agent.per_turn_samples``), from a Hugging Face
model saved here, so that its step-0 samples can be checked against a float64 forward of the
known weights: every trained token is the engine's with its log-prob in its call's context.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

import pytest
import torch

from megatron_gspo.data.tokenizer import CHATML_TOOLS_TEMPLATE, build_byte_tokenizer
from megatron_gspo.samples.recorded_batch import read_recorded_batch

from .harness import TINY, run_train


def agent_overrides(tmp_path, agent: str) -> list[str]:
    """A prompt file of sums, a byte-level tokenizer with the tool template, and ``agent``."""
    tokenizer_dir = tmp_path / "tokenizer"
    build_byte_tokenizer(CHATML_TOOLS_TEMPLATE).save_pretrained(tokenizer_dir)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(8)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [
        "seed=1",
        *TINY,
        "algo.response_length=64",
        f"data.train_path={prompts}",
        f"data.tokenizer_path={tokenizer_dir}",
        "data.apply_chat_template=false",
        "model.vocab_size=260",
        "reward.functions=[]",
        f"agent.function=examples.agents.{agent}:run_episode",
        "agent.max_tokens_per_turn=8",
        "agent.max_turns=3",
    ]


def test_example_agent_trains_through_the_endpoint(tmp_path):
    overrides = ["steps=1", *agent_overrides(tmp_path, "calculator_agent")]
    run = run_train(tmp_path / "out", overrides, timeout=300)
    records = run.metrics()
    assert [record["step"] for record in records] == [0]
    for record in records:
        assert record["agent/errors"] == 0
        # Every episode is multi-turn: a wrong first answer gets a second try.
        assert record["agent/turns_mean"] > 1
        assert record["agent/samples_per_episode"] == 1
        assert math.isfinite(record["policy_loss"])
    # The digit-counting part of the reward differs between episodes: a real gradient.
    assert records[0]["grad_norm"] > 0


def float64_log_probs(model, tokens: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Log-probs of ``tokens[prompt_length:]`` at temperature 1 (the run's), in float64."""
    with torch.no_grad():
        logits = model(tokens[None]).logits[0, prompt_length - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(-1, tokens[prompt_length:, None])[:, 0]


def grpo_advantages(episodes: dict[str, tuple[int, float]]) -> dict[str, float]:
    """GRPO's advantage of each episode among its group's episodes, in float64: ``(r - mean) /
    (std + 1e-6)``, Bessel-corrected (the defaults)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for group, reward in episodes.values():
        groups[group].append(reward)
    advantages = {}
    for key, (group, reward) in episodes.items():
        rewards = torch.tensor(groups[group], dtype=torch.float64)
        std = rewards.std() if len(rewards) > 1 else torch.zeros((), dtype=torch.float64)
        advantages[key] = float((reward - rewards.mean()) / (std + 1e-6))
    return advantages


def test_rewriting_agent_trains_on_per_turn_samples(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_gspo.config import ModelConfig
    from megatron_gspo.convert.hf_config import hf_config_from_model_config

    # A dense model: no expert choice that float32 and float64 could make differently.
    torch.manual_seed(0)
    config = hf_config_from_model_config(ModelConfig(architecture="qwen3", vocab_size=260))
    hf_dir = tmp_path / "hf"
    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    overrides = [
        "steps=2",
        *agent_overrides(tmp_path, "note_taking_agent"),
        f"model.hf_path={hf_dir}",
        "agent.per_turn_samples=true",
        # One optimizer step per batch: its ratios are 1, so its loss is minus the samples'
        # mean advantage.
        "algo.num_mini_batches=1",
        "rollout.save_rollouts=true",
    ]
    output = tmp_path / "out"
    run = run_train(output, overrides, timeout=300)
    records = run.metrics()
    assert [record["step"] for record in records] == [0, 1]
    batches = [read_recorded_batch(output / "rollouts", step) for step in (0, 1)]
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64).eval()
    tokenizer = build_byte_tokenizer(CHATML_TOOLS_TEMPLATE)
    for record, batch in zip(records, batches):
        assert record["agent/errors"] == 0
        assert record["agent/rewritten_episodes"] > 0
        assert record["agent/samples_per_episode"] > 1
        samples = batch.samples
        assert len(samples) == record["num_samples"] > 8  # more than one per episode
        # Each sample is one model turn: all its response tokens in the loss.
        assert all(bool(s.loss_mask.all()) and s.response_length > 0 for s in samples)
        # The rewrites reached the trained samples: later turns see notes, not the earlier turn.
        later = [s for s in samples if int(s.turns[0]) > 0]
        assert later and all(
            "Notes: " in tokenizer.decode(s.tokens[: s.prompt_length]) for s in later
        )
        # The trainer's log-probs of every trained token equal the engine's (float32 twins).
        assert record["rollout_log_prob_abs_diff"] < 1e-5
        # An episode's turn samples get its advantage: the loss at ratio 1 is minus the mean of
        # the samples' advantages, each its episode's among the group's episodes.
        episodes = {s.metadata["episode"]: (s.group_id, s.reward) for s in samples}
        assert len(episodes) == 8
        advantages = grpo_advantages(episodes)
        expected = -sum(advantages[s.metadata["episode"]] for s in samples) / len(samples)
        assert record["policy_loss"] == pytest.approx(expected, abs=1e-6)
    # Step 0 sampled with the saved weights: each token and log-prob is the engine's for its
    # call's context (a float64 forward of the same weights).
    for sample in batches[0].samples:
        expected = float64_log_probs(reference, sample.tokens, sample.prompt_length)
        torch.testing.assert_close(sample.rollout_log_probs.double(), expected, rtol=0, atol=1e-5)
    # The policy moved: step 1 sampled with the synced weights, which give other log-probs.
    assert all(sample.weight_version == 1 for sample in batches[1].samples)
    moved = max(
        float(
            (
                sample.rollout_log_probs.double()
                - float64_log_probs(reference, sample.tokens, sample.prompt_length)
            )
            .abs()
            .max()
        )
        for sample in batches[1].samples
    )
    assert moved > 1e-3
    assert records[0]["grad_norm"] > 0
