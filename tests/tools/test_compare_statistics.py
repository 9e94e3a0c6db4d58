"""tools/compare_statistics.py: Student-t quantiles against the printed tables, intervals and
paired differences on hand-computed data, and what a reward curve says (area, threshold,
collapse)."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from compare_statistics import (  # noqa: E402
    mean_interval,
    paired_difference,
    reward_curve_statistics,
    t_quantile,
)


@pytest.mark.parametrize(
    "degrees, expected",
    # Two-sided 95% critical values of Student's t, as statistics tables print them.
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (7, 2.365), (9, 2.262), (30, 2.042)],
)
def test_t_quantiles_are_the_tables(degrees, expected):
    assert t_quantile(0.975, degrees) == pytest.approx(expected, abs=5e-4)


def test_t_quantile_tends_to_the_normal():
    assert t_quantile(0.975, 100000) == pytest.approx(1.95996, abs=1e-4)
    assert t_quantile(0.5, 5) == pytest.approx(0.0, abs=1e-9)


def test_mean_interval_by_hand():
    values = [0.2, 0.4, 0.3, 0.5]
    interval = mean_interval(values)
    half = 3.182446 * statistics.stdev(values) / math.sqrt(4)
    assert interval["mean"] == pytest.approx(0.35)
    assert interval["low"] == pytest.approx(0.35 - half, abs=1e-6)
    assert interval["high"] == pytest.approx(0.35 + half, abs=1e-6)
    assert mean_interval([0.7]) == {"mean": 0.7, "low": None, "high": None, "n": 1}
    assert mean_interval([])["mean"] is None


def test_paired_difference_uses_the_common_seeds():
    first = {1: 0.9, 2: 0.8, 3: 0.85, 4: 0.1}
    second = {1: 0.5, 2: 0.45, 3: 0.52}
    difference = paired_difference(first, second)
    assert difference["seeds"] == [1, 2, 3]
    assert difference["mean"] == pytest.approx((0.4 + 0.35 + 0.33) / 3)
    assert difference["excludes_zero"] is True
    noisy = paired_difference({1: 1.0, 2: -1.0, 3: 0.1}, {1: 0.0, 2: 0.0, 3: 0.0})
    assert noisy["excludes_zero"] is False
    assert paired_difference({1: 1.0}, {1: 0.0})["excludes_zero"] is None


def test_reward_curve_statistics():
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    stats = reward_curve_statistics(rising, threshold=0.5, collapse_drop=0.2)
    assert stats["reward_auc"] == pytest.approx(0.45)  # a straight line: its midpoint
    assert stats["steps_to_threshold"] == 6.0  # trailing means 0.3, ..., 0.5 at step 6
    assert stats["collapsed"] == 0.0
    falling = [0.8] * 6 + [0.2] * 8
    assert reward_curve_statistics(falling, threshold=0.5, collapse_drop=0.2)["collapsed"] == 1.0
    recovered = [0.8] * 6 + [0.2] * 6 + [0.8] * 6
    assert reward_curve_statistics(recovered, threshold=0.5, collapse_drop=0.2)["collapsed"] == 0.0
    never = reward_curve_statistics([0.1, 0.2], threshold=0.5, collapse_drop=0.2)
    assert never["steps_to_threshold"] is None
