"""Every training command the docs show composes as written: its command-line form (overrides
on both sides of ``--preset``, ``reward.options`` and ``env.options`` without Hydra's ``+``),
and every override the docs or an error message suggest in backquotes."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_gspo.config.loader import load_config
from megatron_gspo.train import parse_args

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "examples" / "moe" / "README.md"] + sorted(
    (REPO_ROOT / "docs").glob("*.md")
)
OPTION_OVERRIDE = re.compile(r"(?:reward|env)\.options\.[A-Za-z0-9_.]+=[A-Za-z0-9_.'\"]+")


def documented_commands() -> list[tuple[str, list[str]]]:
    """``(where, arguments after megatron_gspo.train)`` of every command line in the docs."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            line, start = lines[index], index
            while line.rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line.rstrip()[:-1] + " " + lines[index].strip()
            index += 1
            if "-m megatron_gspo.train" not in line:
                continue
            command = line.split("-m megatron_gspo.train", 1)[1].split("`")[0]
            if "..." in command or "[overrides]" in command:
                continue  # prose about commands, not a command
            words = shlex.split(command, comments=True)
            found.append((f"{path.relative_to(REPO_ROOT)}:{start + 1}", words))
    return found


def suggested_option_overrides() -> list[tuple[str, str]]:
    """``(where, override)`` for each ``reward.options...=`` / ``env.options...=`` that a doc or
    an error message of the package tells the user to write."""
    found = []
    sources = DOCS + sorted((REPO_ROOT / "megatron_gspo").rglob("*.py"))
    for path in sources:
        for override in sorted(set(OPTION_OVERRIDE.findall(path.read_text(encoding="utf-8")))):
            found.append((str(path.relative_to(REPO_ROOT)), override.strip("'\"")))
    return found


COMMANDS = documented_commands()
OPTION_OVERRIDES = suggested_option_overrides()


def test_the_docs_show_commands_and_option_overrides():
    assert len(COMMANDS) >= 8, COMMANDS
    assert {override for _, override in OPTION_OVERRIDES} >= {
        "reward.options.code.isolation=none",
        "env.options.isolation=none",
    }


@pytest.mark.parametrize("where,words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_composes(where, words):
    if "--help" in words:
        return  # argparse's own exit; covered by tests/docker/test_package_install.py
    args = parse_args(words)
    config = load_config(args.preset, list(args.overrides))
    for override in args.overrides:
        key, _, _ = override.lstrip("+").partition("=")
        node = config
        for part in key.split("."):
            node = node[part] if isinstance(node, dict) else getattr(node, part)


@pytest.mark.parametrize("where,override", OPTION_OVERRIDES, ids=[o for _, o in OPTION_OVERRIDES])
def test_suggested_option_override_composes(where, override):
    """As written (no ``+``), on top of a configuration that uses the function or environment."""
    key, _, value = override.partition("=")
    if key.startswith("reward.options."):
        function = key.split(".")[2]
        config = load_config(None, [f"reward.functions=[{function}]", override])
        assert str(config.reward.options[function][key.split(".", 3)[3]]) == value
    else:
        config = load_config("cpu_tool_use", [override])
        assert str(config.env.options[key.split(".", 2)[2]]) == value
