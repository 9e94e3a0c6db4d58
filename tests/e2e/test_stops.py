"""Guards that stop a run that can no longer learn (megatron_gspo.health), from the command line:
exit code 3, the reason, no traceback, and no step trained on after the stop."""

from __future__ import annotations

import json

from megatron_gspo.data import build_byte_tokenizer
from megatron_gspo.health import EXIT_CODE

from .harness import TINY, run_train


def test_prompt_file_with_the_demo_reward_warns_then_stops(tmp_path):
    """The issue's case: the user's prompts (here without answers) with the default synthetic
    reward. It warns at start; the reward raises on every sample; the run stops at the second
    step instead of training on zeros to the end."""
    tokenizer_dir = tmp_path / "tokenizer"
    build_byte_tokenizer().save_pretrained(tokenizer_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    overrides = [
        "steps=20",
        *TINY,
        f"data.train_path={prompts}",
        f"data.tokenizer_path={tokenizer_dir}",
        "data.apply_chat_template=false",
        "model.vocab_size=260",
        "reward.max_failed_steps=2",
    ]
    run = run_train(tmp_path / "out", overrides, expect_returncode=EXIT_CODE, timeout=240)
    log = run.log
    assert "synthetic digit reward" in log, log[-3000:]  # the warning at start
    assert "run stopped: reward 'synthetic' failed on every sample of 2 batches" in log
    assert "needs the answer digits" in log  # the reward's own error, quoted
    assert "Traceback" not in log
    assert [record["step"] for record in run.metrics()] == [0]
