"""A step's metrics: functions of the samples and of the engine's per-mini-batch records."""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from megatron_gspo.algo import log_prob_gap
from megatron_gspo.config import AlgoConfig
from megatron_gspo.samples import TrainSample


def rollout_metrics(samples: list[TrainSample]) -> dict[str, float]:
    """Rewards, lengths and finish reasons of a rollout batch."""
    lengths = torch.tensor([s.response_length for s in samples], dtype=torch.float64)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    finish = defaultdict(int)
    for sample in samples:
        finish[sample.finish_reason] += 1
    metrics = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "reward_max": float(rewards.max()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "prompt_len_mean": sum(s.prompt_length for s in samples) / len(samples),
        "num_samples": float(len(samples)),
    }
    for reason, count in finish.items():
        metrics[f"finish_{reason}_frac"] = count / len(samples)
    return metrics


def staleness_metrics(
    samples: list[TrainSample], version: int, max_staleness: int
) -> dict[str, float]:
    """How old the samples of a step trained at weight version ``version`` are.

    A sample's staleness is ``version`` minus its oldest token's version (``weight_version``):
    ``staleness_mean``, ``staleness_max`` and ``staleness_hist/{k}`` (the share of samples of
    staleness ``k``, ``0 <= k <= max_staleness``); ``token_staleness_mean`` over response
    tokens (an episode's model tokens: not its observations). A partial sample has tokens of several versions (a weight sync landed while it was
    generated): ``partial_sample_frac``, and ``segments_per_sample`` (runs of one version; 1 for
    a sample of one version).
    """
    staleness = torch.tensor([version - s.weight_version for s in samples], dtype=torch.float64)
    per_sample = []
    for sample in samples:
        versions = sample.rollout_weight_versions
        if versions is None or versions.numel() == 0:
            versions = torch.full((sample.response_length,), sample.weight_version)
        elif sample.turns is not None:
            # An episode: its observations were sampled by no version (docs/agentic.md).
            versions = versions[sample.turns >= 0]
        per_sample.append(versions.long())
    # The version changes inside each sample, counted for all samples at once (one by one,
    # their small operations cost the trainer a few percent of a CPU demo step).
    versions = torch.cat(per_sample)
    owner = torch.repeat_interleave(
        torch.arange(len(samples)), torch.tensor([v.numel() for v in per_sample])
    )
    changes = (versions[1:] != versions[:-1]) & (owner[1:] == owner[:-1])
    segments = 1 + torch.bincount(owner[1:][changes], minlength=len(samples))
    tokens = (version - versions).double()
    metrics = {
        "staleness_mean": float(staleness.mean()),
        "staleness_max": float(staleness.max()),
        "token_staleness_mean": float(tokens.mean()) if tokens.numel() else 0.0,
        "partial_sample_frac": float((segments > 1).double().mean()),
        "segments_per_sample": float(segments.double().mean()),
    }
    for age in range(max_staleness + 1):
        metrics[f"staleness_hist/{age}"] = float((staleness == age).double().mean())
    return metrics


def log_prob_gap_metrics(samples: list[TrainSample]) -> dict[str, float]:
    """Trainer vs rollout log-probs on the same tokens (:func:`~megatron_gspo.algo.log_prob_gap`):
    ``rollout_log_prob_abs_diff``, ``rollout_kl_k3`` and the log-perplexity gap
    ``rollout_log_ppl_diff`` / ``rollout_log_ppl_abs_diff``.

    Available when old log-probs were recomputed by the trainer before any update (the two
    engines then hold the same weights, so the gap is pure train/inference mismatch: precision,
    kernels and, without R3, routes).
    """
    pairs = [
        (s.old_log_probs, s.rollout_log_probs, s.response_mask())
        for s in samples
        if s.old_log_probs is not None
        and s.rollout_log_probs is not None
        and s.old_log_probs is not s.rollout_log_probs
    ]
    if not pairs:
        return {}
    trainer, rollout, masks = zip(*pairs)
    return log_prob_gap(list(trainer), list(rollout), list(masks))


def reduce_step_metrics(per_step: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of several optimizer steps as one record: the mean of the finite values
    (``*_max``: the maximum; ``*_min``: the minimum; ``skipped``, ``num_skipped``: the sum), plus
    ``grad_norm_max`` and ``optimizer_steps``."""
    merged: dict[str, list[float]] = defaultdict(list)
    for metrics in per_step:
        for name, value in metrics.items():
            merged[name].append(float(value))
    reduced = {}
    for name, values in merged.items():
        if name.endswith("_max"):
            reduced[name] = max(values)
        elif name.endswith("_min"):
            reduced[name] = min(values)
        elif name in ("skipped", "num_skipped"):
            reduced[name] = sum(values)
        else:
            finite = [v for v in values if math.isfinite(v)]
            reduced[name] = sum(finite) / len(finite) if finite else float("nan")
    if per_step and "grad_norm" in per_step[0]:
        reduced["grad_norm_max"] = max(float(m["grad_norm"]) for m in per_step)
    reduced["optimizer_steps"] = float(len(per_step))
    return reduced


def headline_metrics(metrics: dict[str, float], algo: AlgoConfig) -> dict[str, float]:
    """The names every run reports whatever its configuration: ``policy_loss`` and ``kl``.

    ``policy_loss`` is the clipped policy-gradient term (the engine's ``pg_loss``, without the KL
    and entropy terms). ``kl`` is the KL to the reference model when one exists: the train step's
    ``KL(policy || reference)`` (``algo.kl_estimator``, token mean) with ``use_kl_loss``, else the
    old-policy ``token_level_kl`` of ``add_token_level_kl``. Without a reference model it is
    ``rollout_kl_k3``, the k3 estimate between the trainer's recomputed log-probs and the rollout
    engine's on the sampled tokens (train/inference mismatch); the ``rollout`` and ``detach``
    old-log-prob sources measure no trainer log-probs before the update, so ``kl`` is absent there
    rather than a made-up zero.
    """
    headline = {}
    if "pg_loss" in metrics:
        headline["policy_loss"] = metrics["pg_loss"]
    if "kl" not in metrics:
        source = "token_level_kl" if algo.add_token_level_kl else "rollout_kl_k3"
        if source in metrics:
            headline["kl"] = metrics[source]
    return headline


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 - C(n - c, k) / C(n, k)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)
