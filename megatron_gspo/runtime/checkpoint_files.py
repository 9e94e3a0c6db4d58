"""The checkpoint folder on disk: its layout, defined once (no Megatron, torch only lazily).

The trainer's checkpoints (``engine/checkpoint.py``) write it; what runs before Megatron is
imported reads it (the start-up checks, the console's summary, the Ctrl-C resume hint), and so
does the checkpoint converter (``convert/export.py``)::

    <output_dir>/checkpoints/  (checkpoint_root)
      latest                   "step_000010": the newest complete checkpoint (atomic replace)
      step_000010/
        checkpoint.json        metadata + extra_state; written LAST, so it marks completion
        .metadata *.distcp     torch_dist (PyTorch DCP) shards of every rank
        common.pt metadata.json
      step_000020.tmp-<uuid>/  a save in progress, or an interrupted one: never loaded,
                               deleted by the next save (as is a step dir without the marker)

Atomicity: every rank writes into the ``.tmp-<uuid>`` directory; only after all of them have
finished does rank 0 write ``checkpoint.json``, rename the directory and replace ``latest``
(:func:`publish_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
import zipfile
from typing import Optional

logger = logging.getLogger(__name__)

FORMAT = "megatron_gspo.checkpoint/1"
"""The ``format`` entry of ``checkpoint.json``."""
MARKER = "checkpoint.json"
"""Written last into a checkpoint directory: it marks the checkpoint complete."""
LATEST = "latest"
"""The file in the checkpoint root that names the newest complete checkpoint."""
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.(tmp|old)-[0-9a-f]+$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded as asked; says what, why and how to fix."""

    def __init__(self, what: str, why: str, fix: str):
        # The three parts as args: the error pickles (it is broadcast from rank 0 to all ranks).
        super().__init__(what, why, fix)
        self.what, self.why, self.fix = what, why, fix

    def __str__(self) -> str:
        return f"{self.what}\n  why: {self.why}\n  fix: {self.fix}"


def checkpoint_root(output_dir: str) -> str:
    """``<output_dir>/checkpoints``: where a run's checkpoints live."""
    return os.path.join(output_dir, "checkpoints")


def step_directory(root_dir: str, step: int) -> str:
    """``root_dir/step_{step:06d}``: where the checkpoint of ``step`` lives once complete."""
    return os.path.join(root_dir, f"step_{step:06d}")


def complete_checkpoints(root_dir: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the complete checkpoints under ``root_dir``, oldest first."""
    if not os.path.isdir(root_dir):
        return []
    found = []
    for name in os.listdir(root_dir):
        match = _STEP_DIR.match(name)
        path = os.path.join(root_dir, name)
        if match and os.path.isfile(os.path.join(path, MARKER)):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(root_dir: str) -> Optional[str]:
    """Path of the checkpoint to resume from under ``root_dir``: the one ``latest`` names (it
    may be edited to rewind a run), or the highest complete step when ``latest`` is missing or
    names no complete checkpoint; None when there is none. Only complete checkpoints (with
    ``checkpoint.json``) are ever returned."""
    complete = complete_checkpoints(root_dir)
    if not complete:
        return None
    try:
        with open(os.path.join(root_dir, LATEST)) as handle:
            name = handle.read().strip()
    except FileNotFoundError:
        name = ""
    named = os.path.join(root_dir, name)
    if name and any(path == named for _, path in complete):
        return named
    if name:
        logger.warning(
            "%s/latest names %r, which is not complete; using the newest", root_dir, name
        )
    return complete[-1][1]


def damaged_files(path: str) -> list[str]:
    """What is missing or cut short in the checkpoint directory ``path`` (empty when it looks
    whole), one line per file.

    A save that completed can still be damaged afterwards: a full disk or quota while copying it,
    a file truncated by a crashed sync. Loading such a checkpoint fails deep inside PyTorch's
    reader (a bare ``EOFError``), so its files are checked first, without reading the tensors:
    every shard file (``*.distcp``) must be as long as the byte ranges the index (``.metadata``)
    assigns to it, ``common.pt`` must be a complete torch (zip) file and the JSON files must
    parse.
    """
    from torch.distributed.checkpoint import FileSystemReader

    problems = []
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as error:  # truncated or missing: pickle, EOF, OS errors
        return [f"{os.path.join(path, '.metadata')}: unreadable ({type(error).__name__}: {error})"]
    needed: dict[str, int] = {}
    for item in index.storage_data.values():
        needed[item.relative_path] = max(
            needed.get(item.relative_path, 0), item.offset + item.length
        )
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            problems.append(f"{file}: missing")
        elif os.path.getsize(file) < size:
            problems.append(
                f"{file}: {os.path.getsize(file)} bytes, the index needs {size} (truncated)"
            )
    common = os.path.join(path, "common.pt")
    if os.path.exists(common) and not zipfile.is_zipfile(common):
        problems.append(f"{common}: not a complete torch file (truncated)")
    for name in (MARKER, "metadata.json"):
        file = os.path.join(path, name)
        try:
            with open(file) as handle:
                json.load(handle)
        except (OSError, ValueError) as error:
            problems.append(f"{file}: unreadable ({type(error).__name__}: {error})")
    return problems


def whole_checkpoint(root_dir: str) -> Optional[str]:
    """:func:`latest_checkpoint`, or, when its files are damaged (:func:`damaged_files`), the
    newest older complete one that is whole, with a warning that names the damaged files. None
    when ``root_dir`` holds no complete checkpoint; a :class:`CheckpointError` when every one is
    damaged."""
    preferred = latest_checkpoint(root_dir)
    if preferred is None:
        return None
    complete = complete_checkpoints(root_dir)
    steps = dict((path, step) for step, path in complete)
    older = [path for step, path in reversed(complete) if step < steps[preferred]]
    damaged = []
    for path in [preferred, *older]:
        problems = damaged_files(path)
        if not problems:
            if damaged:
                logger.warning(
                    "resuming from %s instead of the newer %s: %s",
                    path,
                    ", ".join(os.path.basename(p) for p, _ in damaged),
                    "; ".join(problem for _, found in damaged for problem in found),
                )
            return path
        logger.warning("checkpoint %s is damaged: %s", path, "; ".join(problems))
        damaged.append((path, problems))
    raise CheckpointError(
        f"every complete checkpoint in {root_dir} is damaged: "
        + "; ".join(problem for _, found in damaged for problem in found),
        "a damaged checkpoint cannot be loaded (its files are shorter than its index says)",
        "restore the files from a copy, or start a fresh run (resume=false with "
        "overwrite_output_dir=true, or another output_dir)",
    )


def read_checkpoint_metadata(path: str) -> dict:
    """The ``checkpoint.json`` of a complete checkpoint directory."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise CheckpointError(
            f"{path} is not a complete megatron_gspo checkpoint (no {MARKER})",
            "the completion marker is written only after every rank finished saving",
            "pass a step_XXXXXX directory written by save_checkpoint, or its root directory",
        )
    with open(marker) as handle:
        metadata = json.load(handle)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{marker} has format {metadata.get('format')!r}, expected {FORMAT!r}",
            "the metadata layout differs between checkpoint format versions",
            "load it with the megatron_gspo version that wrote it",
        )
    return metadata


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a root directory holding step_* checkpoints (-> the latest)."""
    if _TMP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(
            f"{path} is an incomplete (interrupted or in-progress) save",
            "only directories renamed to step_XXXXXX after every rank finished are complete",
            "pass the checkpoint root or a complete step_XXXXXX directory",
        )
    if os.path.isfile(os.path.join(path, MARKER)) or os.path.isfile(
        os.path.join(path, "metadata.json")
    ):
        return path
    if _STEP_DIR.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MARKER})",
            "the save that created it was interrupted before every rank finished",
            "pass the checkpoint root (its latest complete checkpoint is used) or another step",
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(
            f"no checkpoint at {path}",
            "it is neither a torch_dist checkpoint directory nor a root holding complete "
            "step_* checkpoints",
            "check the path (checkpoint.load_path / output_dir)",
        )
    return latest


# ---------------------------------------------------------------------------------------------
# Writing (rank 0)
# ---------------------------------------------------------------------------------------------


def new_save_directory(root_dir: str, step: int) -> str:
    """A fresh ``step_XXXXXX.tmp-<uuid>`` directory for every rank to write ``step``'s shards
    into, after deleting what interrupted saves left behind."""
    os.makedirs(root_dir, exist_ok=True)
    _remove_stale(root_dir)
    temporary = f"{step_directory(root_dir, step)}.tmp-{uuid.uuid4().hex}"
    os.makedirs(temporary)
    return temporary


def publish_checkpoint(
    temporary: str, final: str, root_dir: str, metadata: dict, keep_last: int
) -> None:
    """After every rank wrote its shards into ``temporary``: write the marker, rename it to
    ``final``, point ``latest`` at it, then delete all but the newest ``keep_last``."""
    _write_atomically(os.path.join(temporary, MARKER), json.dumps(metadata, indent=1))
    _fsync_directory(temporary)
    previous = None
    if os.path.exists(final):  # the same step saved again (e.g. after a resume)
        previous = f"{final}.old-{uuid.uuid4().hex}"
        os.replace(final, previous)
    os.replace(temporary, final)
    _fsync_directory(root_dir)
    _write_atomically(os.path.join(root_dir, LATEST), os.path.basename(final) + "\n")
    _fsync_directory(root_dir)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    _prune(root_dir, keep_last, keep=final)


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _fsync_directory(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_stale(root_dir: str) -> None:
    """Delete what interrupted saves left: ``.tmp-``/``.old-`` dirs, step dirs without marker."""
    for name in os.listdir(root_dir):
        path = os.path.join(root_dir, name)
        stale = _TMP_DIR.match(name) or (
            _STEP_DIR.match(name) and not os.path.isfile(os.path.join(path, MARKER))
        )
        if stale and os.path.isdir(path):
            logger.warning("removing incomplete checkpoint %s", path)
            shutil.rmtree(path, ignore_errors=True)


def _prune(root_dir: str, keep_last: int, keep: str) -> None:
    complete = [path for _, path in complete_checkpoints(root_dir)]
    for path in complete[: max(0, len(complete) - keep_last)]:
        if path != keep:
            logger.info("removing old checkpoint %s (checkpoint.keep_last=%d)", path, keep_last)
            shutil.rmtree(path, ignore_errors=True)
