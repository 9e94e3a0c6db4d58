"""Clip metrics on hand-built batches whose answers are counted by hand (pitfall 19)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gspo.algo import PolicyLossSettings, policy_loss


def metrics_for(ratios, mask, advantages, importance_sampling, dual=None):
    ratios = torch.tensor(ratios, dtype=torch.float64)
    log_probs = torch.log(ratios)  # old log-probs 0: lp - old = log r
    _, metrics = policy_loss(
        log_probs,
        torch.zeros_like(log_probs),
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.bool),
        PolicyLossSettings(
            importance_sampling=importance_sampling,
            clip_low=0.2,
            clip_high=0.2,
            loss_agg_mode="seq-mean-token-mean",
            dual_clip_constant=dual,
        ),
    )
    return {name: float(value) for name, value in metrics.items()}


def test_token_ratio_fractions():
    """GRPO ratios, clip [0.8, 1.2], dual c = 3.

    seq 0, A = +1, r = [0.5, 1.5, 1.0, 0.7]: low 0.5 and 0.7 (not binding: A > 0), high 1.5 binds.
    seq 1, A = -1, r = [0.5, 1.0, 4.0, pad]: low 0.5 binds; 4.0 out of range, not binding for the
    ordinary clip, but above c, so dual clip binds.
    7 tokens: binding 2, low 1, high 1, out of range 5, dual 1.
    Sequence-weighted: binding (1/4 + 1/3)/2, low (0 + 1/3)/2, high (1/4 + 0)/2, range (3/4 + 2/3)/2.
    """
    metrics = metrics_for(
        [[0.5, 1.5, 1.0, 0.7], [0.5, 1.0, 4.0, 1.0]],
        [[1, 1, 1, 1], [1, 1, 1, 0]],
        [1.0, -1.0],
        "token",
        dual=3.0,
    )
    expected = {
        "clip_frac_token": 2 / 7,
        "clip_frac_low_token": 1 / 7,
        "clip_frac_high_token": 1 / 7,
        "ratio_out_of_range_token": 5 / 7,
        "dual_clip_frac_token": 1 / 7,
        "clip_frac_seq": 7 / 24,
        "clip_frac_low_seq": 1 / 6,
        "clip_frac_high_seq": 1 / 8,
        "ratio_out_of_range_seq": 17 / 24,
        "ratio_mean": (0.5 + 1.5 + 1.0 + 0.7 + 0.5 + 1.0 + 4.0) / 7,
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12), name


@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token"])
def test_sequence_ratio_fractions(importance_sampling):
    """GSPO: every token of a sequence shares its ratio, so token-weighted fractions count the
    tokens of clipped sequences (the paper's definition) and sequence-weighted ones the sequences.

    lengths 4, 2, 3, 1 (10 tokens), s = 1.5 (A > 0: binds high), 0.5 (A < 0: binds low),
    0.5 (A > 0: out of range only), 1.0 (inside).
    """
    width = 4
    s = [1.5, 0.5, 0.5, 1.0]
    lengths = [4, 2, 3, 1]
    mask = [[t < n for t in range(width)] for n in lengths]
    # Token log ratios vary around log s but average to it exactly over each response.
    spread = [0.3, -0.1, -0.2, 0.0]
    ratios = []
    for value, n in zip(s, lengths):
        offsets = [spread[t] - sum(spread[:n]) / n if t < n else 0.0 for t in range(width)]
        ratios.append([value * math.exp(o) for o in offsets])
    metrics = metrics_for(ratios, mask, [2.0, -1.0, 1.0, -3.0], importance_sampling, dual=2.0)
    expected = {
        "clip_frac_token": 6 / 10,
        "clip_frac_low_token": 2 / 10,
        "clip_frac_high_token": 4 / 10,
        "ratio_out_of_range_token": 9 / 10,
        "clip_frac_seq": 2 / 4,
        "clip_frac_low_seq": 1 / 4,
        "clip_frac_high_seq": 1 / 4,
        "ratio_out_of_range_seq": 3 / 4,
        "dual_clip_frac_token": 0.0,  # the only A < 0 sequence that clips has s = 0.5 < c
        "ratio_mean": (4 * 1.5 + 2 * 0.5 + 3 * 0.5 + 1.0) / 10,
        "seq_log_ratio_mean": sum(map(math.log, s)) / 4,
        "seq_log_ratio_abs_mean": sum(abs(math.log(v)) for v in s) / 4,
        "seq_log_ratio_abs_max": math.log(2.0),
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_dual_clip_fraction_sequence_ratio():
    """A < 0 sequences with s = 4 (above c = 3: dual binds, 3 tokens) and s = 2 (below c, 1 token);
    an A > 0 sequence with s = 4 never dual-clips (2 tokens). 6 tokens, dual 3/6."""
    s = [4.0, 2.0, 4.0]
    mask = [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    ratios = [[v] * 3 for v in s]
    metrics = metrics_for(ratios, mask, [-1.0, -0.5, 1.0], "seq", dual=3.0)
    assert metrics["dual_clip_frac_token"] == pytest.approx(3 / 6, rel=1e-12)
    assert metrics["clip_frac_token"] == pytest.approx(2 / 6, rel=1e-12)  # only the A > 0 one
    assert metrics["ratio_out_of_range_token"] == pytest.approx(1.0, rel=1e-12)
