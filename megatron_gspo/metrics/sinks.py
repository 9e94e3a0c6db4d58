"""Where a step's metrics go: metrics.jsonl, TensorBoard, W&B and the progress bar."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional

from megatron_gspo.config import LoggingConfig

# Metrics shown in the progress bar, in order.
PROGRESS_KEYS = ("reward_mean", "clip_frac_token", "kl", "step_time_s")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN/inf; keep them visible instead of dropping them
    return value


class MetricsLogger:
    """Writes one record per step to every enabled sink."""

    def __init__(
        self,
        output_dir: str,
        config: LoggingConfig,
        *,
        total_steps: int,
        start_step: int = 0,
        run_config: Optional[dict] = None,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        self._tensorboard = None
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step == 0 and self.path.exists():
            self.path.unlink()  # a fresh run replaces old metrics; a resumed run appends
        elif start_step > 0:
            self._truncate_after(start_step)
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run hides the interrupted run's events of steps >= start_step (it logs
            # them again), as _truncate_after drops their metrics.jsonl lines.
            self._tensorboard = SummaryWriter(
                str(Path(output_dir) / "tensorboard"), purge_step=start_step or None
            )
        if config.wandb:
            try:
                import wandb
            except ImportError as error:
                raise RuntimeError(
                    "logging.wandb=true but wandb is not installed: pip install wandb "
                    "(or set logging.wandb=false)"
                ) from error
            self._wandb = wandb.init(
                project=config.wandb_project, config=run_config, dir=output_dir, resume="allow"
            )
        if config.progress_bar:
            from tqdm import tqdm

            self._progress = tqdm(total=total_steps, initial=start_step, desc="rl", unit="step")

    def _truncate_after(self, start_step: int) -> None:
        """Drop records of steps >= start_step (they belong to the run that was interrupted,
        the resumed run logs them again) and a line cut short by a kill."""
        if not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("step", -1) < start_step:
                kept.append(line)
        temporary = self.path.with_suffix(".jsonl.tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        os.replace(temporary, self.path)

    def log(
        self, step: int, metrics: dict[str, float], *, histograms: Optional[dict] = None
    ) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _json_safe(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key.replace(".", "/"), value, step)
            for key, values in (histograms or {}).items():
                self._tensorboard.add_histogram(key, values, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if self._progress is not None:
            shown = {k: f"{metrics[k]:.4g}" for k in PROGRESS_KEYS if k in metrics}
            self._progress.set_postfix(shown, refresh=False)
            self._progress.update(1)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    """All records of ``output_dir/metrics.jsonl`` (for tools and tests)."""
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
