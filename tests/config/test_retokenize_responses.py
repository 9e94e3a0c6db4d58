"""``rollout.retokenize_responses`` refused at start, every problem at once, where it cannot
work: R3, the synthetic task (decode-then-encode is the identity there), episodes, a replayed
run; and a tokenizer that is not byte-level BPE (a start-up check: it needs the tokenizer)."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.config import ConfigError, StartupErrors, TrainConfig, from_dict
from megatron_gspo.data.tokenizer import build_synthetic_tokenizer
from megatron_gspo.startup.preflight import check_before_start


def test_every_combination_that_cannot_work_is_reported_at_once(tmp_path):
    with pytest.raises(StartupErrors) as error:
        from_dict(
            TrainConfig,
            {
                "rollout": {"retokenize_responses": True, "replay_dir": str(tmp_path)},
                "algo": {"routing_replay": "r3"},
                "env": {"name": "single_turn"},
            },
        )
    problems = [str(problem) for problem in error.value.errors]
    assert {problem.key for problem in error.value.errors} == {"rollout.retokenize_responses"}
    assert len(problems) == 4, problems
    assert "algo.routing_replay=r3" in problems[0]
    assert "synthetic task" in problems[1]
    assert "env.name" in problems[2]
    assert "rollout.replay_dir" in problems[3]
    # Alone, the one problem of the synthetic task; with none, R3 is asked for no routes.
    with pytest.raises(ConfigError, match="one token per symbol"):
        from_dict(TrainConfig, {"rollout": {"retokenize_responses": True}})
    config = from_dict(
        TrainConfig,
        {
            "rollout": {"retokenize_responses": True},
            "data": {"train_path": "prompts.jsonl", "tokenizer_path": "tok"},
            "reward": {"functions": ["math"]},
        },
    )
    assert not config.requests_rollout_routes  # the re-encoded tokens were never routed


def test_a_tokenizer_that_is_not_byte_level_is_refused_at_start(tmp_path):
    tokenizer_dir = tmp_path / "word_level"
    build_synthetic_tokenizer().save_pretrained(str(tokenizer_dir))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "12", "answer": "21"}) + "\n")
    config = from_dict(
        TrainConfig,
        {
            "output_dir": str(tmp_path / "run"),
            "rollout": {"retokenize_responses": True},
            "data": {"train_path": str(prompts), "tokenizer_path": str(tokenizer_dir)},
            "reward": {"functions": ["exact_match"]},
        },
    )
    with pytest.raises(StartupErrors) as error:
        check_before_start(config)
    (problem,) = [p for p in error.value.errors if p.key == "rollout.retokenize_responses"]
    assert "not a byte-level BPE tokenizer" in str(problem)
