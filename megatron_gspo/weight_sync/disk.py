"""The ``disk`` weight transport: safetensors shards + ``config.json`` in a fresh directory, then
``/update_weights_from_disk``. Works with any server the trainer shares a filesystem with (SGLang,
the embedded engine's loopback server)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from megatron_gspo.weight_sync.transport import (
    SyncStats,
    WeightTransport,
    WeightUpdateClient,
    tensor_bytes,
)


def write_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    directory: str,
    *,
    shard_bytes: int = 5 << 30,
    config_source_dir: Optional[str] = None,
    config_json: Optional[str] = None,
) -> tuple[int, int]:
    """Write an HF checkpoint directory: ``model-0000i-of-0000N.safetensors`` shards, the
    ``model.safetensors.index.json`` map and ``config.json``; returns ``(tensors, bytes)``.

    ``config.json`` (and ``generation_config.json``) are copied from ``config_source_dir`` when
    given (keeps every key the original model had), else written from ``config_json``. Shards are
    streamed: one shard of tensors is in host memory at a time.
    """
    os.makedirs(directory, exist_ok=True)
    weight_map: dict[str, str] = {}
    temporary_files: list[str] = []
    num_tensors = num_bytes = 0
    shard: dict[str, torch.Tensor] = {}
    shard_size = 0

    def flush_shard() -> None:
        nonlocal shard, shard_size
        if not shard:
            return
        file_name = f"shard-{len(temporary_files):05d}.tmp"
        path = os.path.join(directory, file_name)
        save_file(shard, path, metadata={"format": "pt"})
        # safetensors creates its files 0600; a checkpoint is read by other users (a server
        # in a container, a colleague), so it gets the mode any file of this process gets.
        os.chmod(path, 0o666 & ~_process_umask())
        temporary_files.append(file_name)
        weight_map.update(dict.fromkeys(shard, file_name))
        shard, shard_size = {}, 0

    for name, tensor in named_tensors:
        if name in weight_map or name in shard:
            raise ValueError(f"write_hf_checkpoint: tensor {name!r} given twice")
        # A copy: views of packed parameters share storage, which safetensors refuses.
        host = tensor.detach().to("cpu", copy=True).contiguous()
        if shard and shard_size + tensor_bytes(host) > shard_bytes:
            flush_shard()
        shard[name] = host
        shard_size += tensor_bytes(host)
        num_tensors += 1
        num_bytes += tensor_bytes(host)
    flush_shard()
    if not temporary_files:
        raise ValueError("write_hf_checkpoint: no tensors to write")
    total = len(temporary_files)
    final_names = {
        temp: f"model-{index + 1:05d}-of-{total:05d}.safetensors"
        for index, temp in enumerate(temporary_files)
    }
    for temp, final in final_names.items():
        os.replace(os.path.join(directory, temp), os.path.join(directory, final))
    index = {
        "metadata": {"total_size": num_bytes},
        "weight_map": {name: final_names[temp] for name, temp in sorted(weight_map.items())},
    }
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    if config_source_dir is not None:
        for file_name in ("config.json", "generation_config.json"):
            source = os.path.join(config_source_dir, file_name)
            if os.path.exists(source):
                shutil.copy(source, os.path.join(directory, file_name))
    elif config_json is not None:
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
            f.write(config_json)
    return num_tensors, num_bytes


class DiskTransport(WeightTransport):
    """Write safetensors under ``directory/weights_v{version}`` and ``/update_weights_from_disk``.

    The servers must see ``directory`` (same machine or a shared filesystem). Older version
    directories beyond ``keep_last`` are deleted after a successful update.
    """

    name = "disk"
    needs_bracket = False  # /update_weights_from_disk post-processes the weights itself

    def __init__(
        self,
        directory: Optional[str] = None,
        *,
        config_source_dir: Optional[str] = None,
        config_json: Optional[str] = None,
        shard_bytes: int = 5 << 30,
        keep_last: int = 1,
    ):
        self.directory = directory or tempfile.mkdtemp(prefix="megatron_gspo_weights_")
        self.config_source_dir = config_source_dir
        self.config_json = config_json
        self.shard_bytes = shard_bytes
        self.keep_last = keep_last
        self._written: list[str] = []
        self._latest: Optional[tuple[str, int, int, int]] = None
        """``(directory, version, tensors, bytes)`` of the newest weights written, loaded or not
        (what :meth:`resend` sends to a restarted server)."""

    def sync(
        self, client: WeightUpdateClient, named_tensors: Iterator[tuple[str, Any]], version: int
    ) -> SyncStats:
        start = time.perf_counter()
        path = os.path.join(self.directory, f"weights_v{version:08d}")
        if os.path.exists(path):
            shutil.rmtree(path)
        num_tensors, num_bytes = write_hf_checkpoint(
            named_tensors,
            path,
            shard_bytes=self.shard_bytes,
            config_source_dir=self.config_source_dir,
            config_json=self.config_json,
        )
        self._latest = (path, version, num_tensors, num_bytes)
        return self._load(client, start)

    def resend(self, client: WeightUpdateClient) -> Optional[SyncStats]:
        if self._latest is None:
            return None
        return self._load(client, time.perf_counter())

    @property
    def latest_version(self) -> Optional[int]:
        return None if self._latest is None else self._latest[1]

    def _load(self, client: WeightUpdateClient, start: float) -> SyncStats:
        path, version, num_tensors, num_bytes = self._latest
        client.post_all(
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": getattr(client, "flushes_on_update", True),
                "abort_all_requests": False,
            },
            timeout=client.request_timeout_s,
        )
        if path not in self._written:
            self._written.append(path)
        while len(self._written) > self.keep_last:
            shutil.rmtree(self._written.pop(0), ignore_errors=True)
        return SyncStats(version, num_tensors, num_bytes, time.perf_counter() - start)


def _process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` can only be read by setting
    it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022
