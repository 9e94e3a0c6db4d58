"""Guards that stop a run that can no longer learn (megatron_gspo.runtime.health), from the command line:
exit code 3, the reason, no traceback, and no step trained on after the stop."""

from __future__ import annotations

import json

import pytest

from megatron_gspo.data import build_byte_tokenizer
from megatron_gspo.runtime.health import EXIT_CODE

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


def test_collapsed_policy_stops_the_run(tmp_path):
    """optim.lr=1e6 kills the policy in its first optimizer step (entropy at log V, gradient
    norm 0 from then on); the run used to exit 0 after training a dead model to the end."""
    overrides = ["steps=20", *TINY, "optim.lr=1e6", "optim.max_collapsed_steps=2"]
    run = run_train(tmp_path / "out", overrides, expect_returncode=EXIT_CODE, timeout=240)
    log = run.log
    assert "run stopped: the policy has collapsed" in log, log[-3000:]
    assert "2 RL steps in a row" in log and "optim.lr=1e+06" in log
    assert "Traceback" not in log
    # Step 0's first update still had a gradient; steps 1 and 2 had none: stopped in step 2.
    records = run.metrics()
    assert [record["step"] for record in records] == [0, 1]
    assert records[0]["grad_norm_max"] > 0
    assert records[1]["grad_norm_max"] == 0.0 and records[1]["advantage_abs_mean"] > 0


def collapsed(**overrides) -> dict:
    return {"grad_norm_max": 0.0, "advantage_abs_mean": 0.7, "clip_frac_seq": 0.0, **overrides}


def test_collapse_guard_counts_only_unexplained_zero_gradients():
    from megatron_gspo.runtime.health import CollapseGuard, PolicyCollapsedError

    guard = CollapseGuard(3, vocab_size=16, lr=1e6)
    guard.check(collapsed())
    guard.check(collapsed())
    guard.check(collapsed(grad_norm_max=1e-9))  # any gradient: alive, the count restarts
    assert guard.consecutive == 0
    for explained in (collapsed(advantage_abs_mean=0.0), collapsed(clip_frac_seq=1.0), {}):
        guard.check(explained)  # nothing to learn from, everything clipped, nothing measured
        assert guard.consecutive == 0
    guard.check(collapsed())
    guard.check(collapsed())
    with pytest.raises(PolicyCollapsedError, match=r"log\(16\) = 2.773"):
        guard.check(collapsed(entropy=2.7725))

    never = CollapseGuard(0, vocab_size=16, lr=1e6)
    for _ in range(10):
        never.check(collapsed())
