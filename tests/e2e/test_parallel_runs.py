"""Four processes under torchrun give the one-process run's metrics.

Same seed, so the first rollout is the same token for token; the engine's layout contract
(docs/architecture.md: same loss and gradients as one process, fp32, ~1e-5) then makes every
step-0 metric agree with the one-process run. After the first update the weights differ by
rounding, so step 1 is held to the same rollout and a looser loss tolerance.
"""

from __future__ import annotations

import pytest

from .harness import (
    GRPO,
    LAYOUT_DEPENDENT,
    TINY,
    assert_records_close,
    assert_required_metrics,
    run_train,
)

LAYOUTS = {
    # tp2 x ep2 (dp2): sequence-parallel attention, experts 4 per rank, all-to-all dispatch.
    "gspo-tp2.ep2": (["parallel.tp=2", "parallel.ep=2"], ()),
    # pp2 x ep2 (dp2): one layer per pipeline stage, the loss on the last stage.
    "grpo-pp2.ep2": (["parallel.pp=2", "parallel.ep=2"], GRPO),
}


SLOW_LAYOUTS = {"gspo-tp2.ep2", "grpo-pp2.ep2"}
"""Left to the full run (``--full``): tests/engine/test_layouts.py checks tp2 x ep2 and pp2 x ep2
against one process in CI, and tests/e2e/test_multinode.py runs the whole loop in two processes
under torchrun."""


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
        for name in LAYOUTS
    ],
)
def test_four_processes_match_one(name, gspo_run, grpo_run, tmp_path):
    layout, loss = LAYOUTS[name]
    reference = (grpo_run if loss else gspo_run).metrics()
    run = run_train(tmp_path / "out", ["steps=2", *TINY, *loss, *layout], nproc=4, timeout=300)
    records = run.metrics()
    assert_required_metrics(records, steps=2)
    assert_records_close(reference[0], records[0], rtol=1e-5, atol=1e-6, skip=LAYOUT_DEPENDENT)
    for key in ("reward_mean", "response_len_mean", "routing_change_frac"):
        assert records[1][key] == reference[1][key], key
    for key in ("policy_loss", "grad_norm", "entropy", "clip_frac_token", "clip_frac_seq"):
        assert records[1][key] == pytest.approx(reference[1][key], rel=1e-4, abs=1e-6), key
