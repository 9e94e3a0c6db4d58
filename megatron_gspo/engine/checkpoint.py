"""Megatron distributed checkpoints (``torch_dist``): resumable and loadable at any layout.

A checkpoint holds the policy weights (each chunk's ``sharded_state_dict``), the optimizer state,
the learning-rate schedule, every rank's RNG states, the engine's step counters and an
``extra_state`` dict from the caller (data position, reward running moments: plain JSON data).
The folder it lives in, how a save becomes complete atomically and how a damaged one is found:
:mod:`megatron_gspo.runtime.checkpoint_files`.

Optimizer state: one layout-independent format, written and read by
:mod:`megatron_gspo.engine.optimizer_state` (why not Megatron's own: see there), so a checkpoint
reshards over tp, pp, vpp, ep, etp, cp and dp like the weights, and the distributed and
non-distributed optimizers load each other's checkpoints. The shared Adam step and everything
else plain live in ``checkpoint.json``.

Also handled here: ``OptimizerParamScheduler.load_state_dict`` *adds* the saved step count to the
current one (the engine's scheduler is already at 1), so the count is set, not added.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import time
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_gspo.config import to_dict
from megatron_gspo.engine.compat import MEGATRON_CORE_VERSION, cuda_available
from megatron_gspo.engine.optimizer_state import (
    apply_optimizer_state,
    optimizer_load_request,
    optimizer_sharded_state,
)
from megatron_gspo.runtime.checkpoint_files import (
    FORMAT,
    CheckpointError,
    new_save_directory,
    publish_checkpoint,
    read_checkpoint_metadata,
    resolve_checkpoint,
    step_directory,
    whole_checkpoint,
)
from megatron_gspo.runtime.lifetime import die_with_parent, forks_die_with_parent

logger = logging.getLogger(__name__)

_UNCHECKED_MODEL_FIELDS = {
    "hf_path",
    "init_std",
    "recompute_activations",
    "moe_aux_loss_coef",
    "max_position_embeddings",
    "dtype",
}
"""Model config fields that may differ between a checkpoint and the run that loads it (they
change neither the tensors stored nor the function they compute)."""


# ---------------------------------------------------------------------------------------------
# Rank agreement
# ---------------------------------------------------------------------------------------------


def _raise_if_any_rank_failed(error: Optional[BaseException]) -> None:
    """Collective: raise (the first rank's error) on EVERY rank if any rank failed, so no rank
    is left waiting in a later collective."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if failed:
        if error is not None:
            raise error
        rank, text = failed[0]
        raise CheckpointError(f"rank {rank} failed: {text}", "see that rank's log", "fix it there")


def _on_rank_zero(function, *args) -> Any:
    """Run ``function`` on rank 0 only; its result (or error) on every rank."""
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", function(*args))
        except Exception as error:  # re-raised on every rank below
            payload[0] = ("error", error)
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise value
    return value


def resumable_checkpoint(root_dir: str) -> Optional[str]:
    """The checkpoint a resume loads: :func:`~megatron_gspo.runtime.checkpoint_files.whole_checkpoint`
    (the latest, or the newest older whole one when its files are damaged). Collective when
    torch.distributed is initialised (rank 0 decides for all)."""
    if dist.is_initialized():
        return _on_rank_zero(whole_checkpoint, root_dir)
    return whole_checkpoint(root_dir)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_sharded_state(chunks: Sequence[torch.nn.Module]) -> dict[str, dict]:
    """``{"model": ...}`` (``model0``, ``model1``, ... with virtual pipeline stages), the keys of
    Megatron-LM and of :func:`~megatron_gspo.engine.hf_import_export.save_torch_dist_weights`."""
    if len(chunks) == 1:
        return {"model": _unwrap(chunks[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}


def _apply_model_state(chunks: Sequence[torch.nn.Module], loaded: dict) -> None:
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for name, chunk in zip(names, chunks):
        _unwrap(chunk).load_state_dict(loaded[name], strict=True)


def _load(request: dict, path: str) -> dict:
    try:
        # Access integrity is a save-time property (every shard written once); loads request
        # overlapping or partial pieces by design.
        return dist_checkpointing.load(request, path, validate_access_integrity=False)
    except Exception as error:
        raise CheckpointError(
            f"loading {path} failed: {type(error).__name__}: {error}",
            "the checkpoint lacks a tensor this model needs or stores it with another shape, or "
            "one of its files is corrupt",
            "load it with the model config it was saved with (model.* in its checkpoint.json); "
            "if the files are damaged, delete this step directory to resume from the one before",
        ) from error


def load_weights_only(chunks: Sequence[torch.nn.Module], path: str) -> None:
    """Load the policy weights of a checkpoint into ``chunks`` (PolicyModel or DDP chunks of any
    parallel layout; a collective). ``path``: a checkpoint directory, a root holding step_*
    checkpoints (its latest is used) or a ``hf-to-megatron`` torch_dist directory. Optimizer
    state, schedule and RNG are left alone; with a bf16 model call the optimizer's
    ``reload_model_params()`` afterwards if it already exists."""
    path = resolve_checkpoint(path)
    loaded = _load(_model_sharded_state(chunks), path)
    _apply_model_state(chunks, loaded)
    logger.info("loaded weights from %s", path)


# ---------------------------------------------------------------------------------------------
# RNG, schedule, layout
# ---------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if cuda_available() else None,
        "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if cuda_available() and state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _rng_sharded(data: Optional[dict]) -> ShardedObject:
    """One object per global rank (a rank's RNG streams are its own)."""
    return ShardedObject(
        "rng_state", data, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0
    )


def _layout(engine: Any) -> dict[str, int]:
    parallel = engine.parallel
    return {
        name: getattr(parallel, name)
        for name in ("world_size", "tp", "pp", "vpp", "cp", "dp", "ep", "etp")
    }


def _check_schedule(engine: Any, saved: dict, allow_change: bool) -> None:
    current = engine.scheduler.state_dict()
    changed = {
        k: (saved[k], current[k]) for k in current if k != "num_steps" and saved[k] != current[k]
    }
    if changed and not allow_change:
        raise CheckpointError(
            "the learning-rate schedule of the checkpoint differs from this run's: "
            + ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()),
            "resuming with another schedule changes the training trajectory (it follows from "
            "optim.*, steps, algo.ppo_epochs and algo.num_mini_batches)",
            "restore those settings, or pass allow_schedule_change=True to continue the new "
            "schedule from the checkpoint's step, or start from the weights only "
            "(checkpoint.load_path)",
        )


def _check_model(engine: Any, saved: dict) -> None:
    current = to_dict(engine.cfg.model)
    changed = {
        k: (saved.get(k), v)
        for k, v in current.items()
        if k not in _UNCHECKED_MODEL_FIELDS and saved.get(k) != v
    }
    if changed:
        raise CheckpointError(
            "the checkpoint's model differs from this run's: "
            + ", ".join(f"model.{k} {old!r} -> {new!r}" for k, (old, new) in changed.items()),
            "its weights belong to another architecture",
            "set the model.* fields to the checkpoint's (its checkpoint.json lists them)",
        )


# ---------------------------------------------------------------------------------------------
# The writer's result queue
# ---------------------------------------------------------------------------------------------


_writer_manager = None
"""The ``multiprocessing`` manager behind Megatron's writer result queue, once started."""


def _start_writer_result_queue() -> None:
    """Start the process behind Megatron's checkpoint-writer result queue ourselves, so that it
    dies with the trainer.

    ``dist_checkpointing``'s torch_dist writer sends its results through a queue that
    ``megatron.core.dist_checkpointing.strategies.filesystem_async._get_write_results_queue``
    (megatron-core 0.16.1) creates at the first save as ``spawn``-context ``Manager().Queue()``:
    a manager process (277 MB on the CPU demo) that lives as long as the trainer and survives a
    SIGKILL of it. Megatron creates the queue only while its module global is None; we fill the
    global first with a queue whose manager asks for SIGKILL when the trainer dies
    (:func:`megatron_gspo.runtime.lifetime.die_with_parent`). A version without that global is left
    alone (tests/e2e/test_cleanup.py fails if its writer outlives the trainer).
    """
    global _writer_manager
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is not None:
        return  # already started, or this version has no such global
    from multiprocessing.managers import SyncManager

    _writer_manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    _writer_manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = _writer_manager.Queue()


def stop_writer_result_queue() -> None:
    """Stop the process behind the writer's result queue, if :func:`_start_writer_result_queue`
    started it (a run that ends while its process goes on; the next save starts a new one)."""
    global _writer_manager
    if _writer_manager is None:
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
    _writer_manager.shutdown()
    _writer_manager = None


# ---------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------


def _json_round_trip(extra_state: dict) -> dict:
    try:
        text = json.dumps(extra_state, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"extra_state is not JSON data: {error}",
            "extra_state is stored in checkpoint.json",
            "convert tensors to lists / floats and objects to dicts before saving",
        ) from error
    if json.loads(text) != extra_state:
        raise CheckpointError(
            "extra_state does not survive JSON unchanged (tuples or non-string dict keys?)",
            "a resumed run would see different data than it saved",
            "use lists and string keys",
        )
    return extra_state


def save_checkpoint(
    engine: Any,
    root_dir: str,
    step: int,
    extra_state: Optional[dict] = None,
    *,
    keep_last: Optional[int] = None,
) -> str:
    """Save ``engine`` (TrainEngine) as ``root_dir/step_{step:06d}`` and point ``latest`` at it;
    then delete all but the newest ``keep_last`` (default ``checkpoint.keep_last``) checkpoints.
    A collective: every rank calls it at the same point. ``extra_state`` (JSON data) is taken
    from rank 0. Returns the checkpoint's path. ``root_dir`` must be one filesystem shared by
    every rank."""
    started = time.perf_counter()
    keep_last = engine.cfg.checkpoint.keep_last if keep_last is None else keep_last
    final = step_directory(root_dir, step)
    error = None
    try:
        extra_state = _json_round_trip(dict(extra_state or {}))
    except Exception as caught:  # every rank must learn of it, or the others would hang
        error = caught
    _raise_if_any_rank_failed(error)

    temporary = _on_rank_zero(new_save_directory, root_dir, step)
    model = _model_sharded_state(engine.model)
    optimizer_tensors, optimizer_metadata = optimizer_sharded_state(engine.optimizer, model)
    sharded = {**model, "rng_state": _rng_sharded(_rng_state())}
    if optimizer_tensors:  # an empty dict would land in the common (rank-0) state
        sharded["optimizer"] = optimizer_tensors
    _start_writer_result_queue()
    with forks_die_with_parent():  # the writers it forks mid-save end with a SIGKILLed trainer
        dist_checkpointing.save(sharded, temporary, validate_access_integrity=True)
    metadata = {
        "format": FORMAT,
        "step": step,
        "extra_state": extra_state,
        "engine": {
            "optimizer_steps": engine.step_count,
            "skipped_steps": engine.skipped_steps,
            "consecutive_skips": engine.consecutive_skips,
        },
        "optimizer": optimizer_metadata,
        "scheduler": engine.scheduler.state_dict(),
        "layout": _layout(engine),
        "model": to_dict(engine.cfg.model),
        "versions": {
            "megatron_core": ".".join(map(str, MEGATRON_CORE_VERSION)),
            "torch": torch.__version__,
        },
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _on_rank_zero(publish_checkpoint, temporary, final, root_dir, metadata, keep_last)
    logger.info("saved checkpoint %s in %.1f s", final, time.perf_counter() - started)
    return final


def load_checkpoint(
    engine: Any,
    path: str,
    *,
    load_optimizer: bool = True,
    allow_schedule_change: bool = False,
) -> dict:
    """Restore ``engine`` from a checkpoint (a collective) at ANY parallel layout and with
    either optimizer; returns the saved ``extra_state``. ``path``: a checkpoint directory or a
    root (its latest complete checkpoint).

    ``load_optimizer=True`` (resume): weights, optimizer state, schedule, step counters, and the
    RNG states when the layout is the one saved (RNG streams are per rank). False: weights only.
    The frozen KL reference model is not stored: it is rebuilt from the run's initial weights.
    """
    error, metadata = None, None
    try:
        path = resolve_checkpoint(path)
        metadata = read_checkpoint_metadata(path)
        _check_model(engine, metadata["model"])
        if load_optimizer:
            _check_schedule(engine, metadata["scheduler"], allow_schedule_change)
            if metadata["model"]["dtype"] != engine.cfg.model.dtype:
                raise CheckpointError(
                    f"the checkpoint was trained in {metadata['model']['dtype']}, this run is "
                    f"{engine.cfg.model.dtype}",
                    "its optimizer state (fp32 main weights) belongs to the other precision",
                    "resume in the checkpoint's model.dtype, or load weights only",
                )
    except Exception as caught:  # every rank must learn of it, or the others would hang
        error = caught
    _raise_if_any_rank_failed(error)

    request = _model_sharded_state(engine.model)
    targets: list = []
    same_layout = metadata["layout"] == _layout(engine)
    if load_optimizer:
        optimizer_request, targets = optimizer_load_request(
            engine.optimizer, request, metadata["optimizer"]
        )
        if optimizer_request:
            request["optimizer"] = optimizer_request
        if same_layout:
            request["rng_state"] = _rng_sharded(None)
    loaded = _load(request, path)
    _apply_model_state(engine.model, loaded)
    if not load_optimizer:
        engine.optimizer.reload_model_params()  # bf16: fp32 main weights from the new model
        logger.info("loaded weights of %s (optimizer state not loaded)", path)
        return metadata["extra_state"]
    if not metadata["optimizer"]["has_main_params"]:
        engine.optimizer.reload_model_params()
    apply_optimizer_state(
        engine.optimizer, targets, loaded.get("optimizer", {}), metadata["optimizer"]["step"]
    )
    scheduler = engine.scheduler
    scheduler.num_steps = 0  # load_state_dict ADDS the saved count to the current one
    scheduler.load_state_dict(
        {**scheduler.state_dict(), "num_steps": metadata["scheduler"]["num_steps"]}
        if allow_schedule_change
        else metadata["scheduler"]
    )
    counters = metadata["engine"]
    engine.step_count = counters["optimizer_steps"]
    engine.skipped_steps = counters["skipped_steps"]
    engine.consecutive_skips = counters["consecutive_skips"]
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    elif dist.get_rank() == 0:
        logger.warning(
            "RNG states not restored: saved at layout %s, loaded at %s",
            metadata["layout"],
            _layout(engine),
        )
    logger.info("resumed from %s (step %d)", path, metadata["step"])
    return metadata["extra_state"]
