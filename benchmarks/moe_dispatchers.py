"""Megatron's two MoE token dispatchers on one process, interleaved in one process on the
``TrainEngine`` of a vs-TRL size: their numbers (which must be equal bit for bit) and the CPU
time of a training step with each.

Without any split (tp = ep = etp = pp = cp = 1) the alltoall dispatcher still computes its
all-to-all metadata, runs two all-to-all autograd functions per direction over a group of one and
sorts the expert chunks; the allgather dispatcher permutes the same tokens to the same experts
with the same operations and nothing else. ``parallel.moe_token_dispatcher=auto`` (the default)
picks allgather there on CPU.

Two engines from the same seed, one per dispatcher, train the same mini-batches alternately
(forward+backward then the optimizer step, each timed by this process's CPU clock, which the
machine's other jobs disturb much less than wall time); medians over ``--rounds`` rounds of the
``MINI_BATCHES`` mini-batches of one rollout step. The script fails unless every step's loss and
gradient norm, and the weights at the end, are equal.

    python benchmarks/moe_dispatchers.py --size tiny
    python benchmarks/moe_dispatchers.py --size small --rounds 3
"""

from __future__ import annotations

import argparse
import copy
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

DISPATCHERS = ("alltoall", "allgather")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--rounds", type=int, default=15, help="rollout steps (4 mini-batches)")
    args = parser.parse_args()

    import torch

    from megatron_gspo.engine import TrainEngine
    from megatron_gspo.engine.sharding import gather_full_state

    torch.set_num_threads(1)
    engines = {}
    for dispatcher in DISPATCHERS:
        cfg = copy.deepcopy(make_config(args.size))
        cfg.parallel.moe_token_dispatcher = dispatcher
        first = next(iter(engines.values()), None)
        engines[dispatcher] = TrainEngine(cfg, parallel=first.parallel if first else None)
    samples = make_samples(args.size)
    mini = SAMPLES_PER_STEP // MINI_BATCHES
    batches = [samples[i * mini : (i + 1) * mini] for i in range(MINI_BATCHES)]
    times = {name: ([], []) for name in DISPATCHERS}
    for step in range(args.rounds + 1):  # the first is a warm-up
        for batch in batches:
            metrics = {}
            for name, engine in engines.items():
                start = time.process_time()
                forward_backward = engine.forward_backward(batch)
                middle = time.process_time()
                metrics[name] = engine.optimizer_step(forward_backward)
                end = time.process_time()
                if step:
                    times[name][0].append(middle - start)
                    times[name][1].append(end - middle)
            values = {(m["loss"], m["grad_norm"]) for m in metrics.values()}
            if len(values) != 1:
                raise SystemExit(f"the dispatchers' steps differ: {metrics}")
    states = [gather_full_state(engine.model) for engine in engines.values()]
    if any(not torch.equal(states[0][name], states[1][name]) for name in states[0]):
        raise SystemExit("the dispatchers' weights differ after training")
    print(
        f"size {args.size}: {args.rounds * MINI_BATCHES} optimizer steps per dispatcher, "
        "losses, grad norms and weights equal bit for bit; CPU ms per mini-batch (medians)"
    )
    print(f"{'dispatcher':12s} {'fwd+bwd':>10s} {'optimizer':>10s} {'together':>10s}")
    for name, (forward_backward, optimizer) in times.items():
        a, b = statistics.median(forward_backward), statistics.median(optimizer)
        print(f"{name:12s} {a * 1e3:10.2f} {b * 1e3:10.2f} {(a + b) * 1e3:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
