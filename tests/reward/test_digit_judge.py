"""A judge whose verdict is checkable (tools/digit_judge.py), trained in a session fixture: a tiny
qwen3 fine-tuned to answer "yes" exactly when the reference answer and the response are the same
digit string. Its input space (a one-digit answer against a one-digit or an empty response, 110
pairs) is small enough to check whole: the reward, through the judge's real engine, must score
every matching pair 1 and every other pair 0 (at least 95% of each, and no failure).

The training run (slow tier): docs/judges.md's command, as written there, on the fixture's
directory: two GRPO steps with exact_match and the judge; the judge's verdicts, read back from
the recorded batches, must agree with exact match on at least 95% of the samples, and the
judge_* metrics must be logged.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from megatron_gspo.config import ExtraModelConfig
from megatron_gspo.config.loader import load_config
from megatron_gspo.data.tokenizer import build_synthetic_tokenizer
from megatron_gspo.reward import JudgeReward, RewardInput
from megatron_gspo.rollout.judge_backend import build_judge_backend, judge_start_problems
from megatron_gspo.rollout.roles import build_role_engine
from megatron_gspo.samples.recorded_batch import read_recorded_batch, rollouts_directory
from megatron_gspo.train import parse_args
from tests.e2e.harness import read_metrics, start, tail

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "tools"))
import digit_judge  # noqa: E402

DOCS_PAGE = REPO_ROOT / "docs" / "judges.md"
DOCS_DIRECTORY = "outputs/digit_judge"
"""The directory docs/judges.md's commands write to and read from (the fixture's, here)."""
AGREEMENT = 0.95


def documented_run(directory: Path) -> list[str]:
    """The arguments after ``-m megatron_gspo.train`` of docs/judges.md's training command on the
    digit judge, with its directory replaced by ``directory``."""
    lines = DOCS_PAGE.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if "-m megatron_gspo.train" in line and DOCS_DIRECTORY in line:
            command = line
            while command.rstrip().endswith("\\"):
                index += 1
                command = command.rstrip()[:-1] + " " + lines[index].strip()
            words = shlex.split(command.split("-m megatron_gspo.train", 1)[1])
            return [word.replace(DOCS_DIRECTORY, str(directory)) for word in words]
    raise AssertionError(f"{DOCS_PAGE} shows no training command on {DOCS_DIRECTORY}")


@pytest.fixture(scope="session")
def judge_directory(tmp_path_factory) -> Path:
    """``python tools/digit_judge.py --out DIR`` (docs/judges.md), run here: the trained judge,
    the task's prompts and the policy's tokenizer."""
    directory = tmp_path_factory.mktemp("digit_judge")
    assert digit_judge.main(["--out", str(directory)]) == 0
    training = json.loads((directory / digit_judge.TRAINING_RECORD).read_text())
    # The training's own check (first verdict token, greedy, on every pair); the engine's
    # whole answers are checked below.
    assert min(training["match_accuracy"], training["mismatch_accuracy"]) >= AGREEMENT, training
    return directory


@pytest.fixture(scope="module")
def documented_config(judge_directory):
    args = parse_args(documented_run(judge_directory))
    return load_config(args.preset, list(args.overrides))


def test_the_judge_says_yes_exactly_when_the_strings_match(judge_directory, documented_config):
    cfg = documented_config
    assert judge_start_problems(cfg) == []
    # The judge's engine as a run builds it (models.judge), the reward as the run configures it.
    engine = build_role_engine("judge", ExtraModelConfig(hf_path=str(judge_directory / "judge")))
    try:
        backend = build_judge_backend(cfg, {"judge": engine})
        pairs = digit_judge.judge_pairs()
        samples = [
            RewardInput(prompt=f"{answer}<sep>", response=response, answer=answer)
            for answer, response in pairs
        ]
        outcomes, metrics = JudgeReward(cfg.reward.judge, backend).score(samples)
    finally:
        engine.close()
    # Time-outs and unparsable answers would be failures: there must be none.
    assert [outcome.status for outcome in outcomes] == ["ok"] * len(pairs)
    assert metrics["judge_calls"] == 1 and metrics["judge_failures"] == 0
    matching = [o.value == 1.0 for o, (a, r) in zip(outcomes, pairs) if a == r]
    others = [o.value == 0.0 for o, (a, r) in zip(outcomes, pairs) if a != r]
    near_misses = [
        o.value == 0.0
        for o, (a, r) in zip(outcomes, pairs)
        if r and a != r and abs(int(a) - int(r)) == 1
    ]
    assert len(matching) == 10 and len(others) == 100 and len(near_misses) == 18
    for right in (matching, others, near_misses):
        assert sum(right) / len(right) >= AGREEMENT, [
            (pair, outcome.value) for pair, outcome in zip(pairs, outcomes)
        ]


@pytest.mark.slow
def test_a_training_run_with_the_judge_agrees_with_exact_match(judge_directory, tmp_path):
    words = documented_run(judge_directory)
    output_dir = Path(next(w for w in words if w.startswith("output_dir=")).split("=", 1)[1])
    launch = start([sys.executable, "-m", "megatron_gspo.train", *words], output_dir)
    assert launch.wait(600) == 0, tail(launch.log)
    records = read_metrics(output_dir)
    assert [record["step"] for record in records] == [0, 1]
    for record in records:
        for key in ("judge_latency_s", "judge_calls", "judge_failures", "judge_timeouts"):
            assert key in record, sorted(record)
        assert record["judge_failures"] == 0 and record["judge_timeouts"] == 0
        assert "reward_judge_mean" in record and "reward_exact_match_mean" in record
    # Each sample's reward is exact_match + 0.5 * judge (reward.judge.weight=0.5 in the
    # command), both 0 or 1: the two verdicts are read back from the recorded reward, and exact
    # match is also recomputed from the recorded tokens.
    tokenizer = build_synthetic_tokenizer()
    prompts = {f"{answer}<sep>": answer for answer in digit_judge.ANSWERS}
    agree = total = matches = 0
    for step in (0, 1):
        batch = read_recorded_batch(rollouts_directory(output_dir), step)
        for sample in batch.samples:
            tokens = sample.tokens.tolist()
            prompt = tokenizer.decode(tokens[: sample.prompt_length])
            response = tokenizer.decode(tokens[sample.prompt_length :], skip_special_tokens=True)
            exact = float(response == prompts[prompt])
            judged = (sample.reward - exact) / 0.5
            assert judged in (0.0, 1.0), (sample.reward, exact)
            agree += judged == exact
            matches += exact == 1.0
            total += 1
    assert total == 2 * 8 * 8
    # A judge that always said "no" must not pass: the run has matching samples too.
    assert matches > 0
    assert agree / total >= AGREEMENT, (agree, total, matches)
