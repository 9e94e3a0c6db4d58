"""Upstream against our CPU speed shims 14 and 15 (``engine/compat.py``), in one process on the
``TrainEngine`` of a vs-TRL size, interleaved: the numbers each returns, and their CPU time.

* shim 14, ``finalize_model_grads.reset_model_temporary_tensors``: upstream walks every module of
  the model once per optimizer step (after the last micro-batch's backward); the shim skips the
  walk when neither expert bias nor a global aux loss is configured (the walk then does nothing);
* shim 15, the optimizer's ``get_grad_norm``: upstream all-reduces the squared norm over the
  model-parallel group (gloo: a hand-off to its worker thread) and unwraps each gradient under a
  no-grad context; over a group of one the shim returns upstream's local norm without the
  all-reduce. Timed as the whole ``optimizer.get_grad_norm()`` of the engine (every
  sub-optimizer), with the module's function swapped between upstream and the shim.

Each round times ``--calls`` calls of upstream then of the shim by this process's CPU clock (the
machine's other jobs disturb it much less than wall time); medians over ``--rounds`` rounds. The
grad norms must be equal bit for bit, or the script fails.

    python benchmarks/cpu_shims.py --size tiny
    python benchmarks/cpu_shims.py --size medium --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
for _path in (str(BENCHMARKS), str(BENCHMARKS.parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from train_step_profile import (  # noqa: E402
    MINI_BATCHES,
    SAMPLES_PER_STEP,
    make_config,
    make_samples,
)
from vs_trl_job import SIZES  # noqa: E402


def per_call(function, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        function()
    return (time.process_time() - start) / calls


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()

    import torch
    from megatron.core.utils import get_model_config

    from megatron_gspo.engine import TrainEngine

    torch.set_num_threads(1)
    engine = TrainEngine(make_config(args.size))
    samples = make_samples(args.size)
    # One mini-batch's gradients, made ready as the optimizer step does before the norm (the
    # step itself is left out: it would zero them).
    engine.forward_backward(samples[: SAMPLES_PER_STEP // MINI_BATCHES])
    engine.optimizer.prepare_grads()
    finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")
    reset_shim = finalize.reset_model_temporary_tensors
    norm_shim = optimizer_module.get_grad_norm_fp32
    if not (getattr(reset_shim, "_cpu_shim", False) and getattr(norm_shim, "_cpu_shim", False)):
        raise SystemExit("the CPU shims are not applied (is CUDA present?)")
    config = get_model_config(engine.model[0])
    modules = sum(1 for chunk in engine.model for _ in chunk.modules())

    def norm_with(function) -> float:
        optimizer_module.get_grad_norm_fp32 = function
        try:
            return float(engine.optimizer.get_grad_norm())
        finally:
            optimizer_module.get_grad_norm_fp32 = norm_shim

    upstream_norm, shim_norm = norm_with(norm_shim.__wrapped__), norm_with(norm_shim)
    if upstream_norm != shim_norm or not upstream_norm > 0.0:
        raise SystemExit(f"grad norm differs: upstream {upstream_norm!r}, shim {shim_norm!r}")

    cases = {
        "reset_model_temporary_tensors": (
            lambda: reset_shim.__wrapped__(config, engine.model),
            lambda: reset_shim(config, engine.model),
        ),
        "optimizer.get_grad_norm": (
            lambda: norm_with(norm_shim.__wrapped__),
            lambda: norm_with(norm_shim),
        ),
    }
    times = {name: ([], []) for name in cases}
    for _ in range(args.rounds):
        for name, (upstream, shim) in cases.items():
            times[name][0].append(per_call(upstream, args.calls))
            times[name][1].append(per_call(shim, args.calls))
    print(
        f"size {args.size}: {modules} modules, grad norm {shim_norm!r} (upstream and shim equal); "
        f"CPU us per call, medians of {args.rounds} rounds x {args.calls} calls"
    )
    print(f"{'per optimizer step':32s} {'upstream':>10s} {'shim':>10s} {'saved':>10s}")
    for name, (upstream, shim) in times.items():
        before, after = statistics.median(upstream), statistics.median(shim)
        print(f"{name:32s} {before * 1e6:10.1f} {after * 1e6:10.1f} {(before - after) * 1e6:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
