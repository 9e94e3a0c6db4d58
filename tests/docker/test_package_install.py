"""A non-editable install (``pip install .``, no checkout beside it) carries the presets.

The repository's tracked files are copied to a temporary directory (so the build writes nothing
into the checkout), installed with ``pip install --no-deps --no-build-isolation --target`` (no
download: dependencies come from this environment), and ``--preset`` is run from elsewhere with
only the installed copy of megatron_gspo importable.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The target directory of a non-editable install of the working tree."""
    source = tmp_path_factory.mktemp("source")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    target = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(target), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return target


def run_installed(target: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(target)
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_presets_are_installed_as_package_data(installed):
    shipped = sorted(path.name for path in (installed / "megatron_gspo" / "presets").glob("*.yaml"))
    assert shipped == sorted(path.name for path in (ROOT / "examples" / "moe").glob("*.yaml"))
    for name in shipped:  # copies of the one source, byte for byte
        packaged = (installed / "megatron_gspo" / "presets" / name).read_bytes()
        assert packaged == (ROOT / "examples" / "moe" / name).read_bytes()


def test_preset_by_name_from_the_installed_package(installed, tmp_path):
    where = run_installed(
        installed,
        tmp_path,
        "-c",
        "import megatron_gspo, megatron_gspo.config.loader as c; "
        "print(megatron_gspo.__file__); print(c.presets_dir())",
    )
    assert where.returncode == 0, where.stderr[-3000:]
    package_file, presets = where.stdout.split()
    assert package_file.startswith(str(installed)), "the checkout was imported, not the install"
    assert presets == str(installed / "megatron_gspo" / "presets")

    shown = run_installed(
        installed, tmp_path, "-m", "megatron_gspo.train", "--preset", "roll_gspo", "--cfg"
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "dual_clip_constant: 1.4" in shown.stdout and "lr: 1.0e-06" in shown.stdout
    unknown = run_installed(
        installed, tmp_path, "-m", "megatron_gspo.train", "--preset", "rol_gspo"
    )
    assert unknown.returncode == 2 and "did you mean 'roll_gspo'" in unknown.stderr
