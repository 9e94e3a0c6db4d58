"""Environments: what an environment author reads and writes (docs/agentic.md). No Megatron import.

An environment answers a model turn with an observation, a reward part and whether the episode is
done (:class:`Environment`, :class:`EnvStart`, :class:`EnvStep`, :class:`Turn`); it is named in the
configuration (``env.name``: a built-in or ``package.module:factory``) and loaded with
:func:`load_environment`. The trainer runs the episodes: :mod:`megatron_gspo.production.episodes`
(token in, token out; per-turn routes and limits).
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

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "EnvStart",
    "EnvStep",
    "Environment",
    "EnvironmentFactory",
    "EnvironmentSpec",
    "Turn",
    "load_environment",
    "make_environment",
]
