"""The GPU rehearsal: on a lent GPU machine with no network, install the wheels carried to it,
train in bf16 on CUDA with NCCL, and write tokens/s, MFU and every failure to ``$OUT``.

The machine (issue 25, "When a GPU is lent"): one H100 or H200, Python 3.12, torch 2.11 (CUDA) and
transformers; no megatron-core, no Transformer Engine, no SGLang, no network. So the run uses
Megatron's local layer spec: ``engine/model.py`` picks Transformer Engine's spec only when CUDA
and Transformer Engine are both there (there is no config flag for it), and the CPU shims are
applied only without CUDA. Three commands, standard library only (nothing is installed when it
starts):

    # here, with the package index: the wheels the GPU machine lacks, pinned as in
    # constraints-py312.txt, and this project's wheel (.whl/ is git-ignored: pass it to the
    # device tool in carry)
    python benchmarks/gpu_rehearsal.py download --wheels .whl/gpu_rehearsal

    # here, CPU: the carried wheels install into a fresh Python 3.12 venv, their dependencies
    # are the carried wheels or what the GPU machine has, and every command below composes
    python benchmarks/gpu_rehearsal.py dry-run --wheels .whl/gpu_rehearsal

    # on the GPU machine (OUT: a folder the results go to)
    python benchmarks/gpu_rehearsal.py run --wheels .whl/gpu_rehearsal --out "$OUT"

``run`` does, each step with its own time limit, going on after a failure:

1. ``install``: the carried wheels into a folder on PYTHONPATH, without an index (torch and
   transformers stay the machine's).
2. ``environment``: versions, the device, whether NCCL and Transformer Engine are there.
3. ``train``: ``benchmarks/gpu_throughput.py`` under torchrun (1 process, NCCL): GSPO policy
   updates of a Qwen3-30B-A3B-shaped MoE cut to 4 layers and 16 experts, in bf16, on packed
   samples; training tokens/s and MFU.
4. ``smoke``: ``benchmarks/gpu_smoke.py --allow-without-te``: the whole RL loop (the CPU demo
   preset; embedded rollout engine) in bf16 on the GPU; tokens/s and MFU per stage.

``$OUT/summary.json`` holds each step's exit status, seconds, parsed result and log tail;
``$OUT/summary.txt`` the numbers in one screen; ``$OUT/<step>.log`` the full logs.
It has not run on a GPU yet (benchmarks/README.md, "GPU rehearsal").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = REPO_ROOT / "constraints-py312.txt"

INSTALLED_ALWAYS = (
    "megatron-core",
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "math-verify",
    "latex2sympy2_extended",
)
"""Carried and always installed (the machine has none of them): pins from constraints-py312.txt.
megatron-core 0.17.1 is a cp312 manylinux wheel (a C++ helper for Megatron's datasets), not
pure Python; it installs on any x86-64 Linux Python 3.12."""
INSTALLED_IF_MISSING = ("psutil", "tqdm", "requests")
"""Carried, installed only where the machine lacks them (never replacing the machine's copy):
psutil (the checkpoint writer's process guard, imported at start), tqdm (the progress bar),
requests (imported by the SGLang client modules)."""
REQUESTS_DEPENDENCIES = ("urllib3", "idna", "charset-normalizer", "certifi")
"""requests' own dependencies, carried at their newest versions (not pinned by the project), for
a machine without requests."""
PROVIDED_BY_MACHINE = frozenset(
    {"torch", "transformers", "numpy", "packaging", "pyyaml", "sympy", "safetensors"}
)
"""What the carried wheels need and the GPU machine has (torch needs sympy; transformers needs
numpy, packaging, PyYAML and safetensors): ``dry-run`` fails if they need anything else."""
NOT_ON_THIS_PATH = frozenset({"pyarrow", "tensorboard", "matplotlib"})
"""Declared by the project but not imported by the rehearsal's runs, so not carried: pyarrow
(Parquet prompts only, imported where they are read), tensorboard (the smoke run sets
``logging.tensorboard=false`` when the machine lacks it), matplotlib (the plotting tools only)."""
IMPORT_NAMES = {"charset-normalizer": "charset_normalizer"}

TRAIN_ARGUMENTS = ["--layers", "4", "--experts", "16", "--samples", "8"]
TRAIN_ARGUMENTS += ["--tokens-per-sample", "1024", "--steps", "6", "--json"]
SMOKE_ARGUMENTS = ["--allow-without-te", "--steps", "4", "--json"]
STEP_TIME_LIMITS = {"install": 60, "environment": 60, "train": 180, "smoke": 240}
"""Seconds per step: 540 together, under the 600 s one device-tool command may run, leaving the
rest of a lent machine's 15 minutes for its start and one rerun."""

ENVIRONMENT_PROBE = """
import importlib.util, json, platform
import torch, torch.distributed as dist
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
cuda = torch.cuda.is_available()
print(json.dumps({
    "python": platform.python_version(),
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_available": cuda,
    "device": torch.cuda.get_device_name(0) if cuda else None,
    "nccl_available": dist.is_nccl_available(),
    "nccl_version": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
    "megatron_core": version("megatron-core"),
    "transformers": version("transformers"),
    "megatron_gspo": version("megatron_gspo"),
    "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
}))
"""


def pins() -> dict[str, str]:
    """``{normalised name: version}`` of constraints-py312.txt."""
    result = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            result[normalise(name)] = version.strip()
    return result


def normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_name(path: Path) -> str:
    return normalise(path.name.split("-", 1)[0])


def run_command(command: list[str], **options) -> subprocess.CompletedProcess:
    print("+", " ".join(map(str, command)), flush=True)
    return subprocess.run(command, check=True, **options)


# ---------------------------------------------------------------------------------------------
# download (here)
# ---------------------------------------------------------------------------------------------


def download(wheels: Path) -> None:
    """Fill ``wheels`` for a Python 3.12 x86-64 Linux machine: the pinned wheels, requests'
    dependencies, antlr4 (an sdist on PyPI: built into a wheel here) and this project."""
    wheels.mkdir(parents=True, exist_ok=True)
    pinned = pins()
    names = [*INSTALLED_ALWAYS, *INSTALLED_IF_MISSING]
    missing = [name for name in names if normalise(name) not in pinned]
    if missing:
        raise SystemExit(f"not pinned in {CONSTRAINTS.name}: {missing}")
    requirements = [f"{name}=={pinned[normalise(name)]}" for name in names]
    binary = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    binary += ["--platform", "manylinux_2_28_x86_64", "--abi", "cp312", "--abi", "abi3"]
    binary += ["--abi", "none"]
    wheel_requirements = [r for r in requirements if not r.startswith("antlr4")]
    pip = [sys.executable, "-m", "pip"]
    run_command([*pip, "download", "--no-deps", "-d", str(wheels), *binary, *wheel_requirements])
    run_command([*pip, "download", "--no-deps", "-d", str(wheels), *binary, *REQUESTS_DEPENDENCIES])
    antlr = next(r for r in requirements if r.startswith("antlr4"))
    run_command([*pip, "wheel", "--no-deps", "-w", str(wheels), antlr])
    run_command([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), "."],
                cwd=REPO_ROOT)  # fmt: skip
    for path in sorted(wheels.iterdir()):
        print(f"{path.stat().st_size:>10,}  {path.name}")


# ---------------------------------------------------------------------------------------------
# install (on the GPU machine, and in the dry run)
# ---------------------------------------------------------------------------------------------


def carried(wheels: Path) -> dict[str, Path]:
    found = {wheel_name(path): path for path in sorted(wheels.glob("*.whl"))}
    needed = [*INSTALLED_ALWAYS, *INSTALLED_IF_MISSING, *REQUESTS_DEPENDENCIES, "megatron_gspo"]
    missing = [name for name in needed if normalise(name) not in found]
    if missing:
        raise SystemExit(f"{wheels} lacks wheels for {missing}: run the download command")
    return found


def importable(python: Path, module: str, environment: Optional[dict] = None) -> bool:
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([str(python), "-c", probe], env=environment).returncode == 0


def install(python: Path, wheels: Path, target: Optional[Path] = None) -> list[str]:
    """Install the carried wheels for ``python`` without an index and without dependency
    resolution (the machine's torch and transformers stay as they are): into its environment,
    or into ``target`` (a folder for PYTHONPATH); returns the names installed."""
    found = carried(wheels)
    environment = None
    if target is not None:
        environment = {**os.environ, "PYTHONPATH": str(target)}
    names = [normalise(name) for name in (*INSTALLED_ALWAYS, "megatron_gspo")]
    for name in INSTALLED_IF_MISSING:
        if not importable(python, name, environment):
            names.append(normalise(name))
            if name == "requests":
                names += [
                    normalise(dependency)
                    for dependency in REQUESTS_DEPENDENCIES
                    if not importable(python, IMPORT_NAMES.get(dependency, dependency), environment)
                ]
    paths = [str(found[name]) for name in names]
    where = [] if target is None else ["--target", str(target)]
    command = [str(python), "-m", "pip", "install", "--no-index", "--no-deps", *where, *paths]
    run_command(command, timeout=STEP_TIME_LIMITS["install"])
    return names


def unmet_requirements(python: Path) -> set[str]:
    """Distributions ``pip check`` reports missing (a version conflict is reported too)."""
    result = subprocess.run(
        [str(python), "-m", "pip", "check"], capture_output=True, text=True, check=False
    )
    unmet = set()
    for line in result.stdout.splitlines():
        if " requires " in line and "which is not installed" in line:
            unmet.add(normalise(line.split(" requires ", 1)[1].split(",")[0].strip()))
        elif " has requirement " in line:
            unmet.add(normalise(line.split(" has requirement ", 1)[1].split()[0]))
    return unmet


# ---------------------------------------------------------------------------------------------
# The steps of a run
# ---------------------------------------------------------------------------------------------


def train_command(python: Path) -> list[str]:
    return [
        str(python), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
        str(REPO_ROOT / "benchmarks" / "gpu_throughput.py"), *TRAIN_ARGUMENTS,
    ]  # fmt: skip


def smoke_command(python: Path, out: Path, with_tensorboard: bool) -> list[str]:
    command = [str(python), str(REPO_ROOT / "benchmarks" / "gpu_smoke.py"), *SMOKE_ARGUMENTS]
    command += ["--output-dir", str(out / "smoke_run")]
    if not with_tensorboard:
        command += ["--", "logging.tensorboard=false"]  # the machine has no tensorboard
    return command


def last_json_line(text: str):
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def run_step(name: str, command: list[str], out: Path, environment: dict) -> dict:
    """Run one step with its time limit; its log to ``out/<name>.log``; never raises."""
    started = time.perf_counter()
    log = out / f"{name}.log"
    try:
        result = subprocess.run(
            command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
            timeout=STEP_TIME_LIMITS[name],
        )  # fmt: skip
        text, status = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as error:
        text = (
            (error.stdout or b"").decode(errors="replace")
            if isinstance(error.stdout, bytes)
            else (error.stdout or "")
        )
        text += f"\n[gpu_rehearsal] {name}: over its {STEP_TIME_LIMITS[name]} s limit"
        status = "timeout"
    log.write_text(" ".join(command) + "\n\n" + text)
    result_json = last_json_line(text) if status == 0 else None
    if status == 0 and result_json is None:
        status = "exited 0 without a JSON result"  # e.g. the benchmark found no CUDA GPU
    return {
        "command": command,
        "status": status,
        "seconds": round(time.perf_counter() - started, 1),
        "result": result_json,
        "log_tail": text[-3000:],
    }


def summary_text(steps: dict) -> str:
    lines = []
    environment = (steps.get("environment") or {}).get("result") or {}
    lines.append(
        f"device {environment.get('device')}; torch {environment.get('torch')} (CUDA "
        f"{environment.get('torch_cuda')}), NCCL {environment.get('nccl_version')}, "
        f"megatron-core {environment.get('megatron_core')}, transformers "
        f"{environment.get('transformers')}, Transformer Engine "
        f"{environment.get('transformer_engine')}"
    )
    for name, step in steps.items():
        lines.append(f"{name}: status {step['status']}, {step['seconds']} s")
    train = (steps.get("train") or {}).get("result") or {}
    if train:
        lines.append(f"train (gpu_throughput.py {' '.join(TRAIN_ARGUMENTS)}): {json.dumps(train)}")
    smoke = (steps.get("smoke") or {}).get("result") or {}
    if smoke:
        mfu = smoke.get("mean_mfu")
        lines.append(
            f"smoke (gpu_smoke.py, preset {smoke.get('preset')}): train "
            f"{smoke.get('mean_train_tokens_per_s')} tokens/s, end to end "
            f"{smoke.get('mean_step_tokens_per_s')} tokens/s, MFU "
            + ("n/a" if mfu is None else f"{100 * mfu:.3f}%")
        )
    for name, step in steps.items():
        if step["status"] != 0:
            lines.append(f"FAILED {name}: ...{step['log_tail'][-1500:]}")
    return "\n".join(lines) + "\n"


def rehearse(wheels: Path, out: Path, site: Path) -> int:
    """The GPU run. The wheels go into ``site``, a folder put first on PYTHONPATH for this
    interpreter (not a venv: a venv made from a venv or conda Python would not see the
    machine's torch), after the checkout (the same package, its benchmarks beside it)."""
    out.mkdir(parents=True, exist_ok=True)
    steps: dict = {}

    def write() -> None:
        (out / "summary.json").write_text(json.dumps(steps, indent=1))
        (out / "summary.txt").write_text(summary_text(steps))

    python = Path(sys.executable)
    started = time.perf_counter()
    try:
        if site.exists():
            shutil.rmtree(site)
        installed = install(python, wheels, target=site)
        steps["install"] = {
            "status": 0, "seconds": round(time.perf_counter() - started, 1),
            "result": {"installed": installed, "site": str(site)},
            "log_tail": "", "command": ["install"],
        }  # fmt: skip
    except Exception as error:  # recorded: the remaining steps cannot run without it
        steps["install"] = {
            "status": f"{type(error).__name__}: {error}", "command": ["install"],
            "seconds": round(time.perf_counter() - started, 1), "result": None,
            "log_tail": str(error),
        }  # fmt: skip
        write()
        return 1
    write()
    environment = dict(os.environ)
    path = [str(REPO_ROOT), str(site), environment.get("PYTHONPATH", "")]
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    steps["environment"] = run_step(
        "environment", [str(python), "-c", ENVIRONMENT_PROBE], out, environment
    )
    write()
    if not (steps["environment"]["result"] or {}).get("cuda_available"):
        steps["environment"]["status"] = "no CUDA GPU: the GPU steps were not run"
        write()
        print((out / "summary.txt").read_text())
        return 1
    steps["train"] = run_step("train", train_command(python), out, environment)
    write()
    with_tensorboard = importable(python, "tensorboard", environment)
    steps["smoke"] = run_step(
        "smoke", smoke_command(python, out, with_tensorboard), out, environment
    )
    write()
    print((out / "summary.txt").read_text())
    return 0 if all(step["status"] == 0 for step in steps.values()) else 1


# ---------------------------------------------------------------------------------------------
# dry run (here, CPU)
# ---------------------------------------------------------------------------------------------


def dry_run(wheels: Path, python312: str, out: Path) -> int:
    """What can be checked without a GPU: the wheels install into a fresh Python 3.12 venv
    (no system packages); what they need beyond each other is what the GPU machine has; the
    project imports its config (torch-free) in that venv and composes the smoke run's config
    with its overrides; the benchmark scripts parse the arguments given to them."""
    with tempfile.TemporaryDirectory(prefix="gpu_rehearsal_") as temporary:
        venv_dir = Path(temporary) / "venv"
        run_command([python312, "-m", "venv", str(venv_dir)])
        python = venv_dir / "bin" / "python"
        installed = install(python, wheels)
        unmet = unmet_requirements(python)
        beyond = unmet - PROVIDED_BY_MACHINE - NOT_ON_THIS_PATH
        print(f"installed {installed}; unmet, for the machine to provide: {sorted(unmet)}")
        if beyond:
            print(f"dry-run: the wheels also need {sorted(beyond)}, which the GPU machine lacks")
            return 1
        # Stand-ins for the torch-free packages the machine provides (torch and transformers
        # stay out: the checks below must not need them).
        stand_ins = ["pyyaml", "packaging", "numpy", "sympy"]
        run_command([str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), *stand_ins])
        environment = dict(os.environ)
        environment.pop("PYTHONPATH", None)  # the installed wheel, not the checkout
        probe = "import hydra, omegaconf, math_verify, psutil, megatron_gspo.config as c; print(c)"
        run_command([str(python), "-c", probe], env=environment, cwd=temporary)
        # The smoke run's config, composed as gpu_smoke.py composes it (its overrides first).
        smoke_overrides = ["model.dtype=bfloat16", "steps=4", "logging.progress_bar=false"]
        smoke_overrides += ["checkpoint.interval=0", "logging.tensorboard=false"]
        run_command(
            [str(python), "-m", "megatron_gspo.train", "--preset", "cpu_demo",
             *smoke_overrides, "--cfg"],
            env=environment, cwd=temporary, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        # The benchmark scripts parse these arguments before they import torch.
        for command in (train_command(python), smoke_command(python, out, False)):
            script = next(part for part in command if part.endswith(".py"))
            arguments = command[command.index(script) + 1 :]
            arguments = [part for part in arguments if part != "--json"]
            # --help before any "--", after which gpu_smoke.py takes trainer overrides.
            cut = arguments.index("--") if "--" in arguments else len(arguments)
            arguments = [*arguments[:cut], "--help", *arguments[cut:]]
            run_command([str(python), script, *arguments], cwd=REPO_ROOT,
                        env=environment, stdout=subprocess.DEVNULL)  # fmt: skip
        print("dry-run: the wheels install and the commands compose; no GPU step was run")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/gpu_rehearsal.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("mode", choices=("download", "dry-run", "run"))
    parser.add_argument("--wheels", type=Path, default=REPO_ROOT / ".whl" / "gpu_rehearsal")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_rehearsal")))
    parser.add_argument(
        "--site", type=Path, default=Path("/tmp/gpu_rehearsal_site"), help="run's install folder"
    )
    parser.add_argument("--python312", default="python3.12", help="dry-run's interpreter")
    args = parser.parse_args(argv)
    if args.mode == "download":
        download(args.wheels)
        return 0
    if args.mode == "dry-run":
        return dry_run(args.wheels, args.python312, args.out)
    return rehearse(args.wheels, args.out, args.site)


if __name__ == "__main__":
    sys.exit(main())
