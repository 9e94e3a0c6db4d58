"""The documentation says what the code does: the configuration reference is generated from
config/, the demo task is described one way, and the README's reward example runs."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import DataConfig, TrainConfig
from megatron_gspo.config.schema import section_type
from megatron_gspo.data.synthetic import TASK_SUMMARIES

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))

import config_docs  # noqa: E402 - tools/config_docs.py


def test_configuration_reference_is_generated_from_config_py():
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    assert page == config_docs.render(), (
        "docs/configuration.md is stale: python tools/config_docs.py"
    )


def all_keys(cls=TrainConfig, prefix=""):
    for field in dataclasses.fields(cls):
        sub = section_type(cls, field.name)
        if sub is not None:
            yield from all_keys(sub, f"{prefix}{field.name}.")
        else:
            yield cls, field.name, f"{prefix}{field.name}"


def test_every_key_is_documented():
    page = (REPO_ROOT / "docs" / "configuration.md").read_text()
    undocumented = [
        key
        for cls, name, key in all_keys()
        if name not in config_docs.field_docstrings(cls.__name__)
    ]
    assert not undocumented, f"keys without a docstring in config/: {undocumented}"
    for _, _, key in all_keys():
        assert f"**`{key}`**" in page


def test_type_error_points_to_a_page_that_exists():
    from megatron_gspo.config import ConfigError
    from megatron_gspo.config.loader import load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, ["steps=many"])
    (page,) = re.findall(r"docs/\w+\.md", str(error.value))
    assert (REPO_ROOT / page).is_file()


def demo_descriptions() -> dict[str, str]:
    from megatron_gspo import train

    readme = (REPO_ROOT / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    preset = (REPO_ROOT / "examples" / "moe" / "cpu_demo.yaml").read_text()
    return {
        "--help": train.__doc__.split("Examples::")[0],
        "examples/moe/cpu_demo.yaml": preset.split("defaults:")[0],
        "README quickstart": quickstart,
        "TrainConfig": TrainConfig.__doc__,
    }


def test_the_demo_task_is_described_the_same_way_everywhere():
    task = DataConfig().task
    for where, text in demo_descriptions().items():
        text = " ".join(text.split())
        assert TASK_SUMMARIES[task] in text, f"{where} does not say {TASK_SUMMARIES[task]!r}"
        for other, summary in TASK_SUMMARIES.items():
            if other != task:
                assert summary not in text and other not in text, f"{where} mentions {other}"


def test_readme_reward_example_runs(tmp_path, monkeypatch):
    """The README's reward function and YAML, as written there, score samples."""
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.reward import RewardInput, RewardRunner

    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("### Custom reward functions", 1)[1]
    python_block = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    yaml_block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "my_rewards.py").write_text(python_block)
    (tmp_path / "preset.yaml").write_text(f"defaults:\n  - megatron_gspo\n  - _self_\n{yaml_block}")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(str(tmp_path / "preset.yaml"), [])
    samples = [
        RewardInput(prompt="2+2?", response="<answer>4</answer> so 4", answer="4"),
        RewardInput(prompt="2+2?", response="five", answer="4"),
    ]
    with RewardRunner(config.reward) as runner:
        result = runner.score(samples)
    assert result.scores["my_rewards_ends_with_answer"] == [1.1, 0.1]
    assert result.metrics["reward_errors"] == 0.0


SHIPPED = ("megatron_gspo/", "docs/", "examples/", "tools/", "benchmarks/")
SHIPPED_FILES = ("README.md", "CONTRIBUTING.md", "CHANGELOG.md", "Dockerfile", "setup.py")
OUTSIDE = re.compile(r"(?<![\w/.])reference/[\w.-]+\.md|shared/reference|\.\./shared|/work/")
DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w.-]+\.md")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def shipped_text_files() -> list[Path]:
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [
        REPO_ROOT / name
        for name in listed
        if (name.startswith(SHIPPED) or name in SHIPPED_FILES)
        and not name.endswith((".png", ".jsonl", ".json", ".parquet"))
        and (REPO_ROOT / name).is_file()
    ]


def test_nothing_refers_to_files_outside_the_repository():
    """Knowledge the code relies on lives in docs/, not in a folder that is not shipped."""
    problems = []
    for path in shipped_text_files():
        text = path.read_text(errors="replace")
        for number, line in enumerate(text.splitlines(), start=1):
            where = f"{path.relative_to(REPO_ROOT)}:{number}"
            problems += [f"{where}: {match}" for match in OUTSIDE.findall(line)]
            for page in DOC_PATH.findall(line):
                if not (REPO_ROOT / page).is_file():
                    problems.append(f"{where}: {page} does not exist")
        if path.suffix == ".md":
            for target in MARKDOWN_LINK.findall(text):
                if target.startswith(("http://", "https://", "#", "mailto:")):
                    continue
                if not (path.parent / target.split("#")[0]).exists():
                    problems.append(f"{path.relative_to(REPO_ROOT)}: broken link {target}")
    assert not problems, "\n".join(problems)
