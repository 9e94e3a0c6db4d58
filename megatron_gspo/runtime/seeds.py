"""How a run's seeds derive from its configured seed, so that a resumed run repeats the
uninterrupted one."""


def step_seed(seed: int, step: int) -> int:
    """The seed of RL step ``step`` of a run seeded ``seed``: the rollout's sampling seeds and the
    mini-batch shuffle derive from it, so a resumed run repeats both exactly."""
    return seed * 1_000_003 + step
