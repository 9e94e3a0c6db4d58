"""A step's rollout batch on disk: what ``rollout.save_rollouts`` writes and ``rollout.replay_dir``
reads back (docs/rollout-replay.md).

One safetensors file per RL step, ``<output_dir>/rollouts/step_<step:06d>.safetensors``. Every
tensor field of :class:`~megatron_gspo.samples.TrainSample` that the rollout filled (token ids,
loss mask, behaviour log-probs, the weight version of each token, routed experts, turns, turn
rewards) is stored as one tensor, the samples' tensors concatenated along their first axis, in
their own dtype (uint8 expert ids stay one byte each), with ``<field>.lengths`` (int64, one per
sample: its first-axis length, -1 where the sample had none). The per-sample scalars (prompt
length, group id, reward, finish reason, weight version, metadata), the stream ids of the prompts
the step trained and dropped, and the step's rollout metrics are JSON in the file's metadata. A
sample read back equals the one written, bit for bit.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from megatron_gspo.samples.train_sample import TrainSample

ROLLOUTS_DIR = "rollouts"
"""The folder of a run's recorded batches, in its output_dir."""
FORMAT = "megatron_gspo.recorded_batch/1"
_HEADER_KEY = "megatron_gspo"
_SCALAR_FIELDS = ("prompt_length", "group_id", "reward", "finish_reason", "weight_version")
_TENSOR_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(TrainSample)
    if f.name != "metadata" and f.name not in _SCALAR_FIELDS
)
"""Every tensor field of a sample; those the loop computes (advantages, old and reference
log-probs, old routes) are None when a batch is recorded, and so not stored."""


class RecordedBatchError(ValueError):
    """A recorded batch that is missing, unreadable or not of this format; names the file."""


@dataclass
class RecordedBatch:
    """One RL step's rollout batch, as the driver trained it."""

    step: int
    samples: list[TrainSample]
    trained_prompts: list[int]
    """Stream ids of the prompts whose samples these are."""
    dropped_prompts: list[int] = field(default_factory=list)
    """Stream ids of prompts the step consumed without training them (dynamic sampling)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The batch source's metrics and the prompt stream's statistics at the step."""


def recorded_batch_path(directory: str | os.PathLike, step: int) -> Path:
    """The file of step ``step`` in ``directory`` (a run's ``rollouts/`` folder)."""
    return Path(directory) / f"step_{step:06d}.safetensors"


def rollouts_directory(path: str | os.PathLike) -> Path:
    """The recorded batches' folder of ``path``: a run's output_dir (its ``rollouts/``) or the
    folder itself."""
    path = Path(path)
    return path / ROLLOUTS_DIR if (path / ROLLOUTS_DIR).is_dir() else path


def write_recorded_batch(directory: str | os.PathLike, batch: RecordedBatch) -> Path:
    """Write ``batch`` to its step's file in ``directory`` (created if missing), atomically: a
    kill leaves the previous file or none, never a part."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in _TENSOR_FIELDS:
        values = [getattr(sample, name) for sample in batch.samples]
        present = [value for value in values if value is not None]
        if not present:
            continue
        if any(value.dim() == 0 for value in present):
            raise ValueError(f"{name}: a recorded batch stores tensors with a first axis")
        tensors[name] = torch.cat([value.contiguous() for value in present]).contiguous()
        tensors[f"{name}.lengths"] = torch.tensor(
            [-1 if value is None else int(value.shape[0]) for value in values], dtype=torch.int64
        )
    header = {
        "format": FORMAT,
        "step": batch.step,
        "trained_prompts": [int(i) for i in batch.trained_prompts],
        "dropped_prompts": [int(i) for i in batch.dropped_prompts],
        "metrics": batch.metrics,
        "samples": [
            {
                **{name: getattr(sample, name) for name in _SCALAR_FIELDS},
                "metadata": sample.metadata,
            }
            for sample in batch.samples
        ],
    }
    path = recorded_batch_path(directory, batch.step)
    temporary = path.with_name(path.name + ".tmp")
    # Bytes written here, not safetensors' save_file, which creates its file readable by its
    # owner only: the run's other outputs follow the umask.
    temporary.write_bytes(save(tensors, metadata={_HEADER_KEY: json.dumps(header)}))
    os.replace(temporary, path)
    return path


def read_recorded_batch(directory: str | os.PathLike, step: int) -> RecordedBatch:
    """Step ``step``'s batch from ``directory``; :class:`RecordedBatchError` names a missing or
    damaged file."""
    path = recorded_batch_path(directory, step)
    try:
        header, tensors = _open_recorded_batch(path, step, load_tensors=True)
    except RecordedBatchError as error:
        raise RecordedBatchError(
            f"{error}; record the step again (rollout.save_rollouts=true) or replay another run"
        ) from None
    samples = [
        TrainSample(tokens=torch.empty(0, dtype=torch.int64), **scalars)
        for scalars in header["samples"]
    ]
    for name in _TENSOR_FIELDS:
        if name not in tensors:
            continue
        lengths = tensors[f"{name}.lengths"].tolist()
        if len(lengths) != len(samples) or sum(max(n, 0) for n in lengths) != len(tensors[name]):
            raise RecordedBatchError(f"{path}: the lengths of {name!r} do not match its tensor")
        pieces = iter(tensors[name].split([n for n in lengths if n >= 0]))
        for sample, length in zip(samples, lengths):
            setattr(sample, name, None if length < 0 else next(pieces).clone())
    return RecordedBatch(
        step=step,
        samples=samples,
        trained_prompts=header["trained_prompts"],
        dropped_prompts=header["dropped_prompts"],
        metrics=header["metrics"],
    )


def check_recorded_batch(directory: str | os.PathLike, step: int) -> str | None:
    """What is wrong with step ``step``'s file in ``directory`` without loading its tensors (a
    start-up check); None when it is there and of this format."""
    try:
        _open_recorded_batch(recorded_batch_path(directory, step), step, load_tensors=False)
    except RecordedBatchError as error:
        return str(error)
    return None


def _open_recorded_batch(
    path: Path, step: int, *, load_tensors: bool
) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header of step ``step``'s file at ``path`` and, with ``load_tensors``, its tensors;
    :class:`RecordedBatchError` says what is wrong (missing, damaged, another format or step)."""
    if not path.is_file():
        raise RecordedBatchError(f"{path} is missing")
    try:
        with safe_open(str(path), framework="pt") as handle:
            header = json.loads((handle.metadata() or {})[_HEADER_KEY])
            names = handle.keys() if load_tensors else []  # a safe_open handle is not iterable
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as error:
        raise RecordedBatchError(
            f"{path} is damaged or not a recorded batch ({error.__class__.__name__}: {error})"
        ) from None
    if header.get("format") != FORMAT or header.get("step") != step:
        raise RecordedBatchError(
            f"{path} holds format {header.get('format')!r}, step {header.get('step')}; "
            f"expected {FORMAT!r}, step {step}"
        )
    return header, tensors
