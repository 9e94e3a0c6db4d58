"""Prefix-cache hit rate of multi-turn sessions on two real SGLang 0.5.23 CPU servers: sticky
sessions against a round-robin baseline, and the weight-version cache salt across a weight sync.

The tool exports the CPU demo's model (Qwen3-MoE, 2 layers, hidden 64, 8 experts top-2, vocab 16,
``init_std=0.2``, seeded random weights), starts two float32 servers from the SGLang environment
(``--sglang-venv`` or ``MEGATRON_GSPO_SGLANG_VENV``) with the project's launcher, and runs
``--sessions`` episodes of ``--turns`` turns concurrently, one thread per session. Turn 0 sends a
prompt of ``--prompt-tokens`` tokens (session ``s`` starts with token ``s``, so no two sessions
share a prefix); turn ``t`` sends the previous turn's input and output plus ``--appended-tokens``
new tokens (a tool result), as the agent endpoint does; every turn samples ``--turn-tokens``
tokens with a per-(session, turn) seed, so that every phase sees the same tokens. A request's
hit is SGLang's ``meta_info.cached_tokens``: the prompt tokens its radix cache already held.

Phases (the caches of both servers are flushed before each):

* ``sticky``: one :class:`SGLangEngine` over both servers, requests carry the session id, so a
  session's turns go to the server that holds its prefix (least loaded for its first turn);
* ``round_robin``: the baseline without session affinity: turn ``t`` of session ``s`` goes to
  server ``(s + t) mod 2``, so each turn lands on the server that did not see the previous one;
* ``version_salted``: sticky; after turn ``--sync-after-turn`` a weight sync to version 1 (new
  seeded weights, disk transport) with the requests paused ``in_place``, which flushes no cache
  (``sync_weights_paused``), so only the ``extra_key`` salt (``weights-v<version>``) keeps
  version-1 requests off version-0 KV: the first turn after the sync must hit 0 tokens;
* ``version_unsalted``: the same with one constant salt for every version (the control): the
  first turn after the sync reuses the old version's KV.

Usage (from the repository root; the two server starts take 15-120 s on 2 cores)::

    python benchmarks/prefix_cache_hits.py
    python benchmarks/prefix_cache_hits.py --sessions 4 --turns 4 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.auth import new_api_key
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_cpu import (
    SGLANG_VENV_ENV,
    cpu_model_name,
    cpu_server_args,
    cpu_server_env,
    venv_python,
)
from megatron_gspo.rollout.sglang_launcher import SGLangServerProcess, build_launch_command
from megatron_gspo.rollout.types import GenerateRequest, derive_seed, sync_weights_paused
from megatron_gspo.weight_sync import DiskTransport, free_port, write_hf_checkpoint

PHASES = ("sticky", "round_robin", "version_salted", "version_unsalted")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--sglang-venv",
        default=os.environ.get(SGLANG_VENV_ENV),
        help=f"virtual environment with SGLang 0.5.23 for CPU (default: ${SGLANG_VENV_ENV})",
    )
    parser.add_argument("--sessions", type=int, default=8, help="concurrent sessions (<= 16)")
    parser.add_argument("--turns", type=int, default=4, help="model turns per session")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens of turn 0's prompt")
    parser.add_argument("--turn-tokens", type=int, default=16, help="tokens sampled per turn")
    parser.add_argument(
        "--appended-tokens", type=int, default=16, help="tokens appended before each later turn"
    )
    parser.add_argument(
        "--sync-after-turn",
        type=int,
        default=None,
        help="the version phases sync weights after this turn (default: turns // 2 - 1)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    if not args.sglang_venv:
        parser.error(f"--sglang-venv or ${SGLANG_VENV_ENV} must name the SGLang environment")
    if not 1 <= args.sessions <= 16:
        parser.error("--sessions must be 1..16 (session s starts with token s; vocabulary 16)")
    if args.turns < 2:
        parser.error("--turns must be at least 2")
    if args.sync_after_turn is None:
        args.sync_after_turn = max(args.turns // 2 - 1, 0)
    if not 0 <= args.sync_after_turn < args.turns - 1:
        parser.error("--sync-after-turn must leave at least one turn after the sync")
    return args


class UnsaltedEngine(SGLangEngine):
    """The control of the version phases: one prefix-cache namespace for every weight version."""

    @property
    def cache_salt(self) -> str:
        return "weights-any"


def seeded_weights(model: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    engine = EmbeddedEngine(model, seed=seed)
    try:
        return {name: tensor.clone() for name, tensor in engine.hf_state()}
    finally:
        engine.close()


def start_servers(python: str, model_dir: Path, work: Path, count: int = 2) -> tuple[list, str]:
    """``count`` float32 servers of ``model_dir``, started together; (processes, API key)."""
    api_key = new_api_key()
    processes = []
    for index in range(count):
        command = build_launch_command(
            str(model_dir),
            port=free_port("127.0.0.1"),
            python_executable=python,
            api_key=api_key,
            skip_tokenizer_init=True,
            extra_args=cpu_server_args("float32"),
        )
        log = str(work / f"server{index}.log")
        processes.append(SGLangServerProcess(command, log, env=cpu_server_env("float32")).start())
    try:
        for process in processes:
            process.wait_until_healthy(deadline_s=900)
    except BaseException:
        for process in processes:
            process.stop(timeout_s=60)
        raise
    return processes, api_key


def session_prompt(session: int, length: int, seed: int) -> list[int]:
    """Token ``session`` first (no two sessions share a prefix), then seeded random tokens."""
    generator = torch.Generator().manual_seed(seed * 1000 + session)
    rest = torch.randint(0, 16, (length - 1,), generator=generator).tolist()
    return [session, *rest]


def run_session(
    session: int,
    args: argparse.Namespace,
    engine_for_turn: Any,
    between_turns: Any = None,
) -> list[dict[str, Any]]:
    """One episode: the cached and input tokens of each turn. ``engine_for_turn(session, turn)``
    is the engine of that turn's request; ``between_turns(session, turn)`` runs after a turn."""
    context = session_prompt(session, args.prompt_tokens, args.seed)
    turns = []
    for turn in range(args.turns):
        request = GenerateRequest(
            input_ids=list(context),
            max_new_tokens=args.turn_tokens,
            seed=derive_seed(args.seed * 1000 + session, turn),
            return_logprob=False,
            session_id=f"session-{session}",
        )
        engine, sticky = engine_for_turn(session, turn)
        if not sticky:
            request = dataclasses.replace(request, session_id=None)
        (result,) = engine.generate([request])
        turns.append(
            {
                "turn": turn,
                "input_tokens": len(context),
                "cached_tokens": result.cached_tokens,
                "weight_version": result.weight_version,
                "server": engine.session_server(request.session_id) if sticky else engine.urls[0],
            }
        )
        generator = torch.Generator().manual_seed(derive_seed(args.seed * 1000 + session, turn))
        appended = torch.randint(0, 16, (args.appended_tokens,), generator=generator).tolist()
        context = context + list(result.output_ids) + appended
        if between_turns is not None:
            between_turns(session, turn)
    return turns


def run_phase(
    args: argparse.Namespace, engine_for_turn: Any, between_turns: Any = None
) -> list[list[dict[str, Any]]]:
    with ThreadPoolExecutor(max_workers=args.sessions) as pool:
        futures = [
            pool.submit(run_session, session, args, engine_for_turn, between_turns)
            for session in range(args.sessions)
        ]
        return [future.result() for future in futures]


def summarise(sessions: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Hit rate over every request and over turns >= 1 (turn 0 cannot hit: nothing shares its
    prefix), and the mean cached tokens per turn."""
    turns = [turn for session in sessions for turn in session]
    later = [turn for turn in turns if turn["turn"] >= 1]
    per_turn = {}
    for index in range(len(sessions[0])):
        at = [session[index] for session in sessions]
        per_turn[index] = {
            "cached_mean": sum(t["cached_tokens"] for t in at) / len(at),
            "cached_min": min(t["cached_tokens"] for t in at),
            "cached_max": max(t["cached_tokens"] for t in at),
            "input_mean": sum(t["input_tokens"] for t in at) / len(at),
            "weight_versions": sorted({t["weight_version"] for t in at}),
        }
    servers = sorted({turn["server"] for turn in turns})
    return {
        "sessions_per_server": [
            sum(session[0]["server"] == server for session in sessions) for server in servers
        ],
        "sessions_changing_server": sum(
            len({turn["server"] for turn in session}) > 1 for session in sessions
        ),
        "requests": len(turns),
        "input_tokens": sum(t["input_tokens"] for t in turns),
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "hit_rate": sum(t["cached_tokens"] for t in turns) / sum(t["input_tokens"] for t in turns),
        "hit_rate_after_turn0": sum(t["cached_tokens"] for t in later)
        / sum(t["input_tokens"] for t in later),
        "per_turn": per_turn,
    }


def version_phase(
    engine: SGLangEngine, args: argparse.Namespace, weights: dict[str, torch.Tensor]
) -> list[list[dict[str, Any]]]:
    """Sticky sessions; once every session finished turn ``sync_after_turn``, one weight sync
    to version 1, paused in place (no cache flush), before any session's next turn."""
    barrier = threading.Barrier(args.sessions, action=lambda: sync(engine, weights))

    def between_turns(session: int, turn: int) -> None:
        if turn == args.sync_after_turn:
            barrier.wait(timeout=600)

    return run_phase(args, lambda session, turn: (engine, True), between_turns)


def sync(engine: SGLangEngine, weights: dict[str, torch.Tensor]) -> None:
    version = engine.weight_version + 1
    sync_weights_paused(engine, iter(weights.items()), version, pause_mode="in_place")


def measure(args: argparse.Namespace, python: str, work: Path) -> dict[str, Any]:
    model = ModelConfig(init_std=0.2)
    config_json = hf_config_from_model_config(model).to_json_string()
    model_dir = work / "model"
    write_hf_checkpoint(seeded_weights(model, 0).items(), str(model_dir), config_json=config_json)
    new_weights = seeded_weights(model, 1)
    started = time.perf_counter()
    processes, api_key = start_servers(python, model_dir, work)
    start_s = time.perf_counter() - started
    urls = [process.url for process in processes]
    options = {"api_key": api_key, "request_timeout_s": 600}
    phases: dict[str, Any] = {}
    try:
        sticky = SGLangEngine(urls, **options)
        singles = [SGLangEngine([url], **options) for url in urls]
        try:
            sticky.flush_cache()
            phases["sticky"] = run_phase(args, lambda session, turn: (sticky, True))
            sticky.flush_cache()
            phases["round_robin"] = run_phase(
                args, lambda session, turn: (singles[(session + turn) % len(singles)], False)
            )
        finally:
            for engine in [sticky, *singles]:
                engine.close()
        for phase, engine_class in (
            ("version_salted", SGLangEngine),
            ("version_unsalted", UnsaltedEngine),
        ):
            transport = DiskTransport(str(work / f"weights_{phase}"), config_json=config_json)
            engine = engine_class(urls, weight_transport=transport, **options)
            try:
                # Back to version 0's weights with an empty cache.
                engine.post_all(
                    "/update_weights_from_disk",
                    {"model_path": str(model_dir), "weight_version": "0", "flush_cache": True},
                )
                phases[phase] = version_phase(engine, args, new_weights)
            finally:
                engine.close()
    finally:
        for process in processes:
            process.stop(timeout_s=60)
    return {
        "server_start_s": round(start_s, 1),
        "phases": {name: summarise(sessions) for name, sessions in phases.items()},
        "raw": phases,
    }


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(
        line.split(":", 1) for line in lscpu.splitlines() if ":" in line
    )  # "Model name:   Intel(R) Xeon(R) ..."
    return {
        "cpu": fields.get("Model name", cpu_model_name()).strip(),
        "cpus": (fields.get("CPU(s)") or str(os.cpu_count())).strip(),
        "python": platform.python_version(),
    }


def table(report: dict[str, Any]) -> str:
    setting = report["settings"]
    lines = [
        f"{report['machine']['cpu']}, {report['machine']['cpus']} CPUs, load average "
        f"{report['load_before'][0]:.1f} before / {report['load_after'][0]:.1f} after; "
        f"{setting['sessions']} sessions x {setting['turns']} turns, prompt "
        f"{setting['prompt_tokens']}, {setting['turn_tokens']} sampled + "
        f"{setting['appended_tokens']} appended tokens per turn; servers up in "
        f"{report['server_start_s']} s",
        "",
        "| phase | sessions per server | requests | input tokens | cached tokens | hit rate | "
        "hit rate, turns >= 1 | cached tokens per turn (mean) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, phase in report["phases"].items():
        per_turn = ", ".join(
            f"{values['cached_mean']:.1f}" + (" (v1)" if values["weight_versions"] == [1] else "")
            for values in phase["per_turn"].values()
        )
        lines.append(
            f"| {name} | {' + '.join(map(str, phase['sessions_per_server']))} | "
            f"{phase['requests']} | {phase['input_tokens']} | "
            f"{phase['cached_tokens']} | {phase['hit_rate']:.3f} | "
            f"{phase['hit_rate_after_turn0']:.3f} | {per_turn} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    python = str(venv_python(args.sglang_venv))
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="prefix_cache_hits_") as scratch:
        result = measure(args, python, Path(scratch))
    settings = {
        key: getattr(args, key)
        for key in (
            "sessions",
            "turns",
            "prompt_tokens",
            "turn_tokens",
            "appended_tokens",
            "sync_after_turn",
            "seed",
        )
    }
    report = {
        "machine": machine(),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "settings": settings,
        **result,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
