"""``agent.*`` against the rest of the configuration: what an agent run takes (its per-turn
samples' refusals: tests/production/test_per_turn_samples.py)."""

from __future__ import annotations

from megatron_gspo.config import TrainConfig, from_dict

AGENT = {"function": "examples.agents.calculator_agent:run_episode"}


def test_agents_take_asynchronous_episodes_in_the_trainer():
    cfg = from_dict(TrainConfig, {"agent": AGENT, "rollout": {"max_staleness": 1}})
    assert cfg.rollout.max_staleness == 1 and cfg.rollout.producer_processes == 0


def test_agents_take_producer_processes():
    """Their episodes then run in the processes (tests/async_training/test_agent_processes.py)."""
    rollout = {"engine": "sglang", "max_staleness": 1, "producer_processes": 2}
    cfg = from_dict(TrainConfig, {"agent": AGENT, "rollout": rollout})
    assert cfg.rollout.producer_processes == 2 and cfg.agent.function == AGENT["function"]
