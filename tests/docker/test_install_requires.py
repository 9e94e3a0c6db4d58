"""setup.py's requirements: a plain ``pip install .`` (no constraints file) resolves to versions
inside what was tested, and every exact pin the project uses satisfies them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
TRACKED_CLOSELY = ("torch", "megatron-core", "transformers", "hydra-core", "omegaconf")
"""Dependencies whose internals the code relies on: their next release is untested."""


def setup_keyword(name: str):
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def install_requires() -> dict[str, Requirement]:
    requirements = [Requirement(text) for text in setup_keyword("install_requires")]
    return {requirement.name: requirement for requirement in requirements}


def constraint_pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            pins[requirement.name] = Version(specifier.version)
    return pins


@pytest.mark.parametrize("name", TRACKED_CLOSELY)
def test_closely_tracked_dependencies_have_an_upper_bound(name):
    requirement = install_requires()[name]
    assert any(spec.operator in ("<", "<=") for spec in requirement.specifier), requirement


def test_versions_past_testing_are_excluded():
    requirements = install_requires()
    assert not requirements["transformers"].specifier.contains("5.24.0")  # warns on every call
    assert not requirements["torch"].specifier.contains("2.15.0")


def test_every_pin_satisfies_the_requirements():
    requirements = install_requires()
    pinned = dict(constraint_pins())
    for text in setup_keyword("extras_require")["gpu"]:
        requirement = Requirement(text)
        (specifier,) = requirement.specifier
        pinned[f"{requirement.name} (gpu extra)"] = Version(specifier.version)
    failures = []
    for name, version in pinned.items():
        requirement = requirements.get(name.split(" ")[0])
        if requirement is not None and not requirement.specifier.contains(version):
            failures.append(f"{name}=={version} is outside {requirement}")
    assert not failures, failures


def test_readme_says_how_to_install_on_a_cpu_machine():
    readme = (ROOT / "README.md").read_text()
    torch_pin = constraint_pins()["torch"]
    command = f"pip install torch=={torch_pin} --index-url https://download.pytorch.org/whl/cpu"
    assert command in readme
    assert "pip install ." in readme.split("## Installing", 1)[1].split("\n## ", 1)[0]
