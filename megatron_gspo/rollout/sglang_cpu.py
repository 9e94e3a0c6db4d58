"""SGLang 0.5.23 on CPU: the flags and environment its CPU backend needs, and which kernels run.

SGLang's CPU backend has two paths, chosen once per process by ``cpu_has_amx_support()``
(``sglang.srt.utils.common``): the CPU has AMX tiles (``torch.cpu._is_amx_tile_supported()``:
Intel Xeon since Sapphire Rapids) and the ``sgl_kernel`` CPU build is importable and not disabled
(``SGLANG_CPU_DISABLE_AMX=1``, a switch of the CPU kit's patch). On the **AMX path** every linear
and expert weight that fits the kernels' tiles is packed into a blocked layout after loading, and
rmsnorm, rotary, top-k and the fused experts run in ``sgl_kernel``; those kernels are bf16 only.
Otherwise (``SGLANG_CPU_DISABLE_AMX=1``, or a CPU without AMX such as AMD Zen 4, even with
``avx512_bf16``) the **plain-torch path** runs every layer as ordinary torch operations in the
server's ``--dtype``, float32 or bfloat16, and packs nothing.

On the AMX path a fused-MoE layer packs its weights one by one and stops at the first one the
kernels cannot take (output size not a multiple of 16, input size not a multiple of 32), leaving
the packed ones packed while it computes as if none were: with an expert size that is not a
multiple of 32 a weight update inside the ``/begin_weight_update`` bracket gives wrong log-probs
(docs/sglang-protocol.md section 7). :func:`unpackable_expert_weights` names such shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

SGLANG_VENV_ENV = "MEGATRON_GSPO_SGLANG_VENV"
"""Environment variable naming SGLang's own virtual environment (the CPU kit's ``setup.sh VENV``
builds one; ``.ci/run`` sets it): the real-server tests, ``benchmarks/sglang_bf16.py`` and the
compare tool's SGLang mode find SGLang through it."""


def venv_python(venv: Union[str, os.PathLike]) -> Path:
    """The interpreter of the virtual environment ``venv``."""
    return Path(venv) / "bin" / "python"


CPU_SERVER_ARGS = (
    "--device",
    "cpu",
    # The CPU backend's kernels: plain-torch attention and sampling; no CUDA graphs or grammar.
    # (`--attention-backend intel_amx` fails with the CPU kernel build of the kit: version skew.)
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--grammar-backend",
    "none",
    "--disable-cuda-graph",
    "--skip-server-warmup",
    # Without a cap SGLang sizes the KV cache from the machine's whole memory.
    "--max-total-tokens",
    "8192",
    "--max-running-requests",
    "64",
    # An idle scheduler otherwise spins one core at 90%.
    "--sleep-on-idle",
)
"""ServerArgs every CPU server needs (``--dtype`` comes from :func:`cpu_server_args`)."""

CPU_DTYPES = ("float32", "bfloat16")

TILE_OUTPUT = 16
TILE_INPUT = 32
"""The AMX gemm's tile sizes: a weight packs when its output size is a multiple of 16 and its
input size a multiple of 32 (``sglang.srt.layers.amx_utils.dim_is_supported``)."""


def cpu_server_args(dtype: str) -> list[str]:
    """:data:`CPU_SERVER_ARGS` with ``--dtype dtype`` (float32 or bfloat16)."""
    if dtype not in CPU_DTYPES:
        raise ValueError(f"SGLang's CPU backend runs {' or '.join(CPU_DTYPES)}, not {dtype!r}")
    return ["--dtype", dtype, *CPU_SERVER_ARGS]


def cpu_server_env(dtype: str) -> dict[str, str]:
    """Environment of a CPU server. float32 needs the plain-torch path (the AMX kernels are bf16
    only: ``SGLANG_CPU_DISABLE_AMX=1``); bfloat16 leaves the choice to SGLang (the AMX path where
    the CPU has it), with the switch set to 0 so an inherited 1 cannot force the plain path."""
    if dtype not in CPU_DTYPES:
        raise ValueError(f"SGLang's CPU backend runs {' or '.join(CPU_DTYPES)}, not {dtype!r}")
    return {
        "SGLANG_USE_CPU_ENGINE": "1",  # else is_cpu() is False and SGLang takes CUDA paths
        "SGLANG_CPU_DISABLE_AMX": "1" if dtype == "float32" else "0",
        "SGLANG_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}",
    }


_PROBE = """
import json, torch
from sglang.srt.utils import common
print(json.dumps({
    "amx_tiles": bool(common.is_amx_tile_supported),
    "amx_kernels": bool(common._is_intel_amx_backend_available()),
    "amx": bool(common.cpu_has_amx_support()),
    "cpu_capability": torch.backends.cpu.get_cpu_capability(),
}))
"""


@dataclass(frozen=True)
class CpuKernelPath:
    """Which of SGLang's CPU paths a server started with the same interpreter and environment
    takes (SGLang's own predicate, evaluated in its environment)."""

    amx: bool
    """True: the AMX path (weights packed, ``sgl_kernel`` ops); False: plain torch."""
    amx_tiles: bool
    """The CPU has AMX tiles (``torch.cpu._is_amx_tile_supported()``)."""
    amx_kernels: bool
    """``sgl_kernel``'s CPU ops are importable and ``SGLANG_CPU_DISABLE_AMX`` is not 1."""
    cpu_capability: str
    """torch's vector ISA on this CPU (AVX512, AVX2, ...)."""
    cpu_model: str
    """The CPU's model name (/proc/cpuinfo)."""

    @property
    def name(self) -> str:
        return "amx" if self.amx else "plain-torch"

    def describe(self) -> str:
        why = (
            "weights packed, sgl_kernel ops"
            if self.amx
            else "no AMX tiles on this CPU"
            if not self.amx_tiles
            else "SGLANG_CPU_DISABLE_AMX=1 or no sgl_kernel"
        )
        return f"{self.name} ({why}; {self.cpu_model}, torch {self.cpu_capability})"


def probe_cpu_kernel_path(python: str, dtype: str, timeout_s: float = 300.0) -> CpuKernelPath:
    """Evaluate SGLang's ``cpu_has_amx_support()`` with ``python`` (the SGLang environment's
    interpreter) under :func:`cpu_server_env` ``(dtype)``: the path its CPU server takes."""
    env = {**os.environ, **cpu_server_env(dtype)}
    result = subprocess.run(
        [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if result.returncode:
        raise RuntimeError(
            f"{python} could not import sglang to probe its CPU path:\n{result.stderr[-2000:]}"
        )
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return CpuKernelPath(cpu_model=cpu_model_name(), **found)


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def unpackable_expert_weights(hidden_size: int, moe_ffn_hidden_size: int) -> list[str]:
    """The expert weights of a fused-MoE layer the AMX kernels cannot pack, when another one of
    the layer can: the mixed case whose bracketed weight updates are wrong. Empty when the layer
    packs whole (or not at all)."""
    weights = {
        # [2 * expert size, hidden] (gate and up fused), then [hidden, expert size]
        "w13 (gate_up_proj)": (2 * moe_ffn_hidden_size, hidden_size),
        "w2 (down_proj)": (hidden_size, moe_ffn_hidden_size),
    }
    packable = {
        name: rows % TILE_OUTPUT == 0 and columns % TILE_INPUT == 0
        for name, (rows, columns) in weights.items()
    }
    if all(packable.values()) or not packable["w13 (gate_up_proj)"]:
        # The layer packs in order (w13 first) and stops at the first failure.
        return []
    return [
        f"{name} {rows}x{columns}"
        for name, (rows, columns) in weights.items()
        if not packable[name]
    ]
