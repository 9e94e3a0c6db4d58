"""The floors of the package: every import runs down, and no import closes a circle.

The package root holds the entry point (``train.py``), the loop (``loop.py``) and packages by
concern. :data:`FLOORS` lists them from the bottom up; a module may import its own package and
the packages of lower floors, never a package on its own floor or above. Every import counts:
top-level ones, those inside functions (lazy) and those under ``TYPE_CHECKING``, since a lazy
import hides a dependency from Python, not from the reader. The same walk finds import circles
between modules, inside a package too. ``docs/architecture.md`` ("Packages and their
boundaries") has the same floors in a table."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_gspo"

FLOORS: list[tuple[str, ...]] = [
    ("samples", "config"),
    ("runtime", "algo"),
    ("data", "convert", "metrics"),
    ("reward", "weight_sync"),
    ("rollout", "envs"),
    ("production", "engine"),
    ("driver", "startup"),
    ("trainer",),
    ("loop",),
    ("train",),
]
"""Rooms from the bottom floor up. ``samples`` (the records that travel from the rollout to the
engine) and ``config`` (the typed tree every package reads) import no other room; ``loop`` and
``train`` are the root's two modules."""

ALLOWED_UPWARD: set[tuple[str, str]] = set()
"""(importing room, imported room) pairs allowed to run up or sideways: none."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """``(imported module of this package, line)`` for every import in ``path``, at any depth.
    ``from a.b import c`` names ``a.b.c`` when that is a module, else ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [
                f"{node.module}.{alias.name}"
                if f"{node.module}.{alias.name}" in modules
                else node.module
                for alias in node.names
            ]
        else:
            continue
        found += [(name, node.lineno) for name in names if name in modules]
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def _floor_of() -> dict[str, int]:
    return {room: level for level, rooms in enumerate(FLOORS) for room in rooms}


def test_every_room_has_a_floor():
    """A new package (or a module at the root) must be given its floor here."""
    rooms = {_room(module) for module in _modules() if module != "megatron_gspo"}
    assert sorted(rooms - set(_floor_of())) == []
    assert sorted(set(_floor_of()) - rooms) == []


def test_the_root_holds_the_entry_point_the_loop_and_packages():
    modules = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert modules == ["__init__.py", "loop.py", "train.py"]


def test_no_import_runs_up_or_sideways():
    floor = _floor_of()
    modules = _modules()
    offenders = []
    for module, path in modules.items():
        if module == "megatron_gspo":
            continue
        source = _room(module)
        for imported, line in _imports(path, modules):
            target = _room(imported) if imported != "megatron_gspo" else source
            if target == source or (source, target) in ALLOWED_UPWARD:
                continue
            if floor[target] >= floor[source]:
                offenders.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports {imported} "
                    f"(floor {floor[target]}) from floor {floor[source]}"
                )
    assert offenders == []


def test_no_import_circle():
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], int] = {}
    for module, path in modules.items():
        for imported, line in _imports(path, modules):
            if imported != module:
                graph[module].add(imported)
                lines.setdefault((module, imported), line)
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path_stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path_stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == 1:
                cycle = path_stack[path_stack.index(imported) :] + [imported]
                circles.append(
                    " -> ".join(f"{a} (line {lines[(a, b)]})" for a, b in zip(cycle, cycle[1:]))
                    + f" -> {imported}"
                )
            elif imported not in state:
                visit(imported)
        path_stack.pop()
        state[module] = 2

    for module in sorted(modules):
        if module not in state:
            visit(module)
    assert circles == []


def test_a_moved_module_names_its_new_path():
    """Scripts and configs written against the old layout fail with the path to write instead."""
    import importlib

    import pytest

    from megatron_gspo import MOVED_MODULES
    from megatron_gspo.config import ConfigError
    from megatron_gspo.config.import_paths import load_named_callable

    for old, new in MOVED_MODULES.items():
        with pytest.raises(ModuleNotFoundError, match=f"{old} moved to {new.split()[0]}"):
            importlib.import_module(old)
        assert importlib.import_module(new.split()[0])
    with pytest.raises(ConfigError, match="write megatron_gspo.trainer.setup:resolve_model"):
        load_named_callable(
            "reward.functions",
            "megatron_gspo.run_setup:resolve_model",
            {},
            "reward function",
            "function",
            "function",
        )
