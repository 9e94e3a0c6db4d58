"""The whole RL loop from the command line, one process: GSPO and GRPO, the SGLang client path,
the three old-log-prob sources, the KL loss against a reference model, evaluation, and
configuration errors.
"""

from __future__ import annotations

import math

import pytest

from .harness import (
    REQUIRED_METRICS,
    TINY,
    assert_records_equal,
    assert_required_metrics,
    run_train,
    train_command,
)


def tensorboard_scalars(output_dir) -> dict[str, list[int]]:
    """Steps logged per scalar tag in ``output_dir/tensorboard``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list((output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {output_dir / 'tensorboard'}"
    accumulator = EventAccumulator(str(output_dir / "tensorboard"))
    accumulator.Reload()
    return {
        tag: [event.step for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_run_logs_required_metrics(loss, gspo_run, grpo_run):
    run = {"gspo": gspo_run, "grpo": grpo_run}[loss]
    records = run.metrics()
    assert_required_metrics(records, steps=len(records))
    assert len(records) == (3 if loss == "gspo" else 2)
    assert all(0 <= r["clip_frac_token"] <= 1 and 0 <= r["clip_frac_seq"] <= 1 for r in records)
    assert all(r["grad_norm"] > 0 and r["kl"] >= 0 for r in records)
    scalars = tensorboard_scalars(run.output_dir)
    for name in REQUIRED_METRICS[1:]:
        assert scalars.get(name) == [r["step"] for r in records], name


def test_grpo_and_gspo_differ_only_after_the_rollout(gspo_run, grpo_run):
    """Same seed: the first rollout is the same; the losses are not (the override took effect)."""
    gspo, grpo = gspo_run.metrics()[0], grpo_run.metrics()[0]
    for key in ("reward_mean", "response_len_mean", "rollout_kl_k3"):
        assert gspo[key] == grpo[key], key
    assert gspo["policy_loss"] != grpo["policy_loss"]


def test_sglang_client_path_matches_the_in_process_engine(gspo_run, tmp_path):
    """``embedded_http``: the SGLang HTTP client against the embedded engine's loopback server,
    weight sync included; the metrics of both steps equal the in-process run's bit for bit."""
    http = run_train(tmp_path / "out", ["steps=2", *TINY, "rollout.engine=embedded_http"])
    records = http.metrics()
    assert_required_metrics(records, steps=2)
    for reference, actual in zip(gspo_run.metrics(), records):
        assert_records_equal(reference, actual)


def test_rollout_log_probs_with_kl_loss(tmp_path):
    """Old log-probs from the rollout engine; KL loss against a reference model, which equals the
    policy until the first optimizer step (one mini-batch: step 0's KL is exactly that one).
    ``routing_change_frac`` needs the recompute forward's routes (config.AlgoConfig docs)."""
    run = run_train(
        tmp_path / "out",
        [
            "steps=2",
            *TINY,
            "algo.old_log_prob_source=rollout",
            "algo.use_kl_loss=true",
            "algo.num_mini_batches=1",
        ],
    )
    records = run.metrics()
    assert_required_metrics(records, steps=2, not_measured=["routing_change_frac"])
    assert records[0]["kl"] < 1e-7, records[0]["kl"]
    assert records[1]["kl"] > 1e-7, records[1]["kl"]
    assert all(r["kl_loss"] >= 0 for r in records)
    assert "rollout_kl_k3" not in records[0]  # old log-probs are the rollout's: nothing to compare


def test_detached_log_probs_with_evaluation(tmp_path):
    """``detach`` (old = current, one optimizer step per rollout) and evaluation every step, after
    a two-step supervised warm-up, whose NLL is logged with the first step."""
    run = run_train(
        tmp_path / "out",
        [
            "steps=2",
            *(override for override in TINY if not override.startswith("sft_warmup_steps")),
            "sft_warmup_steps=2",
            "algo.old_log_prob_source=detach",
            "algo.num_mini_batches=1",
            "eval.interval=1",
            "eval.num_samples=4",
            "data.num_eval_prompts=4",
        ],
    )
    records = run.metrics()
    # No reference model and no trainer forward before the update: `kl` (metrics.headline_metrics)
    # and `routing_change_frac` (config.AlgoConfig.log_routing_change) have nothing to compare.
    assert_required_metrics(records, steps=2, not_measured=["kl", "routing_change_frac"])
    for record in records:
        assert record["ratio_mean"] == 1.0 and record["clip_frac_token"] == 0.0
        for name in ("eval/greedy_accuracy", "eval/pass@1", "eval/pass@4"):
            assert 0.0 <= record[name] <= 1.0, (name, record[name])
        assert record["eval/pass@1"] <= record["eval/pass@4"]
    first, last = records[0]["sft_warmup_nll_first"], records[0]["sft_warmup_nll_last"]
    # Two different batches one small update apart: their order is not asserted.
    assert math.isfinite(first) and math.isfinite(last) and first > 0 and last > 0
    assert first != last
    assert "sft_warmup_nll_first" not in records[1]


def test_unknown_override_exits_2_naming_the_key(tmp_path):
    import subprocess

    from .harness import REPO_ROOT, subprocess_env

    result = subprocess.run(
        train_command(["algo.clip_lwo=0.2", f"output_dir={tmp_path}"]),
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "algo.clip_lwo" in result.stderr and "clip_low" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_layout_error_found_at_run_time_exits_2(tmp_path):
    """Checks that need the world size run inside the engine; they still exit 2, no traceback."""
    run = run_train(tmp_path / "out", ["parallel.tp=2", *TINY], expect_returncode=2, timeout=120)
    assert "config error at 'parallel'" in run.log and "world size 1" in run.log, run.log[-3000:]
    assert "Traceback" not in run.log
