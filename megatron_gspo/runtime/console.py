"""What a run prints: log format and levels, where the outputs go, and a summary at the end.

At ``logging.log_level=INFO`` the console shows our messages only. Megatron-Core logs its setup at
INFO (58 lines of gradient-bucket listings for the CPU demo) and warns at import that Transformer
Engine and apex are missing and that a CUDA-graph setting is deprecated: expected without a GPU,
noise otherwise; from 0.17 its own checkpoint save warns that it is deprecated. Those go to the
console only at ``DEBUG``. A :class:`ConfigWarning` is printed
once, as a log line.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

from megatron_gspo.config import ConfigWarning, TrainConfig
from megatron_gspo.runtime.checkpoint_files import checkpoint_root, latest_checkpoint

logger = logging.getLogger("megatron_gspo")

KERNEL_LIBRARY_NOTICES = (
    r".*Transformer Engine and Apex are not installed",
    r".*Apex is not installed",
    r".*full scope is deprecated",
)
"""Warnings Megatron-Core issues on every import without a GPU stack (messages, as regexes)."""

UPSTREAM_LOG_NOTICES = {
    "megatron.core.dist_checkpointing.strategies.torch": r"MCore's async save is deprecated",
}
"""Log lines Megatron-Core writes at WARNING with nothing for a user to act on (logger name:
message regex): from 0.17 its synchronous checkpoint save goes through the deprecated
asynchronous path and says so on the first save of every run."""


class _UpstreamNoticeFilter(logging.Filter):
    """Drops one logger's :data:`UPSTREAM_LOG_NOTICES` line (a logger's filters see only the
    records that logger creates, hence one filter per named logger)."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def configure_logging(rank: int, level: str = "INFO") -> None:
    """Log format and levels for this process; may be called again once the level is known.

    Rank 0 logs at ``level``, the other ranks warnings only. Below DEBUG, Megatron-Core's own
    INFO messages and its kernel-library notices are not shown.
    """
    logging.basicConfig(
        format=f"[rank{rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    effective = level if rank == 0 else "WARNING"
    logging.getLogger().setLevel(effective)
    verbose = logging.getLogger().isEnabledFor(logging.DEBUG)
    megatron = logging.getLogger("megatron")
    megatron.setLevel(logging.NOTSET if verbose else logging.WARNING)
    for name, pattern in UPSTREAM_LOG_NOTICES.items():
        upstream = logging.getLogger(name)
        for existing in [f for f in upstream.filters if isinstance(f, _UpstreamNoticeFilter)]:
            upstream.removeFilter(existing)
        if not verbose:
            upstream.addFilter(_UpstreamNoticeFilter(pattern))
    for pattern in KERNEL_LIBRARY_NOTICES:
        warnings.filterwarnings("default" if verbose else "ignore", message=pattern)
    _show_config_warnings_as_log_lines(rank)


def _show_config_warnings_as_log_lines(rank: int) -> None:
    """:class:`ConfigWarning` as one log line (rank 0 only: every rank has the same config),
    other warnings as Python prints them. Python's default filter already shows a warning once
    per place, so a config validated twice (resolving ``model.hf_path`` builds it again) does not
    repeat it."""
    show = warnings.showwarning
    if getattr(show, "shows_config_warnings", False):
        return

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, ConfigWarning):
            if rank == 0:
                logging.getLogger("megatron_gspo.config").warning("%s", message)
            return
        show(message, category, filename, lineno, file, line)

    showwarning.shows_config_warnings = True
    warnings.showwarning = showwarning


def describe_outputs(cfg: TrainConfig) -> str:
    """Where this run writes, said before it starts."""
    root = Path(cfg.output_dir)
    sinks = [f"metrics {root / 'metrics.jsonl'}"]
    if cfg.logging.tensorboard:
        sinks.append(f"TensorBoard {root / 'tensorboard'}")
    if cfg.checkpoint.interval:
        sinks.append(
            f"checkpoints {checkpoint_root(cfg.output_dir)} "
            f"(every {cfg.checkpoint.interval} steps, keeping {cfg.checkpoint.keep_last})"
        )
    else:
        sinks.append("no checkpoints (checkpoint.interval=0)")
    action = "resuming" if cfg.resume else "training"
    return f"{action} {cfg.steps} steps; outputs: " + ", ".join(sinks)


def summarize(records: list[dict[str, Any]], cfg: TrainConfig, seconds: float) -> str:
    """The end of a run: steps, reward first and last, where the metrics and checkpoints are."""
    root = Path(cfg.output_dir)
    if not records:
        return f"no RL step was run ({cfg.steps} steps configured); outputs in {root}"
    first, last = records[0], records[-1]
    lines = [
        f"finished steps {first['step']}-{last['step']} of {cfg.steps} in {seconds:.0f} s; "
        f"reward_mean {_number(first.get('reward_mean'))} (step {first['step']}) -> "
        f"{_number(last.get('reward_mean'))} (step {last['step']})",
        f"  metrics:     {root / 'metrics.jsonl'}"
        + (f"  (TensorBoard: {root / 'tensorboard'})" if cfg.logging.tensorboard else ""),
    ]
    latest = latest_checkpoint(checkpoint_root(cfg.output_dir))
    if latest is not None:
        lines.append(f"  checkpoints: {latest} (latest)")
    else:
        lines.append("  checkpoints: none (checkpoint.interval=0)")
    return "\n".join(lines)


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
