"""Environments: multi-turn rollouts with tools, token in and token out (docs/agentic.md).
No Megatron import.

The trainer's calls::

    factory = load_environment(EnvironmentSpec(cfg.env.name, cfg.env.options))
    producer = EnvironmentProducer(rollout_engine, task, rewards, cfg, factory=factory)
    scored = producer.produce(prompts, step)        # a SampleProducer (production.py)
    sample = demonstration_sample(factory, prompt, task, cfg)   # supervised cold start
"""

from megatron_gspo.envs.base import (
    BUILTIN_ENVIRONMENTS,
    Environment,
    EnvironmentFactory,
    EnvironmentSpec,
    EnvStart,
    EnvStep,
    Turn,
    load_environment,
    make_environment,
)
from megatron_gspo.envs.rollout import (
    EnvironmentProducer,
    Trajectory,
    demonstration_sample,
    demonstration_samples,
    episode_metrics,
)

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "EnvStart",
    "EnvStep",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentProducer",
    "EnvironmentSpec",
    "Trajectory",
    "Turn",
    "demonstration_sample",
    "demonstration_samples",
    "episode_metrics",
    "load_environment",
    "make_environment",
]
