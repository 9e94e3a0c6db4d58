"""Two-step CPU runs with a real training-inference mismatch (``rollout.dtype=bfloat16``): each
rollout correction, R2 against R3, and GSPO on the engine's log-probs; CISPO and GMPO with the
sequence-level corrections in the full run (``SLOW_RUNS``).

The runs start together (one ~15 s start-up each, overlapped) and share the seed, so their
first rollouts are the same samples from the same bf16 engine: the R2 and R3 runs differ at step
0 only in how the trainer routes its old-log-prob forward.
"""

from __future__ import annotations

import pytest
from selected_params import selected_params  # tests/selected_params.py

from .harness import GRPO, TINY, assert_required_metrics, start, tail, train_command

BF16 = ("rollout.dtype=bfloat16",)
# The tiny demo model's bf16 token ratios stay within 1 +- 0.007 (geometric means 1 +- 0.001):
# the bounds below bind on it; the defaults (TIS C = 2, IcePop [0.5, 5]) are for the tails of
# real models and would never act here.
RUNS = {
    "r2_token_truncate": (
        *BF16,
        *GRPO,
        "algo.routing_replay=r2",
        "algo.rollout_correction.level=token",
        "algo.rollout_correction.high=1.001",
    ),
    "r3_token_mask": (
        *BF16,
        *GRPO,
        "algo.routing_replay=r3",
        "algo.rollout_correction.level=token",
        "algo.rollout_correction.mode=mask",
        "algo.rollout_correction.low=0.999",
        "algo.rollout_correction.high=1.001",
    ),
    "cispo_sequence_truncate": (
        *BF16,
        "algo.importance_sampling=token",
        "algo.surrogate=cispo",
        "algo.rollout_correction.level=sequence",
        "algo.rollout_correction.high=1.0005",
    ),
    "gmpo_sequence_mask": (
        *BF16,
        "algo.importance_sampling=token",
        "algo.surrogate=gmpo",
        "algo.rollout_correction.level=sequence",
        "algo.rollout_correction.mode=mask",
        "algo.rollout_correction.low=0.9995",
        "algo.rollout_correction.high=1.0005",
    ),
    "gspo_rollout_log_probs": (*BF16, "algo.old_log_prob_source=rollout"),
}
CORRECTED = [name for name in RUNS if name != "gspo_rollout_log_probs"]
SLOW_RUNS = frozenset({"cispo_sequence_truncate", "gmpo_sequence_mask"})
"""Left to the full run (``--full``): CI's three runs act with a token-level correction on a
real mismatch, and the sequence-level corrections and both surrogates are checked against one
process in every layout by tests/engine/test_layouts.py (their rules, on tensors, in
tests/algo)."""


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, list[dict]]:
    """The runs of the selected tests (CI leaves SLOW_RUNS out), started together."""
    root = tmp_path_factory.mktemp("mismatch")
    selected = {
        name for _, name in selected_params(request, ("test_two_steps_with_a_bf16_engine",), "name")
    }
    launches = {
        name: start(
            train_command(["steps=2", *TINY, *overrides, f"output_dir={root / name}"]),
            root / name,
        )
        for name, overrides in RUNS.items()
        if name in selected or name not in SLOW_RUNS
    }
    records = {}
    for name, launch in launches.items():
        code = launch.wait(timeout=420)
        assert code == 0, f"{name}: exit code {code}\n{tail(launch.log)}"
        records[name] = launch.metrics()
    return records


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_RUNS else name for name in RUNS],
)
def test_two_steps_with_a_bf16_engine(runs, name):
    records = runs[name]
    # Without a recompute forward there is no old-policy routing to compare with and no
    # trainer-vs-engine KL (config.AlgoConfig: old_log_prob_source, log_routing_change).
    absent = ("routing_change_frac", "kl") if name == "gspo_rollout_log_probs" else ()
    assert_required_metrics(records, steps=2, not_measured=absent)
    for record in records:
        assert record["skipped"] == 0.0 and record["grad_norm"] > 0
        if name in CORRECTED:
            # The bf16 engine's log-probs really differ from the fp32 trainer's.
            assert 1e-5 < record["rollout_log_prob_abs_diff"] < 0.1
            assert record["rollout_kl_k3"] > 0 and "rollout_log_ppl_abs_diff" in record
            for suffix in ("ess_token", "ess_seq"):
                assert 0 < record[f"rollout_correction/{suffix}"] <= 1
            assert (
                record["rollout_correction/ratio_min"]
                <= 1
                <= record["rollout_correction/ratio_max"]
            )


def test_each_correction_acts(runs):
    """Truncation and masks bind somewhere in two steps; the weights are those of the mode."""
    for name in CORRECTED:
        if name not in runs:
            continue  # one of SLOW_RUNS, not started in CI's tier
        kind = "masked" if "mask" in name else "truncated"
        acted = [r[f"rollout_correction/{kind}_frac_token"] for r in runs[name]]
        assert max(acted) > 0, (name, acted)


def test_r3_shrinks_the_gap_and_routes_as_the_engine(runs):
    """Same first rollout: R3 replays the engine's routes in the old-log-prob forward, so its
    trainer-vs-engine gap is below R2's, and its training forward uses the engine's experts on
    every (token, layer) pair while R2 (the trainer's own routes) differs on some."""
    r2, r3 = runs["r2_token_truncate"][0], runs["r3_token_mask"][0]
    assert r2["reward_mean"] == r3["reward_mean"]  # the same samples
    assert r3["rollout_log_prob_abs_diff"] < r2["rollout_log_prob_abs_diff"]
    assert r3["routing_mismatch_vs_rollout"] == 0.0
    assert r2["routing_mismatch_vs_rollout"] > 0.0
    # Every replayed MoE layer, in both steps (the demo model's layers are all MoE).
    prefix = "routing_mismatch_vs_rollout/layer_"
    for record in runs["r3_token_mask"]:
        layers = {k: v for k, v in record.items() if k.startswith(prefix)}
        assert len(layers) >= 2 and set(layers.values()) == {0.0}, layers


def test_gspo_trains_on_the_bf16_engines_log_probs(runs):
    """The GSPO paper's recommended path: no recompute forward, the engine's likelihoods as the
    old policy. The first optimizer step's sequence ratios then carry the bf16 mismatch."""
    records = runs["gspo_rollout_log_probs"]
    assert "rollout_log_prob_abs_diff" not in records[0]  # nothing recomputed to compare with
    assert all(r["seq_log_ratio_abs_mean"] > 0 for r in records)
