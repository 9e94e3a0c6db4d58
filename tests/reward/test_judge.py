"""The model-graded reward (reward.judge) against a real judge engine: a tiny random qwen3 model
saved as a Hugging Face directory with the synthetic tokenizer, served by the extra models'
embedded engine (megatron_gspo.rollout.roles), read through megatron_gspo.rollout.judge_backend.

A random judge answers random tokens, which is what these tests need: its answers are whatever
the engine generates, so the reward must equal what parsing the engine's own answers gives, an
answer no format can read must be counted as a failure (and retried), and a call past its time
limit must be counted as time-outs.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gspo.config import (
    ConfigError,
    ExtraModelConfig,
    JudgeConfig,
    ModelConfig,
    RewardConfig,
    StartupErrors,
)
from megatron_gspo.config.judge import judge_role_problems
from megatron_gspo.config.loader import load_config
from megatron_gspo.data.tokenizer import build_synthetic_tokenizer
from megatron_gspo.reward import (
    JudgeReward,
    RewardInput,
    RewardRunner,
    parse_judgement,
    render_judge_prompt,
)
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.hf_model import build_hf_model
from megatron_gspo.rollout.judge_backend import EngineJudgeBackend, judge_start_problems
from megatron_gspo.rollout.roles import build_role_engine, role_model_config

JUDGE_MODEL = ModelConfig(
    architecture="qwen3",
    vocab_size=16,
    hidden_size=32,
    num_layers=1,
    num_attention_heads=2,
    num_query_groups=1,
    head_dim=16,
    ffn_hidden_size=64,
    num_experts=0,
    max_position_embeddings=256,
)
# The synthetic tokenizer's digit strings, compared by the judge: reference, then response.
DIGIT_TEMPLATE = "{answer}{response}<sep>"


class CountingEngine(EmbeddedEngine):
    """The embedded engine, counting its generate calls and their requests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, requests, n=1):
        self.calls.append(len(requests))
        return super().generate(requests, n)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge")
    build_hf_model(JUDGE_MODEL, seed=7).save_pretrained(path)
    build_synthetic_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def judge_engine(judge_dir):
    # Built the way a run builds models.judge's engine.
    engine = build_role_engine("judge", ExtraModelConfig(hf_path=judge_dir))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def counting_engine(judge_dir):
    engine = CountingEngine(role_model_config(ExtraModelConfig(hf_path=judge_dir)))
    engine.load_weights_from_directory(judge_dir, version=0)
    yield engine
    engine.close()


def digit_samples(count: int) -> list[RewardInput]:
    generator = torch.Generator().manual_seed(3)
    samples = []
    for index in range(count):
        answer = "".join(map(str, torch.randint(0, 10, (8,), generator=generator).tolist()))
        response = answer if index % 2 == 0 else answer[::-1]
        samples.append(RewardInput(prompt=answer + "<sep>", response=response, answer=answer))
    return samples


def judge_config(**overrides) -> JudgeConfig:
    settings = dict(
        role="judge",
        template=DIGIT_TEMPLATE,
        chat_template=False,
        format="score",
        score_min=0.0,
        score_max=9.0,
        max_new_tokens=3,
        max_retries=1,
        timeout_s=60.0,
    )
    return JudgeConfig(**{**settings, **overrides})


def test_scores_are_the_engines_parsed_answers_from_one_call_per_round(counting_engine):
    judge = judge_config()
    tokenizer = build_synthetic_tokenizer()
    backend = EngineJudgeBackend(counting_engine, tokenizer, judge)
    samples = digit_samples(12)
    outcomes, metrics = JudgeReward(judge, backend).score(samples)

    # Each sample's judgement alone, greedy: the same answer as in the batch.
    expected = []
    for sample in samples:
        [reply] = backend.complete([render_judge_prompt(judge.template, sample)], 60.0)
        expected.append(parse_judgement(reply.text, judge))
    failed = [index for index, value in enumerate(expected) if value is None]
    assert [o.value for o in outcomes if o.status == "ok"] == [
        value for value in expected if value is not None
    ]
    assert [i for i, o in enumerate(outcomes) if o.status != "ok"] == failed
    # One batched call for the 12 samples, then one for those that failed (if any), then the
    # 12 single checks above.
    rounds = 1 + bool(failed)
    assert counting_engine.calls[:rounds] == [12] + ([len(failed)] if failed else [])
    assert metrics["judge_calls"] == rounds
    assert metrics["judge_retries"] == len(failed)
    assert metrics["judge_failures"] == len(failed)
    assert metrics["judge_latency_s"] > 0


def test_unparsable_answers_are_retried_then_counted_as_failures(judge_dir, judge_engine):
    # The synthetic vocabulary cannot spell "yes" or "no": every answer is unparsable.
    judge = judge_config(format="verdict", max_retries=2)
    config = RewardConfig(functions=[], failure_reward=-1.0, judge=judge)
    backend = EngineJudgeBackend(judge_engine, build_synthetic_tokenizer(), judge)
    samples = digit_samples(4)
    with RewardRunner(config, backend) as runner:
        result = runner.score(samples)
    assert result.rewards == [-1.0] * 4
    assert result.metrics["reward_errors"] == 4
    assert result.metrics["reward_judge_mean"] == -1.0
    assert result.metrics["reward_functions_all_failed"] == 1
    assert result.metrics["judge_calls"] == 3
    assert result.metrics["judge_retries"] == 8
    assert result.metrics["judge_unparsable"] == 12
    assert result.metrics["judge_failures"] == 4
    assert {failure.function for failure in result.failures} == {"judge"}
    assert all("unparsable judge answer" in failure.message for failure in result.failures)


def test_a_call_past_its_time_limit_counts_time_outs(judge_engine):
    judge = judge_config(max_new_tokens=200, timeout_s=0.01, max_retries=0)
    config = RewardConfig(functions=[], judge=judge)
    backend = EngineJudgeBackend(judge_engine, build_synthetic_tokenizer(), judge)
    # No stop token: every answer runs to its 200 tokens, far past 10 ms.
    backend.stop_token_ids = ()
    with RewardRunner(config, backend) as runner:
        result = runner.score(digit_samples(4))
    assert result.metrics["reward_timeouts"] == 4
    assert result.metrics["judge_timeouts"] == 4
    assert result.metrics["judge_failures"] == 4
    assert all(failure.kind == "timeout" for failure in result.failures)
    # The aborted requests left the engine: it judges again at once.
    assert judge_engine.num_running == 0


def test_judge_adds_its_weighted_score_to_the_functions(counting_engine):
    judge = judge_config(weight=0.5, max_retries=0)
    config = RewardConfig(functions=["exact_match"], executor="thread", judge=judge)
    backend = EngineJudgeBackend(counting_engine, build_synthetic_tokenizer(), judge)
    samples = digit_samples(6)
    with RewardRunner(config, backend) as runner:
        result = runner.score(samples)
    for index in range(len(samples)):
        judged = result.scores["judge"][index]
        exact = result.scores["exact_match"][index]
        assert exact == (1.0 if index % 2 == 0 else 0.0)
        assert result.rewards[index] == pytest.approx(exact + 0.5 * judged)


@pytest.mark.parametrize(
    ("text", "settings", "expected"),
    [
        ("Yes, it matches.", {}, 1.0),
        ("no", {}, 0.0),
        ("  NO!", {}, 0.0),
        ("maybe yes", {}, None),
        ("", {}, None),
        ("8/10", {"format": "score", "score_min": 0, "score_max": 10}, 0.8),
        ("Score: 3", {"format": "score", "score_min": 1, "score_max": 5}, 0.5),
        ("11", {"format": "score", "score_min": 0, "score_max": 10}, None),
        ("none", {"format": "score"}, None),
        ("1", {"format": "verdict", "verdicts": {"1": 1.0, "0": 0.0}}, 1.0),
    ],
)
def test_parse_judgement(text, settings, expected):
    assert parse_judgement(text, JudgeConfig(**settings)) == expected


def test_config_reports_every_problem_at_once():
    with pytest.raises(StartupErrors) as raised:
        JudgeConfig(
            role="judge", template="{answer} {score}", format="score", score_max=0.0, timeout_s=0
        )
    problems = str(raised.value)
    assert "unknown field(s) {score}" in problems
    assert "does not name {response}" in problems
    assert "score_max=0.0 is not above score_min=0.0" in problems
    assert "reward.judge.timeout_s" in problems
    with pytest.raises(ConfigError, match="malformed template"):
        JudgeConfig(template="{response")
    with pytest.raises(ConfigError, match="not single words"):
        JudgeConfig(verdicts={"looks good": 1.0})


def test_the_judge_role_must_be_an_extra_model(judge_dir):
    problems = judge_role_problems(JudgeConfig(role="judge"), {})
    assert [problem.key for problem in problems] == ["reward.judge.role"]
    with pytest.raises(ConfigError, match="'judge' is not in models"):
        load_config(overrides=["reward.judge.role=judge"])
    cfg = load_config(
        overrides=[
            "reward.judge.role=judge",
            f"models.judge.hf_path={judge_dir}",
            "reward.functions=[]",
        ]
    )
    assert cfg.reward.judge.enabled and judge_start_problems(cfg) == []
    # A runner without the judge's engine cannot score.
    with pytest.raises(ConfigError, match="no engine for the judge role"):
        RewardRunner(cfg.reward)


def test_start_check_needs_the_judges_tokenizer(tmp_path, judge_dir):
    bare = tmp_path / "no_tokenizer"
    bare.mkdir()
    build_hf_model(JUDGE_MODEL, seed=7).save_pretrained(bare)
    cfg = load_config(overrides=["reward.judge.role=judge", f"models.judge.hf_path={bare}"])
    [problem] = judge_start_problems(cfg)
    assert problem.key == "models.judge.hf_path" and "no tokenizer in" in str(problem)
