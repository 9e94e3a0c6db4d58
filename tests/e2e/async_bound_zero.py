"""``python tests/e2e/async_bound_zero.py OVERRIDES...``: the trainer with the asynchronous driver
forced at ``max_staleness: 0`` (the configuration picks the synchronous driver for 0), to show
that the producer machinery at bound 0 is the synchronous loop, bit for bit."""

from __future__ import annotations

import sys

from megatron_gspo import driver, loop
from megatron_gspo.driver.build import build_rollout_driver
from megatron_gspo.driver.follower import DriverFollower


def build_driver(cfg, *, rank: int, resources, weights=None) -> driver.Driver:
    if rank == 0:
        return build_rollout_driver(cfg, resources, weights, background=True)
    return DriverFollower(weights)


if __name__ == "__main__":
    loop.build_driver = build_driver
    from megatron_gspo.train import main

    sys.exit(main(sys.argv[1:]))
