"""An agent written only against the ``openai`` client trains through the endpoint: the
example agent (examples/agents/calculator_agent.py) runs every episode, and a GSPO step learns from
them (docs/agentic.md shows this command's overrides). One step (a second ran the same path
again; weight syncs between steps are covered by the other e2e tests); ``seed=1`` gives this
step rewards that differ within a group, hence a real gradient."""

from __future__ import annotations

import json
import math

from megatron_gspo.data.tokenizer import CHATML_TOOLS_TEMPLATE, build_byte_tokenizer

from .harness import TINY, run_train


def test_example_agent_trains_through_the_endpoint(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    build_byte_tokenizer(CHATML_TOOLS_TEMPLATE).save_pretrained(tokenizer_dir)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"What is {a} + {a + 3}?", "answer": str(2 * a + 3)} for a in range(8)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [
        "steps=1",
        "seed=1",
        *TINY,
        "algo.response_length=64",
        f"data.train_path={prompts}",
        f"data.tokenizer_path={tokenizer_dir}",
        "data.apply_chat_template=false",
        "model.vocab_size=260",
        "reward.functions=[]",
        "agent.function=examples.agents.calculator_agent:run_episode",
        "agent.max_tokens_per_turn=8",
        "agent.max_turns=3",
    ]
    run = run_train(tmp_path / "out", overrides, timeout=300)
    records = run.metrics()
    assert [record["step"] for record in records] == [0]
    for record in records:
        assert record["agent/errors"] == 0
        # Every episode is multi-turn: a wrong first answer gets a second try.
        assert record["agent/turns_mean"] > 1
        assert record["agent/samples_per_episode"] == 1
        assert math.isfinite(record["policy_loss"])
    # The digit-counting part of the reward differs between episodes: a real gradient.
    assert records[0]["grad_norm"] > 0
