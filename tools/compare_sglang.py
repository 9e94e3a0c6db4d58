"""``tools/compare_grpo_gspo.py --rollout-engine sglang``: the mismatch suite on a real SGLang
server in bfloat16, one launched per variant (``rollout.sglang.launch``) from SGLang's own
environment (``rollout.sglang.python``), started from exported initial weights and synced by
disk; on CPU with SGLang's CPU backend (``megatron_gspo.rollout.sglang_cpu``). Checks the
combination at start, every problem at once (docs/compare_grpo_gspo.md)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

SGLANG_VENV_ENV = "MEGATRON_GSPO_SGLANG_VENV"
"""``megatron_gspo.rollout.sglang_cpu.SGLANG_VENV_ENV``, spelled out so that ``--help`` imports
neither the package nor torch (tests/tools/test_compare_grpo_gspo.py checks they agree)."""
SGLANG_DTYPE = "bfloat16"
QUICK_SGLANG = ["model.moe_ffn_hidden_size=64"]
"""The CPU demo's expert size 48 is not a multiple of 32: on SGLang's AMX path its bracketed weight
updates are wrong (docs/sglang-protocol.md section 7); 64 packs on every path."""
SGLANG_MANAGED_KEYS = (
    "rollout.engine",
    "rollout.dtype",
    "rollout.sglang.urls",
    "rollout.sglang.launch",
    "rollout.sglang.python",
    "rollout.sglang.port",
    "rollout.sglang.return_routes",
)
"""Keys ``--rollout-engine sglang`` sets for every variant; overrides may not set them too."""


@dataclass
class SGLangMode:
    """``--rollout-engine sglang``: how every variant launches its SGLang server."""

    python: str
    device: str
    model_dir: str | None
    """The exported initial weights (None: the user's model.hf_path)."""
    kernel_path: str = ""
    """SGLang's CPU kernel path in words (``sglang_cpu.CpuKernelPath.describe``); '' on GPUs."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the runs (SGLang's CPU backend switches; the servers inherit it)."""

    def overrides(self, port: int) -> list[str]:
        from megatron_gspo.rollout.sglang_cpu import cpu_server_args

        server_args = ["--dtype", SGLANG_DTYPE]
        if self.device == "cpu":
            server_args = cpu_server_args(SGLANG_DTYPE)
        chosen = [
            "rollout.engine=sglang",
            "rollout.sglang.launch=true",
            f"rollout.sglang.python={self.python}",
            f"rollout.sglang.port={port}",
            "rollout.sglang.return_routes=true",
            # Disk updates leave the begin/end bracket: the weight update measured right on every
            # CPU path (docs/sglang-protocol.md section 7).
            "rollout.weight_transport=disk",
            "rollout.sglang.extra_args=[" + ",".join(server_args) + "]",
        ]
        if self.model_dir is not None:
            chosen.append(f"model.hf_path={self.model_dir}")
        return chosen

    def describe(self) -> str:
        where = f"CPU, {self.kernel_path}" if self.device == "cpu" else self.device
        return f"SGLang {SGLANG_DTYPE} ({where}), weights by disk"


def _override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def prepare_sglang(
    args: argparse.Namespace, overrides: list[str], run_overrides: list[str]
) -> tuple[SGLangMode | None, list]:
    """Check ``--rollout-engine sglang`` against the rest of the command (``overrides``: the
    user's; ``run_overrides``: every variant's before its own), every problem at once
    (``(None, problems)``), or export the initial weights and return the mode."""
    problems = []
    sglang_options = [
        name
        for name, value in (
            ("--sglang-python", args.sglang_python),
            ("--sglang-device", args.sglang_device),
        )
        if value is not None
    ]
    if args.rollout_engine != "sglang":
        if sglang_options:
            problems.append(
                f"{', '.join(sglang_options)} without --rollout-engine sglang: they choose the "
                "SGLang server of that mode; add --rollout-engine sglang or drop them"
            )
        return None, problems
    if args.suite != "mismatch":
        problems.append(
            f"--rollout-engine sglang with --suite {args.suite}: only the mismatch suite runs on "
            "a real SGLang server (the standard and async suites compare losses and schedules on "
            "the embedded fp32 engine); use --suite mismatch"
        )
    clashing = sorted({_override_key(o) for o in overrides} & set(SGLANG_MANAGED_KEYS))
    if clashing:
        problems.append(
            f"overrides set {', '.join(clashing)}, which --rollout-engine sglang sets for every "
            "variant (a bf16 SGLang server launched per run from --sglang-python); drop them"
        )
    from megatron_gspo.rollout.sglang_cpu import venv_python

    venv = os.environ.get(SGLANG_VENV_ENV)
    python = args.sglang_python or (str(venv_python(venv)) if venv else sys.executable)
    from megatron_gspo.rollout.sglang_engine import sglang_unavailable

    missing = sglang_unavailable(python)
    if missing:
        problems.append(
            f"--sglang-python {python} cannot start SGLang: {missing}; give the bin/python of "
            f"SGLang's environment (or set {SGLANG_VENV_ENV})"
        )
    if problems:
        return None, problems

    from megatron_gspo.config import ConfigError
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.trainer.setup import resolve_model

    try:
        # With the user's model.hf_path the shape comes from its config.json.
        cfg = resolve_model(load_config(args.preset, run_overrides))
    except ConfigError as error:
        return None, [str(error)]
    device = args.sglang_device or _default_device()
    mode = SGLangMode(python=python, device=device, model_dir=None)
    if device == "cpu":
        from megatron_gspo.rollout.sglang_cpu import (
            cpu_server_env,
            probe_cpu_kernel_path,
            unpackable_expert_weights,
        )

        try:
            path = probe_cpu_kernel_path(python, SGLANG_DTYPE)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
            return None, [f"SGLang's CPU kernel path could not be determined: {error}"]
        mode.kernel_path = path.describe()
        mode.env = cpu_server_env(SGLANG_DTYPE)
        unpackable = (
            unpackable_expert_weights(cfg.model.hidden_size, cfg.model.moe_ffn_hidden_size)
            if cfg.model.is_moe
            else []
        )
        if path.amx and unpackable:
            return None, [
                f"model.moe_ffn_hidden_size={cfg.model.moe_ffn_hidden_size} on SGLang's AMX CPU "
                f"path ({mode.kernel_path}): the kernels pack w13 but not "
                f"{', '.join(unpackable)}, and SGLang then computes with a packed weight it "
                "reads as plain (wrong log-probs after a weight update, docs/sglang-protocol.md "
                "section 7); use an expert size that is a multiple of 32 (--quick uses 64)"
            ]
    if cfg.model.hf_path is None:
        mode.model_dir = str(export_initial_model(cfg, Path(args.out) / "initial_model"))
    return mode, []


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def export_initial_model(cfg, directory: Path) -> Path:
    """The run's seeded initial weights as a Hugging Face directory: every variant's trainer and
    server start from it (the servers need a model directory to start)."""
    from megatron_gspo.convert.hf_config import hf_config_from_model_config
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.weight_sync import write_hf_checkpoint

    engine = EmbeddedEngine(cfg.model, seed=cfg.seed)
    try:
        write_hf_checkpoint(
            engine.hf_state(),
            str(directory),
            config_json=hf_config_from_model_config(cfg.model).to_json_string(),
        )
    finally:
        engine.close()
    return directory
