"""The code sandbox, run for real: who the code runs as, what it sees, limits, time-outs, a
Python installed under /tmp, and failing closed where the kernel cannot isolate. Hostile
programs: ``test_hostile_code.py``. A test that takes the ``sandbox`` fixture runs only where
bubblewrap isolates code (``sandbox_support.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import megatron_gspo
from megatron_gspo.reward import SandboxLimits, run_python
from megatron_gspo.reward.bubblewrap import python_directories
from megatron_gspo.reward.sandbox import SANDBOX_UID, SandboxUnavailableError, check_isolation

REPOSITORY = Path(__file__).resolve().parents[2]
FAST = SandboxLimits(wall_time_s=10.0, cpu_time_s=2, memory_mb=512)
TRUSTED = SandboxLimits(wall_time_s=10.0, cpu_time_s=2, memory_mb=512, isolation="none")


def run(code: str, limits: SandboxLimits = FAST, **options):
    return run_python(code, limits=limits, **options)


def test_who_the_code_runs_as_and_what_it_sees(sandbox):
    code = (
        "import os\n"
        "status = dict(line.split(':\\t') for line in open('/proc/self/status').read().splitlines()"
        " if ':\\t' in line)\n"
        "print(os.getuid(), os.getgid(), os.getpid(), os.getcwd())\n"
        "print(status['CapEff'], status['CapPrm'], status['CapBnd'], status['NoNewPrivs'])\n"
        "print(status['Seccomp'])\n"
        "print(sorted(os.listdir('/proc/self/fd')))\n"
        "print(sorted(os.listdir('/')))\n"
        "print(sorted(os.listdir('/proc'))[:3], len([p for p in os.listdir('/proc') if p.isdigit()]))\n"
        f"print(os.path.exists({str(REPOSITORY / 'setup.py')!r}))"
    )
    result = run(code)
    assert result.passed, result.stderr
    ids, capabilities, seccomp, descriptors, root, processes, repository = (
        result.stdout.splitlines()
    )
    assert ids.split() == [str(SANDBOX_UID), str(SANDBOX_UID), "2", "/sandbox"]
    assert capabilities.split() == ["0000000000000000"] * 3 + ["1"]
    assert seccomp == "2"  # filter mode: the sandbox refuses to run without libseccomp
    assert descriptors == "['0', '1', '2', '3']"  # stdio and listdir's own: nothing leaked in
    visible = set(eval(root))
    assert "sandbox" in visible and "usr" in visible
    # The Python installation is shown on purpose (read-only): a venv under one of these (CI's
    # Python 3.12 job keeps its venv in the checkout) makes that directory visible, holding only
    # the path to the venv.
    installation = {Path(path).parts[1] for path in python_directories()}
    assert not visible & ({"home", "tmp", "run", "var", "work", "mnt", "opt", "srv"} - installation)
    assert repository == "False"  # the checkout is not visible, venv inside it or not
    assert processes.endswith(" 2")  # the sandbox's init (pid 1) and the program (pid 2)
    assert result.isolation == "bubblewrap"


def test_the_path_of_an_unprivileged_trainer(sandbox, tmp_path):
    """A trainer that is not root (the Docker image's) takes one unprivileged bwrap instead of the
    nested one. Run as root, the test puts the trainer into a user namespace as uid 1000 (an
    outer bwrap) so that it takes that path for real."""
    if os.geteuid() != 0:
        pytest.skip("not root: every other test here already runs the unprivileged path")
    trainer = (
        "import os\nfrom megatron_gspo.reward import run_python\n"
        "print(os.geteuid())\n"
        "result = run_python('import os; print(os.getuid(), os.getpid(), "
        'sorted(os.listdir("/")))\')\n'
        "print(result.returncode, result.stdout.strip())\n"
    )
    command = [shutil.which("bwrap"), "--dev-bind", "/", "/", "--unshare-user", "--unshare-pid"]
    command += ["--proc", "/proc", "--uid", "1000", "--gid", "1000", "--", sys.executable, "-c"]
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [*command, trainer], capture_output=True, text=True, timeout=120, env=environment
    )
    assert result.returncode == 0, result.stderr
    euid, outcome = result.stdout.splitlines()
    assert euid == "1000"
    returncode, uid, pid, root = outcome.split(" ", 3)
    assert (returncode, uid, pid) == ("0", "65534", "2")
    visible = set(eval(root))
    installation = {Path(path).parts[1] for path in python_directories()}
    assert {"sandbox", "usr", "bin"} <= visible
    assert not visible & ({"home", "tmp", "run", "var", "work", "mnt", "opt", "srv"} - installation)


PYTHON_UNDER_TMP = """
from megatron_gspo.reward import run_python
from megatron_gspo.reward.sandbox import SandboxUnavailableError
try:
    result = run_python("import sys; print(sys.executable)")
    print(result.returncode, result.stdout.strip(), result.stderr.strip()[-300:])
except SandboxUnavailableError as error:
    print(error)
"""


def test_a_python_installed_under_tmp(sandbox):
    """A trainer run from a virtual environment under /tmp. As root, the outer bwrap used to
    mount a fresh /tmp after binding the interpreter there, hiding it; the sandbox refused to
    start and its message blamed user namespaces. It runs now. A root trainer's installation
    that the sandbox's user cannot read (a folder of mode 0700) is refused with that reason."""
    environment = Path(tempfile.mkdtemp(prefix="megatron_gspo_venv_", dir="/tmp"))
    try:
        environment.chmod(0o755)  # as `python -m venv /tmp/name` makes it
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", environment],
            check=True,
            timeout=120,
        )
        python = str(environment / "bin" / "python")
        # The project and this environment's packages: --system-site-packages gives the base
        # interpreter's, not those of a venv the tests may run in (the py312 job's).
        import site

        search_path = [str(Path(megatron_gspo.__file__).parents[1]), *site.getsitepackages()]
        variables = {**os.environ, "PYTHONPATH": os.pathsep.join(search_path)}

        def in_the_environment() -> str:
            result = subprocess.run(
                [python, "-c", PYTHON_UNDER_TMP],
                capture_output=True,
                text=True,
                timeout=120,
                env=variables,
            )
            assert result.returncode == 0, result.stderr
            return result.stdout.strip()

        assert in_the_environment() == f"0 {python}"
        if os.geteuid() == 0:  # as any other user, the sandbox's user is the trainer's
            environment.chmod(0o700)
            refusal = in_the_environment()
            assert "could not show this Python inside the sandbox" in refusal, refusal
            assert str(environment) in refusal and "user namespaces" not in refusal
    finally:
        shutil.rmtree(environment, ignore_errors=True)


def test_correct_program_passes_and_wrong_one_fails(sandbox):
    solution = "def add(a, b):\n    return a + b\n"
    for limits in (FAST, TRUSTED):
        passed = run(solution + "assert add(2, 3) == 5\nprint('ok')", limits)
        assert passed.passed and passed.stdout == "ok\n" and passed.isolation == limits.isolation
        wrong = run("def add(a, b):\n    return a - b\nassert add(2, 3) == 5", limits)
        assert not wrong.passed
        assert wrong.returncode == 1 and "AssertionError" in wrong.stderr


def test_stdin_stdout_and_files_beside_the_program(sandbox):
    result = run(
        "import sys\nprint(input()[::-1], open('data.txt').read(), sys.argv[1:])",
        stdin="abc\n",
        files={"data.txt": "payload"},
        argv=["x", "y"],
    )
    assert result.passed and result.stdout == "cba payload ['x', 'y']\n"


def test_third_party_packages_import_without_running_pth_files(sandbox):
    result = run("import numpy, sys\nprint(numpy.ones(2).sum(), 'site' in sys.modules)")
    assert result.passed and result.stdout == "2.0 False\n", result.stderr


def test_infinite_loop_is_killed_by_the_wall_clock(sandbox):
    result = run("while True:\n    pass", SandboxLimits(wall_time_s=1.0))
    assert result.timed_out and not result.passed and result.wall_s < 5.0


def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    result = run("while True:\n    pass", SandboxLimits(wall_time_s=60.0, cpu_time_s=1))
    assert not result.passed and not result.timed_out and result.cpu_time_exceeded


def test_sleeping_program_is_killed_by_the_wall_clock(sandbox):
    result = run("import time\ntime.sleep(60)", SandboxLimits(wall_time_s=1.0, cpu_time_s=10))
    assert result.timed_out and result.returncode is None and not result.passed
    assert 1.0 <= result.wall_s < 5.0


def test_memory_hog_is_stopped(sandbox):
    result = run("hog = bytearray(4 * 1024**3)\nprint('allocated')")
    assert not result.passed and result.memory_exceeded and "allocated" not in result.stdout


def test_environment_is_fixed(sandbox, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    for limits in (FAST, TRUSTED):
        result = run("import os\nprint(sorted(os.environ.items()))", limits)
        assert result.passed and "SECRET_TOKEN" not in result.stdout
        assert "hunter2" not in result.stdout


def test_output_is_capped_and_its_tail_kept(sandbox):
    result = run("print('x' * 100000)\nprint('last line')", SandboxLimits(max_output_bytes=1000))
    assert result.passed and result.output_truncated and len(result.stdout) == 1000
    assert result.stdout_tail.endswith("x\nlast line\n")


def test_scratch_directory_is_writable_and_bounded(sandbox):
    code = (
        "import os\nopen('result.txt', 'w').write('inside')\nos.makedirs('sub/dir')\n"
        "print(os.path.abspath('result.txt'), sorted(os.listdir('.')))\n"
        "open('/dev/shm/segment', 'w').write('shared')\n"
        "for path in ('/dev/escaped', '/escaped', '/sandbox/../escaped'):\n"
        "    try:\n        open(path, 'w')\n        print('wrote', path)\n"
        "    except OSError as error:\n        print(error.strerror)\n"
        "chunk = b'x' * (1 << 20)\nwritten = 0\n"
        "for index in range(100):\n    try:\n"
        "        open(f'fill{index}', 'wb').write(chunk)\n        written += 1\n"
        "    except OSError as error:\n        print(error.strerror, written)\n        break\n"
    )
    result = run(code, SandboxLimits(max_scratch_mb=8))
    lines = result.stdout.splitlines()
    assert lines[0] == "/sandbox/result.txt ['main.py', 'result.txt', 'sub']", result.stderr
    assert lines[1:4] == ["Read-only file system"] * 3
    assert lines[4].startswith("No space left on device") and int(lines[4].split()[-1]) < 8


def test_sandboxes_run_from_threads(sandbox):
    # The trainer has threads (gloo, data loaders): the sandbox is started without preexec_fn.
    results = [None] * 4

    def one(index):
        results[index] = run_python(f"print({index})", limits=FAST)

    threads = [threading.Thread(target=one, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [result.stdout.strip() for result in results] == ["0", "1", "2", "3"]


@pytest.mark.parametrize(
    "bwrap, message",
    [
        ("/nonexistent/bwrap", "needs bubblewrap .*not installed"),
        ("/bin/false", "bubblewrap could not start a sandbox here"),
    ],
)
def test_fails_closed_without_isolation(monkeypatch, tmp_path, bwrap, message):
    """A machine without bubblewrap, and one where it cannot start: the run is refused with
    the reason and the opt-out, the code never runs; isolation=none still runs it."""
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')"
    monkeypatch.setenv("MEGATRON_GSPO_BWRAP", bwrap)
    with pytest.raises(SandboxUnavailableError, match=message) as error:
        run_python(code, limits=FAST)
    assert "isolation" in str(error.value) and "none" in str(error.value)
    with pytest.raises(SandboxUnavailableError, match=message):
        check_isolation()
    assert not marker.exists()
    assert run_python(code, limits=TRUSTED).passed and marker.read_text() == "ran"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="isolation='namespace'"):
        SandboxLimits(isolation="namespace")
    with pytest.raises(ValueError, match="max_processes must be > 0"):
        SandboxLimits(max_processes=0)


def test_sandbox_tests_never_pass_without_a_sandbox():
    """Where bubblewrap cannot run, a test that needs the sandbox is skipped with the reason,
    and in CI it fails: it used to pass after checking the refusal alone."""
    selected = [f"{Path(__file__).resolve()}::test_who_the_code_runs_as_and_what_it_sees"]
    for ci, outcome in (("", "1 skipped"), ("true", "1 error")):  # an error at setup
        environment = {**os.environ, "MEGATRON_GSPO_BWRAP": "/nonexistent/bwrap", "CI": ci}
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rsf", *selected],
            capture_output=True,
            text=True,
            timeout=300,
            env=environment,
            cwd=REPOSITORY,
        )
        assert outcome in result.stdout, result.stdout[-3000:]
        assert result.returncode == (1 if ci else 0)
        assert "needs bubblewrap" in result.stdout  # the reason is shown
        assert ("CI must test it" in result.stdout) == bool(ci)
