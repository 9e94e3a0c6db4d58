"""The seams a newcomer crosses are typed without importing Megatron: ``--cfg`` and the loop's
modules (driver, policy stages, run setup, metrics, the checkpoint folder, the converter) load
no ``megatron`` package; the training engine's type is imported only under ``TYPE_CHECKING``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
{body}
loaded = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
print(json.dumps(loaded))
"""


def _megatron_modules_after(body: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    process = subprocess.run(
        [sys.executable, "-c", PROBE.format(body=body)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


def test_cfg_does_not_import_megatron():
    loaded = _megatron_modules_after(
        "from megatron_gspo.train import main\nassert main(['--cfg']) == 0"
    )
    assert loaded == []


def test_loop_modules_do_not_import_megatron():
    loaded = _megatron_modules_after(
        "import megatron_gspo.loop, megatron_gspo.driver, megatron_gspo.trainer.stages\n"
        "import megatron_gspo.trainer.setup, megatron_gspo.metrics, megatron_gspo.samples.routes\n"
        "import megatron_gspo.runtime.checkpoint_files, megatron_gspo.convert.export"
    )
    assert loaded == []


def test_only_the_engine_imports_megatron():
    """``engine/`` is the one package that imports Megatron (CONTRIBUTING.md): an import of
    ``megatron`` anywhere else in the package, even a lazy one inside a function, fails here."""
    import ast

    package = REPO_ROOT / "megatron_gspo"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "engine":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name == "megatron" or name.startswith("megatron."):
                    offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {name}")
    assert offenders == []
