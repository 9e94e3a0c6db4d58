"""tools/convert_checkpoint.py on a damaged checkpoint names the damaged files and the intact
older step to convert instead, as the trainer's resume does (no bare ``EOFError``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

REPO_ROOT = Path(__file__).resolve().parents[2]


def save_step(root: Path, step: int) -> Path:
    """A complete torch_dist checkpoint folder as the trainer publishes it (tensors, the
    completion marker, Megatron's metadata.json), written by PyTorch's own writer."""
    folder = root / f"step_{step:06d}"
    dcp.save({"weight": torch.arange(4096, dtype=torch.float32)}, checkpoint_id=str(folder))
    torch.save({}, folder / "common.pt")
    (folder / "metadata.json").write_text("{}")
    (folder / "checkpoint.json").write_text(json.dumps({"step": step}))
    (root / "latest").write_text(folder.name + "\n")
    return folder


def test_a_truncated_checkpoint_names_its_file_and_the_intact_step(tmp_path):
    root = tmp_path / "checkpoints"
    older = save_step(root, 1)
    newer = save_step(root, 2)
    [shard] = sorted(newer.glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    result = subprocess.run(
        [sys.executable, "tools/convert_checkpoint.py", "megatron-to-hf", "--ckpt", str(root)]
        + ["--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    assert f"checkpoint {newer} is damaged: {shard}" in result.stderr
    assert "(truncated)" in result.stderr and f"--ckpt {older}" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "hf").exists()
