"""Metrics: the functions that compute a step's metrics (:mod:`~megatron_gspo.metrics.step`), and
their sinks (:mod:`~megatron_gspo.metrics.sinks`: ``metrics.jsonl``, TensorBoard, W&B, the
progress bar). Only the driver (global rank 0) writes."""

from megatron_gspo.metrics.sinks import MetricsLogger, read_metrics
from megatron_gspo.metrics.step import (
    headline_metrics,
    log_prob_gap_metrics,
    pass_at_k,
    reduce_step_metrics,
    rollout_metrics,
    staleness_metrics,
)

__all__ = [
    "MetricsLogger",
    "headline_metrics",
    "log_prob_gap_metrics",
    "pass_at_k",
    "read_metrics",
    "reduce_step_metrics",
    "rollout_metrics",
    "staleness_metrics",
]
