"""Write ``docs/configuration.md``, the reference of every configuration key, from
``megatron_gspo/config.py`` and the section modules it imports (the dataclasses, their defaults
and the docstrings under each field).

    python tools/config_docs.py            # rewrite docs/configuration.md
    python tools/config_docs.py --check    # exit 1 if it differs from what config.py says

``tests/docs/test_docs.py`` runs the check, so the page cannot drift from the schema: change a
key's docstring or default in config.py, then run this script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_gspo import config as config_module  # noqa: E402

OUTPUT = REPO_ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration reference

Every key of the configuration tree, its type, its default and what it means. This page is
generated from `megatron_gspo/config.py` (and the sections it imports, `config_model.py`,
`config_algo.py` and `config_rollout.py`) by `python tools/config_docs.py` (a test fails when
they differ): the defaults live only there, each with its source where it comes from a paper or
a peer framework.

Set keys on the command line with Hydra's grammar (`algo.clip_low=3e-4`, `parallel.tp=2`,
`'reward.functions=[math,format]'`, `null` for None) or in a preset YAML
(`--preset NAME|PATH`; [examples/moe/cpu_demo.yaml](../examples/moe/cpu_demo.yaml) writes out
every key at its default). `python -m megatron_gspo.train --cfg [overrides]` prints the resolved
configuration. Unknown keys and values of the wrong type or range stop the run at start with
what is wrong, why, and how to fix it.
"""


def class_node(class_name: str) -> ast.ClassDef:
    """The source of the config class ``class_name``, from the module that defines it
    (config.py or one of the section modules it imports)."""
    source = Path(inspect.getsourcefile(getattr(config_module, class_name)))
    tree = ast.parse(source.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return node


def field_docstrings(class_name: str) -> dict[str, str]:
    """The string literal under each field of ``class_name`` (attribute docstrings are not
    kept at runtime, so they are read from the source)."""
    node = class_node(class_name)
    docs: dict[str, str] = {}
    body = node.body
    for statement, following in zip(body, body[1:] + [None]):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def annotations(class_name: str) -> dict[str, str]:
    node = class_node(class_name)
    return {
        statement.target.id: ast.unparse(statement.annotation)
        for statement in node.body
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
    }


def render_value(value: Any) -> str:
    """A default as it would be written in an override (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(render_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {render_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()


def section(cls: type, prefix: str) -> list[str]:
    docs, types = field_docstrings(cls.__name__), annotations(cls.__name__)
    lines = []
    for field in dataclasses.fields(cls):
        if dataclasses.is_dataclass(config_module._dataclass_of(field.type)):
            continue
        text = docs.get(field.name, "")
        meaning = f": {text}" if text else ""
        lines.append(
            f"- **`{prefix}{field.name}`** (`{types[field.name]}`, default "
            f"`{render_value(default_of(field))}`){meaning}"
        )
    return lines


def class_doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def render() -> str:
    root = config_module.TrainConfig
    parts = [HEADER, "## Top level", "", class_doc(root), "", *section(root, ""), ""]
    parts += subsections(root, "", level=2)
    return "\n".join(parts).rstrip() + "\n"


def subsections(cls: type, prefix: str, level: int) -> list[str]:
    """A section per nested config dataclass of ``cls`` (and theirs, one heading level down)."""
    parts: list[str] = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        sub = config_module._dataclass_of(hints[field.name])
        if sub is None:
            continue
        key = f"{prefix}{field.name}"
        parts += [f"{'#' * level} `{key}`", ""]
        if sub.__doc__ and not sub.__doc__.startswith(f"{sub.__name__}("):
            parts += [class_doc(sub), ""]
        parts += [*section(sub, f"{key}."), ""]
        parts += subsections(sub, f"{key}.", level + 1)
    return parts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare, exit 1 on drift")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run python tools/config_docs.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
