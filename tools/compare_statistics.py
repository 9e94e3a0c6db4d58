"""Statistics of a comparison over seeds (``tools/compare_grpo_gspo.py --seeds N``): what one
run's curves say (area under the reward curve, final reward, steps to a threshold, collapse), and
what several seeds say about a variant (a mean with its Student-t interval) and about two
variants run on the same seeds (the paired difference with its interval).

Student-t, not a bootstrap: with the 3 to 10 seeds a CPU budget affords, a percentile bootstrap's
interval is too narrow (it cannot reach beyond the values seen); the t interval assumes the
per-seed values are roughly normal and says so by its width. Pure Python (``math`` only): the
tool's ``--help`` imports no numerical library.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from typing import Optional

CONFIDENCE = 0.95


@functools.cache  # a summary asks for the same few quantiles many times
def t_quantile(probability: float, degrees_of_freedom: int) -> float:
    """The ``probability`` quantile of Student's t with ``degrees_of_freedom`` (> 0), by
    bisection on its distribution function (Simpson's rule on the density; 1e-9 accurate)."""
    if not 0.5 <= probability < 1:
        raise ValueError(f"probability {probability} outside [0.5, 1)")
    if degrees_of_freedom < 1:
        raise ValueError(f"degrees of freedom {degrees_of_freedom} < 1")
    low, high = 0.0, 1.0
    while _t_distribution(high, degrees_of_freedom) < probability:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        if _t_distribution(middle, degrees_of_freedom) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _t_distribution(x: float, nu: int) -> float:
    """P(T <= x) for x >= 0: 1/2 plus the density's integral over [0, x]."""
    log_scale = math.lgamma((nu + 1) / 2) - math.lgamma(nu / 2) - 0.5 * math.log(nu * math.pi)

    def density(t: float) -> float:
        return math.exp(log_scale - (nu + 1) / 2 * math.log1p(t * t / nu))

    intervals = 2000
    width = x / intervals
    total = density(0.0) + density(x)
    for index in range(1, intervals):
        total += (4 if index % 2 else 2) * density(index * width)
    return 0.5 + total * width / 3


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> dict:
    """``mean``, its ``low`` / ``high`` Student-t bounds at ``confidence`` and ``n``; the bounds
    are None with fewer than two values (no spread to measure)."""
    values = [float(value) for value in values]
    if not values:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean = statistics.fmean(values)
    if len(values) < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    half_width = t_quantile((1 + confidence) / 2, len(values) - 1) * (
        statistics.stdev(values) / math.sqrt(len(values))
    )
    return {"mean": mean, "low": mean - half_width, "high": mean + half_width, "n": len(values)}


def paired_difference(
    first: dict[int, float], second: dict[int, float], confidence: float = CONFIDENCE
) -> dict:
    """``first - second`` over the seeds both have: the mean difference, its interval, and
    whether the interval excludes zero (None when it could not be computed)."""
    seeds = sorted(set(first) & set(second))
    interval = mean_interval([first[seed] - second[seed] for seed in seeds], confidence)
    excludes = None
    if interval["low"] is not None:
        excludes = interval["low"] > 0 or interval["high"] < 0
    return {**interval, "excludes_zero": excludes, "seeds": seeds}


def trailing_means(values: Sequence[float], window: int) -> list[float]:
    """Entry ``i``: the mean of the last ``window`` values up to ``i``."""
    means = []
    for index in range(len(values)):
        recent = values[max(0, index - window + 1) : index + 1]
        means.append(sum(recent) / len(recent))
    return means


def reward_curve_statistics(
    rewards: Sequence[float], *, threshold: float, collapse_drop: float, window: int = 5
) -> dict[str, Optional[float]]:
    """What one run's reward curve (one value per step) says:

    - ``reward_auc``: the area under the curve per step (the trapezoid rule over steps, divided
      by the steps it spans): how much reward the run earned on its way, not only at the end;
    - ``steps_to_threshold``: the first step whose trailing mean (``window`` steps) reaches
      ``threshold``; None if none does;
    - ``collapsed``: 1.0 when the trailing mean falls more than ``collapse_drop`` below its best
      and never comes back within ``collapse_drop / 2`` of it by the last step, else 0.0.
    """
    if not rewards:
        return {"reward_auc": None, "steps_to_threshold": None, "collapsed": None}
    if len(rewards) == 1:
        auc = float(rewards[0])
    else:
        area = sum((rewards[i] + rewards[i + 1]) / 2 for i in range(len(rewards) - 1))
        auc = area / (len(rewards) - 1)
    smoothed = trailing_means(rewards, window)
    reached = next((step for step, value in enumerate(smoothed) if value >= threshold), None)
    best_step = max(range(len(smoothed)), key=smoothed.__getitem__)
    best = smoothed[best_step]
    after = smoothed[best_step + 1 :]
    fell = any(value < best - collapse_drop for value in after)
    recovered = bool(after) and after[-1] >= best - collapse_drop / 2
    return {
        "reward_auc": auc,
        "steps_to_threshold": None if reached is None else float(reached),
        "collapsed": 1.0 if fell and not recovered else 0.0,
    }
