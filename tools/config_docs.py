"""Write ``docs/configuration.md``, the reference of every configuration key, from the
``megatron_gspo/config/`` package: the tree and its section modules (the dataclasses, their
defaults and the docstrings under each field).

    python tools/config_docs.py            # rewrite docs/configuration.md
    python tools/config_docs.py --check    # exit 1 if it differs from what megatron_gspo/config/ says

``tests/docs/test_docs.py`` runs the check, so the page cannot drift from the schema: change a
key's docstring or default in megatron_gspo/config/, then run this script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from megatron_gspo import config as config_module  # noqa: E402
from megatron_gspo.config.schema import RENAMED_KEYS, section_type  # noqa: E402

OUTPUT = REPO_ROOT / "docs" / "configuration.md"

HEADER = """\
# Configuration reference

Every key of the configuration tree, its type, its default and what it means. This page is
generated from the `megatron_gspo/config/` package (`tree.py` and the section modules `model.py`,
`algo.py`, `rollout.py` and `sglang.py`) by `python tools/config_docs.py` (a test fails when
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
    (a module of megatron_gspo/config/)."""
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
        if dataclasses.is_dataclass(section_type(cls, field.name)):
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
    parts += keyed_sections()
    parts += renamed_keys()
    return "\n".join(parts).rstrip() + "\n"


KEYED_SECTIONS = {"models": ("role", "ExtraModelConfig")}
"""Top-level mappings whose values are sections, keyed by a name the user picks: the key, the
placeholder shown for the name, the section's class."""


def keyed_sections() -> list[str]:
    """A section per mapping of :data:`KEYED_SECTIONS` (``models.<role>.hf_path``, ...)."""
    parts: list[str] = []
    for key, (name, class_name) in KEYED_SECTIONS.items():
        sub = getattr(config_module, class_name)
        prefix = f"{key}.<{name}>."
        parts += [f"## `{key}.<{name}>`", "", class_doc(sub), ""]
        parts += [*section(sub, prefix), ""]
        parts += subsections(sub, prefix, level=3)
    return parts


def renamed_keys() -> list[str]:
    """The table of renamed keys (``config.schema.RENAMED_KEYS``), whose old names still work."""
    lines = [
        "## Renamed keys",
        "",
        "These old names are still read, as the new key with a warning that names it, for one "
        "release; giving both names of a key is an error.",
        "",
        "| old key | new key |",
        "|---|---|",
    ]
    lines += [f"| `{old}` | `{new}` |" for old, new in RENAMED_KEYS.items()]
    return lines + [""]


def subsections(cls: type, prefix: str, level: int) -> list[str]:
    """A section per nested config dataclass of ``cls`` (and theirs, one heading level down)."""
    parts: list[str] = []
    for field in dataclasses.fields(cls):
        sub = section_type(cls, field.name)
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
