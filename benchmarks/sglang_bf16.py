"""Is a real SGLang 0.5.23 CPU server in bfloat16 numerically a bf16 engine? Log-prob gaps to
transformers, from start-up weights and after each weight transport.

For each expert size (``--expert-sizes``, the CPU demo's model otherwise: Qwen3-MoE, 2 layers,
hidden 64, 8 experts top-2, vocab 16, ``init_std=0.2``) the tool exports seeded weights, starts
one server with ``--dtype bfloat16`` from the SGLang environment (``--sglang-venv`` or
``MEGATRON_GSPO_SGLANG_VENV``; ``SGLANG_CPU_DISABLE_AMX`` set to 0, so SGLang takes its AMX path
where the CPU has AMX and its plain-torch path elsewhere) with the project's launcher, and in
three phases samples ``--prompts`` prompts x ``--tokens`` tokens at temperature 1 with log-probs:

* ``startup``: the weights the server loaded at start;
* ``disk``: after new weights by the disk transport (``/update_weights_from_disk``, outside the
  ``/begin_weight_update`` bracket, as the client sends it);
* ``tensor``: after new weights by the tensor transport (shared memory, inside the bracket).

Each phase reports max / mean over the sampled tokens of |SGLang - transformers| log-prob for
transformers' bf16 forward (``vs_bf16``: the engine's own precision, what must be small), the
same on the tokens whose experts SGLang (its R3 routes) and transformers' bf16 forward chose alike
at every layer and every position up to the predicting one (``vs_bf16_same_routes``: bf16 flips
near-tied routers, and a flipped expert moves a token far more than rounding), its fp32 forward (``vs_fp32``: the training-inference mismatch a bf16 engine has) and its bf16
forward of the previous phase's weights (``vs_stale``: the scale of a wrong-weights gap), plus
transformers' own bf16-vs-fp32 gap on the same tokens (``bf16_vs_fp32``: the scale of bf16
rounding). The kernel path (``amx`` or ``plain-torch``) is SGLang's own ``cpu_has_amx_support()``
evaluated in its environment.

Usage (from the repository root; one server start is 15-60 s on 2 cores)::

    python benchmarks/sglang_bf16.py --sglang-venv /path/to/sglang-venv
    python benchmarks/sglang_bf16.py --expert-sizes 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.auth import new_api_key
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import forward_with_routes
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_cpu import (
    SGLANG_VENV_ENV,
    CpuKernelPath,
    cpu_server_args,
    cpu_server_env,
    probe_cpu_kernel_path,
    venv_python,
)
from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess, build_launch_command
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, sync_weights_paused
from megatron_gspo.weight_sync import (
    DiskTransport,
    TensorTransport,
    free_port,
    write_hf_checkpoint,
)

VENV_ENV = SGLANG_VENV_ENV
PROMPTS = [[1, 2, 3], [7, 7, 1, 0, 5], [4], [9, 8, 7, 6, 5, 4, 3], [3, 3], [0, 1, 2, 3, 4, 5]]
PHASES = (("startup", None, 0), ("disk", "disk", 1), ("tensor", "tensor", 2))
"""(phase, transport, weight seed): seed 0 is the exported start-up checkpoint."""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/sglang_bf16.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sglang-venv",
        default=os.environ.get(VENV_ENV),
        help=f"virtual environment with SGLang 0.5.23 for CPU (default: ${VENV_ENV}; built by "
        "the CPU kit's setup.sh VENV)",
    )
    parser.add_argument(
        "--expert-sizes",
        default="48,64",
        help="comma-separated moe_ffn_hidden_size values, one server each (48: the CPU demo, "
        "not packable by the AMX kernels; 64: packable)",
    )
    parser.add_argument("--tokens", type=int, default=12, help="sampled tokens per prompt")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="prompts per phase")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not args.sglang_venv:
        parser.error(f"give --sglang-venv or set {VENV_ENV}")
    if not venv_python(args.sglang_venv).exists():
        parser.error(f"{args.sglang_venv} has no bin/python")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    return args


def seeded_weights(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    engine = EmbeddedEngine(model, seed=seed)
    weights = {name: tensor.detach().clone() for name, tensor in engine.hf_state()}
    engine.close()
    return weights


def reference_models(directory: Path) -> dict[str, torch.nn.Module]:
    """transformers' forward of a checkpoint in float32 and in bfloat16."""
    import transformers

    return {
        dtype_name: transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=dtype
        ).eval()
        for dtype_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


def token_log_probs(
    model: torch.nn.Module, prompt: list[int], output: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs at temperature 1 of ``output`` after ``prompt`` (log-softmax in float32, as
    SGLang's logits processor takes it) and the routes ``[prompt + output - 1, layers, top-k]``
    of the forward (SGLang's R3 layout)."""
    tokens = list(prompt) + list(output)
    logits, routes = forward_with_routes(model, tokens[:-1])
    table = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(len(prompt) - 1, len(tokens) - 1)
    return table[rows, torch.tensor(output)], routes


def same_routes_so_far(
    ours: torch.Tensor, theirs: torch.Tensor, prompt_length: int
) -> torch.Tensor:
    """``[response]`` bool: every position up to the one that predicts each response token chose
    the same experts (as sets) in every MoE layer; a log-prob depends on all of them."""
    rows_differ = (ours.sort(-1).values != theirs.sort(-1).values).flatten(1).any(-1)
    differ_so_far = torch.cummax(rows_differ.int(), dim=0).values.bool()
    return ~differ_so_far[prompt_length - 1 :]


def gap(differences: list[torch.Tensor]) -> Optional[dict[str, float]]:
    joined = torch.cat(differences).abs()
    if not len(joined):
        return None
    return {"max": float(joined.max()), "mean": float(joined.mean())}


def measure_phase(client: SGLangEngine, references: dict, previous: dict, args) -> dict:
    results = client.generate(
        [
            GenerateRequest(
                prompt,
                max_new_tokens=args.tokens,
                temperature=1.0,
                seed=17 + index,
                return_routed_experts=True,
            )
            for index, prompt in enumerate(PROMPTS[: args.prompts])
        ]
    )
    columns: dict[str, list[torch.Tensor]] = {
        "vs_bf16": [],
        "vs_fp32": [],
        "vs_bf16_same_routes": [],
        "vs_stale": [],
        "bf16_vs_fp32": [],
    }
    for prompt, result in zip(PROMPTS, results):
        got = torch.from_numpy(result.output_log_probs).double()
        bf16, bf16_routes = token_log_probs(references["bf16"], prompt, result.output_ids)
        fp32, _ = token_log_probs(references["fp32"], prompt, result.output_ids)
        bf16, fp32 = bf16.double(), fp32.double()
        engine_routes = torch.from_numpy(result.routed_experts.astype("int64"))
        same = same_routes_so_far(engine_routes, bf16_routes, len(prompt))
        columns["vs_bf16"].append(got - bf16)
        columns["vs_bf16_same_routes"].append((got - bf16)[same])
        columns["vs_fp32"].append(got - fp32)
        columns["bf16_vs_fp32"].append(bf16 - fp32)
        if previous:
            stale, _ = token_log_probs(previous["bf16"], prompt, result.output_ids)
            columns["vs_stale"].append(got - stale.double())
    same_count = sum(len(d) for d in columns["vs_bf16_same_routes"])
    return {
        "tokens": sum(len(r.output_ids) for r in results),
        "tokens_same_routes": same_count,
        "weight_version": sorted({r.weight_version for r in results}),
        **{name: gap(values) for name, values in columns.items() if values},
    }


def measure_expert_size(python: str, expert_size: int, work: Path, args) -> dict:
    model = ModelConfig(init_std=0.2, moe_ffn_hidden_size=expert_size)
    config_json = hf_config_from_model_config(model).to_json_string()
    weights = {seed: seeded_weights(model, seed) for _, _, seed in PHASES}
    directories = {}
    for _, _, seed in PHASES:
        directories[seed] = work / f"expert{expert_size}_weights{seed}"
        write_hf_checkpoint(weights[seed].items(), str(directories[seed]), config_json=config_json)
    api_key = new_api_key()
    command = build_launch_command(
        str(directories[0]),
        port=free_port("127.0.0.1"),
        python_executable=python,
        api_key=api_key,
        enable_return_routed_experts=True,
        extra_args=cpu_server_args("bfloat16"),
    )
    server = SGLangServerProcess(
        command, str(work / f"server_expert{expert_size}.log"), env=cpu_server_env("bfloat16")
    )
    started = time.perf_counter()
    server.start()
    phases = {}
    try:
        server.wait_until_healthy(deadline_s=900)
        start_s = time.perf_counter() - started
        previous: dict = {}
        for phase, transport_name, seed in PHASES:
            transport = (
                DiskTransport(str(work / "disk"), config_json=config_json)
                if transport_name == "disk"
                else TensorTransport(bucket_bytes=200_000)
                if transport_name == "tensor"
                else None
            )
            client = SGLangEngine(
                [server.url],
                RouteLayout.from_model_config(model),
                weight_transport=transport,
                api_key=api_key,
                request_timeout_s=300,
            )
            try:
                if transport is not None:
                    sync_weights_paused(client, iter(weights[seed].items()), seed)
                references = reference_models(directories[seed])
                phases[phase] = measure_phase(client, references, previous, args)
            finally:
                client.close()
            previous = references
    finally:
        server.stop(timeout_s=60)
    return {"expert_size": expert_size, "server_start_s": start_s, "phases": phases}


def table(report: dict) -> str:
    lines = [
        f"SGLang CPU kernel path: {report['kernel_path']['describe']}",
        "",
        "| expert size | phase | vs transformers bf16 (max / mean) | same routes: tokens, vs "
        "bf16 | vs transformers fp32 | vs the previous weights (bf16) | transformers bf16 vs "
        "fp32 |",
        "|---:|---|---|---|---|---|---|",
    ]

    def cell(values: Optional[dict]) -> str:
        return f"{values['max']:.3g} / {values['mean']:.3g}" if values else "-"

    for run in report["runs"]:
        for phase, values in run["phases"].items():
            lines.append(
                f"| {run['expert_size']} | {phase} | {cell(values['vs_bf16'])} | "
                f"{values['tokens_same_routes']}/{values['tokens']}, "
                f"{cell(values.get('vs_bf16_same_routes'))} | {cell(values['vs_fp32'])} | {cell(values.get('vs_stale'))} | "
                f"{cell(values['bf16_vs_fp32'])} |"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    python = str(venv_python(args.sglang_venv))
    torch.manual_seed(0)
    path: CpuKernelPath = probe_cpu_kernel_path(python, "bfloat16")
    with tempfile.TemporaryDirectory(prefix="sglang_bf16_") as scratch:
        work = Path(args.out or scratch)
        work.mkdir(parents=True, exist_ok=True)
        runs = [
            measure_expert_size(python, int(size), work, args)
            for size in args.expert_sizes.split(",")
        ]
    report = {
        "kernel_path": {**path.__dict__, "name": path.name, "describe": path.describe()},
        "prompts": args.prompts,
        "tokens_per_prompt": args.tokens,
        "runs": runs,
    }
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
