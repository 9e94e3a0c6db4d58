"""Per-call cost of the code reward's sandbox: sandboxed runs per second, one after another.

The code reward starts one sandbox per stdin/stdout case and one per test program, so its
start-up is paid for every sample. Variants, interleaved round by round (the box is shared, so
one slow moment hits every variant alike), each running the same trivial program:

- ``bubblewrap``: :func:`megatron_gspo.reward.sandbox.run_python`, the default isolation;
- ``none``: the same without isolation (``isolation="none"``: resource limits only), the floor;
- ``before``: with ``--before REF``, the sandbox of git revision ``REF`` (the one before
  bubblewrap: ``unshare --net`` plus an in-process audit hook), loaded from git;
- ``code/<form>``: the whole ``code`` reward on one sample of each test form (one case each).

Run from the repository root:

    python benchmarks/code_sandbox.py --rounds 20 [--before REF] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_gspo.reward import RewardInput  # noqa: E402
from megatron_gspo.reward.code_execution import code_reward  # noqa: E402
from megatron_gspo.reward.sandbox import (  # noqa: E402
    SandboxLimits,
    SandboxUnavailableError,
    check_isolation,
    run_python,
)

PROGRAM = "print(sum(range(1000)))"
SOLUTION = "def add(a, b):\n    return a + b\n"


def load_module_from_git(revision: str, path: str, name: str):
    """The module at ``path`` as of git ``revision`` (it must import nothing of this package)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:{path}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="megatron_gspo_bench_") as directory:
        path = Path(directory, f"{name}.py")
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def variants(before: str | None) -> dict[str, Callable[[], bool]]:
    limits = SandboxLimits(wall_time_s=30.0)
    trusted = SandboxLimits(wall_time_s=30.0, isolation="none")
    calls: dict[str, Callable[[], bool]] = {
        "bubblewrap": lambda: run_python(PROGRAM, limits=limits).passed,
        "none": lambda: run_python(PROGRAM, limits=trusted).passed,
    }
    if before:
        old = load_module_from_git(before, "megatron_gspo/reward/sandbox.py", "old_sandbox")
        old_limits = old.SandboxLimits(wall_time_s=30.0)
        calls["before"] = lambda: old.run_python(PROGRAM, limits=old_limits).passed

    def sample(tests) -> RewardInput:
        return RewardInput(prompt="", response=SOLUTION, metadata={"tests": tests})

    forms = {
        "code/stdin_stdout": sample([{"input": "", "output": ""}]),
        "code/function_call": sample({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}),
        "code/test_code": sample("assert add(1, 2) == 3"),
    }
    for name, case in forms.items():
        calls[name] = lambda case=case: code_reward(case, timeout_s=30.0) >= 0.0
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--before", help="git revision whose sandbox is the 'before' variant")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = parser.parse_args()
    try:
        check_isolation()
    except SandboxUnavailableError as error:
        sys.exit(f"cannot measure the sandbox here: {error}")
    calls = variants(args.before)
    for call in calls.values():  # warm-up: the availability probe, imports, page cache
        assert call(), "a warm-up call failed"
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            assert call()
            seconds[name].append(time.perf_counter() - start)
    baseline = statistics.median(seconds["before" if args.before else "none"])
    rows = {
        name: {
            "median_ms": 1000 * statistics.median(values),
            "min_ms": 1000 * min(values),
            "calls_per_s": 1 / statistics.median(values),
            "vs_baseline": statistics.median(values) / baseline,
        }
        for name, values in seconds.items()
    }
    if args.json:
        print(json.dumps({"rounds": args.rounds, "before": args.before, "variants": rows}))
        return
    reference = "before" if args.before else "none"
    print(f"{args.rounds} rounds, one call of each variant per round; ratio vs {reference}")
    print(f"| variant | median ms | min ms | calls/s | x {reference} |")
    print("|---|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(
            f"| {name} | {row['median_ms']:.1f} | {row['min_ms']:.1f} | "
            f"{row['calls_per_s']:.1f} | {row['vs_baseline']:.2f} |"
        )


if __name__ == "__main__":
    main()
