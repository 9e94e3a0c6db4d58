"""The driver of each rank, built with what it starts registered in the run's exit stack."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from functools import partial
from typing import Any, Optional

from megatron_gspo.config import TrainConfig
from megatron_gspo.driver.background import BackgroundSettings, BackgroundSource
from megatron_gspo.driver.follower import DriverFollower
from megatron_gspo.driver.interface import Driver
from megatron_gspo.driver.replay import ReplaySource
from megatron_gspo.driver.rollout_driver import RolloutDriver
from megatron_gspo.driver.source import BatchSourceFactory
from megatron_gspo.driver.synchronous import SynchronousSource
from megatron_gspo.production.processes import start_producer_processes
from megatron_gspo.samples.recorded_batch import rollouts_directory


def build_driver(
    cfg: TrainConfig,
    *,
    rank: int,
    resources: ExitStack,
    weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None,
) -> Driver:
    """The driver of global rank ``rank``: on rank 0 the :class:`RolloutDriver`
    (:func:`build_rollout_driver`), on the others a :class:`DriverFollower`. What it starts
    (reward workers, the rollout engine and its servers, log sinks) is registered in
    ``resources`` as soon as it exists, so the run's exit stack stops it on any exit, also when
    a later piece fails to start. ``weights`` streams the trainer's current weights (collective;
    either batch source asks for them during a rollout when a restarted server waits for
    them and the weight transport keeps no copy)."""
    if rank != 0:
        return DriverFollower(weights)
    return build_rollout_driver(cfg, resources, weights)


def build_rollout_driver(
    cfg: TrainConfig,
    resources: ExitStack,
    weights: Optional[Callable[[], Iterator[tuple[str, Any]]]] = None,
    *,
    background: Optional[bool] = None,
) -> RolloutDriver:
    """Global rank 0's driver with its batch source: the
    :class:`~megatron_gspo.driver.replay.ReplaySource` with ``rollout.replay_dir``, the
    :class:`~megatron_gspo.driver.background.BackgroundSource` with ``rollout.max_staleness >=
    1``, else the :class:`~megatron_gspo.driver.synchronous.SynchronousSource`. ``background``
    overrides the choice (the background source at bound 0 gives the synchronous batches, which
    the tests check)."""
    if background is None:
        background = cfg.rollout.max_staleness >= 1
    make_source: BatchSourceFactory
    if cfg.rollout.replay_dir is not None:
        make_source = ReplaySource.factory(rollouts_directory(cfg.rollout.replay_dir))
    elif background:
        make_source = partial(
            BackgroundSource,
            settings=BackgroundSettings.from_config(cfg),
            weights=weights,
            start_processes=partial(start_producer_processes, cfg)
            if cfg.rollout.producer_processes
            else None,
        )
    else:
        make_source = partial(SynchronousSource, cfg=cfg, weights=weights)
    return RolloutDriver(cfg, resources, make_source)
