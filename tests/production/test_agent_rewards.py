"""An agent's episodes with ``reward.functions``, and those kept out of the loss.

Every sample's reward is the agent's own number plus the functions' weighted score of the
episode's conversation, failures scoring ``reward.failure_reward`` and counted, with a real tiny
model behind the chat endpoint and the example agents (``examples/agents/``) run through the
``openai`` client. The expected score is recomputed here from the decoded tokens, not through
the reward runner."""

from __future__ import annotations

import json
import threading

import pytest

from examples.agents import calculator_agent, note_taking_agent
from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.data.tokenizer import CHATML_TOOLS_TEMPLATE, build_byte_tokenizer
from megatron_gspo.production.agent import AgentProducer, AgentSettings
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.task import build_task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout.chat_endpoint import ChatEndpoint
from megatron_gspo.rollout.embedded import EmbeddedEngine

MODULE = f"{__name__.rpartition('.')[0]}.text_rewards".lstrip(".")
WEIGHTS = {"characters": 0.5, "digits": 2.0, "always_fails": 1.5}
FAILURE_REWARD = -0.25


def expected_score(text: str) -> float:
    """The weighted score of ``text``, from the functions' definitions (``always_fails`` scores
    ``reward.failure_reward``)."""
    return (
        WEIGHTS["characters"] * len(text) / 100
        + WEIGHTS["digits"] * sum(character.isdigit() for character in text)
        + WEIGHTS["always_fails"] * FAILURE_REWARD
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    directory = tmp_path_factory.mktemp("agent_rewards")
    build_byte_tokenizer(CHATML_TOOLS_TEMPLATE).save_pretrained(directory / "tokenizer")
    rows = [{"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(4)]
    (directory / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return directory


def produce(data, agent, *, per_turn: bool):
    """Step 0's samples of two prompts, two episodes each, and what ``agent`` returned per
    episode (by sample index)."""
    cfg = from_dict(
        TrainConfig,
        {
            "algo": {
                "rollout_batch_size": 2,
                "num_return_sequences_in_group": 2,
                "num_mini_batches": 1,
                "response_length": 64,
            },
            "data": {
                "train_path": str(data / "prompts.jsonl"),
                "tokenizer_path": str(data / "tokenizer"),
                "apply_chat_template": False,
            },
            "model": {"vocab_size": 260, "init_std": 0.2},
            "reward": {
                "functions": [f"{MODULE}:{name}" for name in WEIGHTS],
                "weights": list(WEIGHTS.values()),
                "failure_reward": FAILURE_REWARD,
                "executor": "thread",
            },
            "agent": {
                "function": "examples.agents.calculator_agent:run_episode",
                "max_tokens_per_turn": 8,
                "max_turns": 3,
                "per_turn_samples": per_turn,
            },
        },
    )
    task = build_task(cfg)
    returned: dict[int, float] = {}
    lock = threading.Lock()

    def recording_agent(session) -> float:
        # Plus one: an untrained model's episodes often score 0, which would hide a lost part.
        reward = agent(session) + 1.0
        with lock:  # the episodes run in threads
            returned[int(session.session_id.split("-sample")[1].split("-")[0])] = reward
        return reward

    engine = EmbeddedEngine(cfg.model, seed=3)
    with ChatEndpoint(engine, task.tokenizer) as endpoint, RewardRunner(cfg.reward) as rewards:
        producer = AgentProducer(
            endpoint,
            task,
            rewards,
            Sampling.training(cfg),
            AgentSettings.from_config(cfg, task),
            function=recording_agent,
        )
        scored = producer.produce(task.stream.next_batch(2), step=0)
    return task.tokenizer, scored, returned


def test_episode_reward_adds_the_functions_score(data):
    tokenizer, scored, returned = produce(data, calculator_agent.run_episode, per_turn=False)
    samples = scored.samples
    assert len(samples) == 4 and all(s.finish_reason != "abort" for s in samples)
    for index, sample in enumerate(samples):
        text = tokenizer.decode(sample.tokens[sample.prompt_length :], skip_special_tokens=True)
        assert sample.reward == pytest.approx(returned[index] + expected_score(text), abs=1e-12)
    # The failing function is counted once per episode, as for an environment's episodes.
    assert scored.metrics["reward_errors"] == 4
    assert scored.metrics["reward_functions_all_failed"] == 1


def test_turn_samples_get_the_score_of_the_rewritten_conversation(data):
    tokenizer, scored, returned = produce(data, note_taking_agent.run_episode, per_turn=True)
    episodes: dict[str, list] = {}
    for sample in scored.samples:
        episodes.setdefault(sample.metadata["episode"], []).append(sample)
    assert len(episodes) == 4
    assert scored.metrics["agent/rewritten_episodes"] > 0
    for key, turns in episodes.items():
        # The conversation as the model last saw it: the last call's input and output after
        # what they share with the first call's input (the prompt).
        first, last = turns[0].tokens[: turns[0].prompt_length].tolist(), turns[-1].tokens.tolist()
        shared = next(
            (i for i, (a, b) in enumerate(zip(first, last)) if a != b), min(len(first), len(last))
        )
        text = tokenizer.decode(last[shared:], skip_special_tokens=True)
        expected = returned[int(key.split(":")[0])] + expected_score(text)
        assert [s.reward for s in turns] == pytest.approx([expected] * len(turns), abs=1e-12)
    assert scored.metrics["reward_errors"] == 4


def raises_before_any_call(session) -> float:
    raise RuntimeError("stand-in agent failure")


@pytest.mark.parametrize("agent", [note_taking_agent.run_episode, raises_before_any_call])
def test_dropped_episodes_keep_a_masked_response(data, agent):
    """Episodes kept out of the loss (a rewritten context without per-turn samples; an agent
    that failed before calling the model) still give samples that the trainer takes: at least
    one response token, none in the loss (a sample without one stopped the run)."""
    from megatron_gspo.engine.batches import validate_samples

    _, scored, _ = produce(data, agent, per_turn=False)
    dropped = [s for s in scored.samples if s.finish_reason == "abort"]
    assert dropped and len(dropped) == (
        scored.metrics["agent/rewritten_episodes"] + scored.metrics["agent/errors"]
    )
    for sample in dropped:
        assert sample.response_length >= 1 and not bool(sample.loss_mask.any())
        assert sample.group_id < 0
    validate_samples(scored.samples, need_old=False, need_advantages=False, need_ref=False)
    # Nothing of a dropped episode is scored by the reward functions.
    assert scored.metrics.get("reward_errors", 0) == len(scored.samples) - len(dropped)
