"""``agent.*`` against the rest of the configuration: what an agent run refuses, and what it
takes."""

from __future__ import annotations

import pytest

from megatron_gspo.config import ConfigError, TrainConfig, from_dict

AGENT = {"function": "examples.agents.calculator_agent:run_episode"}


def test_agents_refuse_producer_processes():
    """Producer processes build an environment's or the single-turn producer: they would
    train single completions of the prompts instead of the agent's episodes."""
    with pytest.raises(ConfigError) as error:
        from_dict(
            TrainConfig,
            {
                "agent": AGENT,
                "rollout": {"engine": "sglang", "max_staleness": 1, "producer_processes": 1},
            },
        )
    assert error.value.key == "rollout.producer_processes"
    assert "agent.function" in str(error.value)


def test_agents_take_asynchronous_episodes_in_the_trainer():
    cfg = from_dict(TrainConfig, {"agent": AGENT, "rollout": {"max_staleness": 1}})
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.producer_processes == 0
