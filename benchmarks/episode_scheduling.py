"""Multi-turn episodes, lockstep against independent turn scheduling (``env.turn_scheduling``).

The run's environment producer (``production/episodes.py``) with the embedded engine and the
CPU demo's model over the multiply task's vocabulary, on a tool environment whose every model
turn is a tool call: a Python program run by :func:`megatron_gspo.envs.tools.run_tool` (a child
process, as the tool environments' calls; ``isolation=none``: the program is ours) that sleeps
a random 0-200 ms, drawn from the turn's own tokens (so both schedules wait as long for the same
turn), and prints a number, which comes back as the observation. A turn ends at any digit
(``--turn-tokens`` at most), the episode after ``--turns`` turns: every episode has that many
turns and tool calls whatever the untrained model writes.

``lockstep`` makes one engine call per turn index and waits for every tool call of the turn;
``independent`` sends each trajectory's next turn as soon as its own tool call returned, with
whatever else is ready. Both run the same calls (the same prompts and seeds), interleaved round
by round (``lockstep independent lockstep ...``) so that a shared machine's load falls on both
alike. Per schedule, medians over rounds: the wall time of one ``produce`` call (all episodes
of the batch, start to scored samples), the time in engine calls (``time/rollout_s``), the time
the producer waited for tools with nothing to generate (``time/env_s``), the engine calls and
the requests per call.

Usage (from the repository root)::

    python benchmarks/episode_scheduling.py                  # 16 prompts x 4 episodes, 5 rounds
    python benchmarks/episode_scheduling.py --quick          # 8 x 4, 2 rounds
    python benchmarks/episode_scheduling.py --tool sleep     # the latency without processes
    python benchmarks/episode_scheduling.py --workers 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_gspo.config import TrainConfig, from_dict  # noqa: E402
from megatron_gspo.data.tokenizer import TOOL_TOKENS  # noqa: E402
from megatron_gspo.envs import Environment, EnvStart, EnvStep, Turn  # noqa: E402
from megatron_gspo.envs.tools import ToolResult, run_tool, tool_limits  # noqa: E402
from megatron_gspo.production.episodes import EnvironmentProducer, EpisodeSettings  # noqa: E402
from megatron_gspo.production.sampling import Sampling  # noqa: E402
from megatron_gspo.production.task import build_task  # noqa: E402
from megatron_gspo.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_gspo.rollout.sglang_cpu import cpu_model_name  # noqa: E402

SCHEDULES = ("lockstep", "independent")
SLEEPING_TOOL = r"""
import sys
import time

time.sleep(float(sys.stdin.read()))
print(4321)
"""
"""The tool: sleeps the seconds it reads, then answers."""
MAX_TOOL_SLEEP_S = 0.2


class SleepingToolEnvironment(Environment):
    """Every model turn (ended by a digit) is a call of :data:`SLEEPING_TOOL`, which sleeps
    0 to 0.2 s (uniform, seeded by the prompt, the turn's tokens and its index); the observation
    is ``<result> 4 3 2 1 </result>``; the episode ends after ``turns`` turns. ``in_process``:
    sleep in the environment's thread instead of running the program."""

    def __init__(self, *, tokenizer: Any = None, turns: int = 3, in_process: bool = False):
        del tokenizer  # the multiply task's token ids are fixed
        self.turns, self.in_process = turns, in_process
        self.limits = tool_limits(
            tool_timeout_s=5.0, tool_memory_mb=256, isolation="none", key="benchmark"
        )
        self.prompt_ids: tuple[int, ...] = ()

    def reset(self, prompt: Any) -> EnvStart:
        self.prompt_ids = tuple(prompt.prompt_ids)
        return EnvStart(context_ids=list(prompt.prompt_ids), stop_token_ids=list(range(10)))

    def step(self, turn: Turn) -> EnvStep:
        # hash() of a tuple of ints is the same in every process (no string hashing).
        seed = hash((self.prompt_ids, tuple(int(t) for t in turn.token_ids), turn.index))
        delay = random.Random(seed).uniform(0.0, MAX_TOOL_SLEEP_S)
        if self.in_process:  # the latency alone, without a child process's start
            time.sleep(delay)
            result = ToolResult("ok", "4321")
        else:
            result = run_tool(SLEEPING_TOOL, stdin=f"{delay:.4f}", limits=self.limits)
        digits = [int(c) for c in result.output.strip() if c.isdigit()]
        return EnvStep(
            observation_ids=[TOOL_TOKENS["<result>"], *digits, TOOL_TOKENS["</result>"]],
            done=turn.index + 1 >= self.turns,
            tool_calls=1,
            tool_failures=int(result.failed),
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="benchmarks/episode_scheduling.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prompts", type=int, default=16, help="prompts per produce call")
    parser.add_argument("--group", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--turns", type=int, default=3, help="model turns (tool calls) per episode")
    parser.add_argument("--turn-tokens", type=int, default=8, help="env.max_tokens_per_turn")
    parser.add_argument(
        "--workers", type=int, default=16, help="env.num_workers: tool calls at the same time"
    )
    parser.add_argument("--rounds", type=int, default=5, help="produce calls per schedule")
    parser.add_argument(
        "--tool",
        choices=("process", "sleep"),
        default="process",
        help="process: the tool program in a child process (run_tool); sleep: the same latency "
        "slept in the environment's thread (no process start)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="8 prompts, 2 rounds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.rounds = 8, 2
    return args


def config(args: argparse.Namespace, schedule: str) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "data": {"task": "multiply"},
            "model": {"vocab_size": 24},
            "algo": {
                "rollout_batch_size": args.prompts,
                "num_return_sequences_in_group": args.group,
                "response_length": args.turns * (args.turn_tokens + 6),
            },
            "env": {
                # The producer is given the environment's class below; the name is for messages.
                "name": "multiply_tool",
                "max_turns": args.turns,
                "max_tokens_per_turn": args.turn_tokens,
                "num_workers": args.workers,
                "turn_scheduling": schedule,
            },
            "reward": {"functions": []},
            "sft_warmup_steps": 0,
        },
    )


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    configs = {schedule: config(args, schedule) for schedule in SCHEDULES}
    base = configs["lockstep"]
    task = build_task(base)
    engine = EmbeddedEngine.from_config(base.model, base.rollout, seed=base.seed)
    producers = {
        schedule: EnvironmentProducer(
            engine,
            task,
            None,
            Sampling.training(cfg),
            EpisodeSettings.from_config(cfg),
            lambda **options: SleepingToolEnvironment(
                turns=args.turns, in_process=args.tool == "sleep", **options
            ),
        )
        for schedule, cfg in configs.items()
    }
    # One warm-up call (first forwards, the tool's first interpreter start): not timed.
    producers["lockstep"].produce(task.stream.next_batch(2), step=-1)
    runs: dict[str, list[dict[str, float]]] = {schedule: [] for schedule in SCHEDULES}
    for round_index in range(args.rounds):
        prompts = task.stream.next_batch(args.prompts)
        for schedule in SCHEDULES:
            began = time.perf_counter()
            scored = producers[schedule].produce(prompts, step=round_index)
            wall = time.perf_counter() - began
            metrics = scored.metrics
            calls = metrics["env/engine_calls_count"]
            runs[schedule].append(
                {
                    "episodes_s": wall,
                    "engine_s": metrics["time/rollout_s"],
                    "env_wait_s": metrics["time/env_s"],
                    "engine_calls": calls,
                    "requests_per_call": len(scored.samples) * metrics["env/turns_mean"] / calls,
                    "turns_mean": metrics["env/turns_mean"],
                    "tool_calls_mean": metrics["env/tool_calls_mean"],
                }
            )
            print(
                f"[episode_scheduling] round {round_index} {schedule}: {wall:.2f} s",
                file=sys.stderr,
            )
    engine.close()
    rows = {
        schedule: {key: statistics.median(run[key] for run in results) for key in results[0]}
        for schedule, results in runs.items()
    }
    rows["independent"]["speedup_vs_lockstep"] = statistics.median(
        lock["episodes_s"] / free["episodes_s"]
        for lock, free in zip(runs["lockstep"], runs["independent"])
    )
    return {
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "cpu_model": cpu_model_name(),
        "episodes": args.prompts * args.group,
        "turns": args.turns,
        "workers": args.workers,
        "tool": args.tool,
        "rounds": args.rounds,
        "threads": args.threads,
        "schedules": rows,
    }


def print_table(report: dict) -> None:
    print(
        f"# episode_scheduling: {report['machine']} ({report['cpu_model']}); "
        f"{report['episodes']} episodes x {report['turns']} turns, tool calls of 0-200 ms "
        f"({report['tool']}), "
        f"env.num_workers={report['workers']}, {report['rounds']} rounds, "
        f"{report['threads']} torch thread(s)\n"
    )
    print(
        "| env.turn_scheduling | episodes s | engine s | waiting for tools s | engine calls "
        "| requests per call | turns | vs lockstep |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, row in report["schedules"].items():
        speedup = row.get("speedup_vs_lockstep")
        print(
            f"| {schedule} | {row['episodes_s']:.2f} | {row['engine_s']:.2f} | "
            f"{row['env_wait_s']:.2f} | {row['engine_calls']:.0f} | "
            f"{row['requests_per_call']:.1f} | {row['turns_mean']:.2f} | "
            f"{'1.00x' if speedup is None else f'{speedup:.2f}x'} |"
        )


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
