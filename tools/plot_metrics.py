#!/usr/bin/env python
"""Plot metrics of one run against the step, and print them as a Markdown table.

    python tools/plot_metrics.py outputs/cpu_tool_use/metrics.jsonl --out docs/cpu_tool_use \\
        --keys reward_mean env/tool_success_frac env/turns_mean

Writes ``OUT/metrics.png`` (one panel per key) and ``OUT/metrics.md`` (the table, every
``--every`` steps and the last one), and prints the table. docs/agentic.md's reward curve of
the CPU tool-use task comes from this script.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def markdown_table(records: list[dict], keys: list[str], every: int) -> str:
    chosen = [r for r in records if r["step"] % every == 0 or r is records[-1]]
    lines = [
        "| step | " + " | ".join(keys) + " |",
        "|---:|" + "---:|" * len(keys),
    ]
    for record in chosen:
        values = " | ".join(f"{record[key]:.3f}" if key in record else "" for key in keys)
        lines.append(f"| {record['step']} | {values} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], keys: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.2), squeeze=False)
    for axis, key in zip(axes[0], keys):
        steps = [r["step"] for r in records if key in r]
        axis.plot(steps, [r[key] for r in records if key in r], marker=".")
        axis.set_xlabel("step")
        axis.set_title(key)
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path, help="a run's metrics.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="directory for the PNG and table")
    parser.add_argument("--keys", nargs="+", default=["reward_mean"])
    parser.add_argument("--every", type=int, default=5, help="table rows every this many steps")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    records = read_records(args.metrics)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(records, args.keys, args.out / "metrics.png", args.title or str(args.metrics))
    table = markdown_table(records, args.keys, args.every)
    (args.out / "metrics.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
