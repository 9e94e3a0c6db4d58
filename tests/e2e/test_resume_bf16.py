"""Kill a bf16 run (``model.dtype=bfloat16``) right after a step's checkpoint, resume it, and get
the uninterrupted bf16 run bit for bit.

bf16 on CPU is Megatron's mixed precision (docs/megatron-cpu.md, "bf16 on CPU"): the model's
parameters are bf16 and the optimizer updates fp32 main parameters. At the demo's lr (3e-3) an
update of a weight ~0.02 is ~25 bf16 ulps, so every step leaves a sub-ulp remainder in the fp32
main parameter that the bf16 weights do not hold: a resume that rebuilt the main parameters from
the bf16 weights (instead of the checkpoint's ``optimizer.state.fp32_param``) rounds the next
update differently and moves the later steps' metrics. One process, the cheapest resume
(``test_resume.py``'s one-process test in bf16).
"""

from __future__ import annotations

import pytest

from .harness import TINY, Launch, assert_records_equal, assert_required_metrics, run_train
from .test_resume import kill_and_resume

BF16 = ("model.dtype=bfloat16",)


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory) -> Launch:
    """The uninterrupted bf16 reference: three steps, as the fp32 ``gspo_run``."""
    return run_train(tmp_path_factory.mktemp("gspo_bf16") / "out", ["steps=3", *TINY, *BF16])


def test_kill_and_resume_bf16(bf16_run, tmp_path):
    records, start_step = kill_and_resume(tmp_path / "out", list(BF16), nproc=1)
    assert_required_metrics(records, steps=3)
    reference = bf16_run.metrics()
    for old, new in zip(reference, records):
        assert_records_equal(old, new)
    assert start_step >= 1
