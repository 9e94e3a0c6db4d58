"""Start-up checks: everything that can be checked without building the model, checked before it,
and every problem reported at once.

Building the model, the optimizer and the rollout engine takes seconds to minutes; a typo in a
data path found afterwards costs that much per attempt, and one problem at a time. So before
:func:`megatron_gspo.loop.run`, the driver (global rank 0, which owns data, rewards, rollout and
logs) calls :func:`check_before_start`, which checks

- the output folder (a fresh run must not overwrite another run's metrics or checkpoints),

and raises one :class:`StartupErrors` listing each problem as what / why / how to fix.
:func:`prepare_output_dir` then clears the previous run's outputs when ``overwrite_output_dir``
allows it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from megatron_gspo.config import ConfigError, TrainConfig

logger = logging.getLogger(__name__)


class StartupErrors(ConfigError):
    """Every problem found before start, each a :class:`ConfigError`."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        self.key = self.errors[0].key
        count = f"{len(errors)} problem{'s' if len(errors) > 1 else ''}"
        body = "\n\n".join(str(error) for error in self.errors)
        ValueError.__init__(self, f"{count} found before start:\n\n{body}")


def check_before_start(cfg: TrainConfig) -> None:
    """Raise :class:`StartupErrors` with every problem of the checks in the module docstring."""
    errors: list[ConfigError] = []
    for check in (_output_dir,):
        errors += check(cfg)
    if errors:
        raise StartupErrors(errors)


def prepare_output_dir(cfg: TrainConfig) -> None:
    """With ``overwrite_output_dir=true`` on a fresh run, delete the previous run's metrics,
    TensorBoard logs and checkpoints, so that the new run's outputs are not mixed with them."""
    if cfg.resume or not cfg.overwrite_output_dir:
        return
    for path in previous_run_outputs(cfg.output_dir):
        logger.warning("overwrite_output_dir=true: removing %s of a previous run", path)
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def previous_run_outputs(output_dir: str) -> list[Path]:
    """What a run leaves in ``output_dir`` and a fresh run would overwrite or mix with its own:
    a non-empty ``metrics.jsonl``, a ``checkpoints/`` folder with ``step_*`` folders in it, a
    ``tensorboard/`` folder."""
    root = Path(output_dir)
    found = []
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(metrics)
    checkpoints = root / "checkpoints"
    if checkpoints.is_dir() and any(checkpoints.glob("step_*")):
        found.append(checkpoints)
    if found and (root / "tensorboard").is_dir():
        found.append(root / "tensorboard")
    return found


# --------------------------------------------------------------------------------------------
# The checks: each returns its problems, never raises
# --------------------------------------------------------------------------------------------


def _output_dir(cfg: TrainConfig) -> list[ConfigError]:
    if cfg.resume or cfg.overwrite_output_dir:
        return []
    previous = previous_run_outputs(cfg.output_dir)
    if not previous:
        return []
    return [
        ConfigError(
            "output_dir",
            f"{cfg.output_dir} already holds a run ({', '.join(p.name for p in previous)})",
            "a fresh run would truncate its metrics.jsonl and overwrite or mix in its checkpoints",
            "continue that run with resume=true, choose another output_dir, or set "
            "overwrite_output_dir=true to delete its outputs first",
        )
    ]
