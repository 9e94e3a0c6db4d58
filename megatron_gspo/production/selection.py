"""The run's producer, chosen from its configuration: an agent's episodes behind the agents' chat
endpoint (``agent.function``), an environment's episodes (``env.name``), or one completion per
sample. The trainer's driver and the producer processes (:mod:`~megatron_gspo.production.processes`)
choose the same way, each from the pieces it built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from megatron_gspo.config import TrainConfig
from megatron_gspo.production.agent import AgentProducer, AgentSettings
from megatron_gspo.production.episodes import EnvironmentProducer, EpisodeSettings
from megatron_gspo.production.producer import SampleProducer
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.single_turn import SingleTurnProducer
from megatron_gspo.production.task import Task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout import RolloutEngine
from megatron_gspo.rollout.chat_endpoint import ChatEndpoint

if TYPE_CHECKING:
    from megatron_gspo.envs import EnvironmentFactory


def agent_endpoint(cfg: TrainConfig, engine: RolloutEngine, task: Task) -> ChatEndpoint:
    """The agents' OpenAI-compatible endpoint in front of ``engine`` (its caller closes it)."""
    return ChatEndpoint(engine, task.tokenizer, tool_call_format=cfg.agent.tool_call_format)


def select_producer(
    cfg: TrainConfig,
    engine: RolloutEngine,
    task: Task,
    rewards: Optional[RewardRunner],
    sampling: Sampling,
    *,
    chat_endpoint: Optional[ChatEndpoint],
    environment_factory: Optional[EnvironmentFactory],
) -> SampleProducer:
    """The producer at ``sampling``'s settings: the agent's behind ``chat_endpoint`` when there is
    one (``agent.function``), else the environment's of ``environment_factory`` (``env.name``),
    else one completion per sample."""
    if chat_endpoint is not None:
        settings = AgentSettings.from_config(cfg, task)
        return AgentProducer(chat_endpoint, task, rewards, sampling, settings)
    if environment_factory is not None:
        return EnvironmentProducer(
            engine,
            task,
            rewards,
            sampling,
            EpisodeSettings.from_config(cfg),
            factory=environment_factory,
        )
    return SingleTurnProducer(engine, task, rewards, sampling)
