"""The log-prob kernel's weight gradient through Megatron DDP (run in a fresh process by
test_logprobs.py).

For each model, one ``TrainEngine.forward_backward`` over several micro-batches with the
gradient added straight into ``main_grad`` (the default under DDP), and one with that path turned
off (the ``[V, H]`` gradient handed to autograd, added by DDP's hook), from the same seed. Prints
one JSON object per case: which backward calls took the fused path, the largest norm-relative
gradient difference (all parameters; output layer and embedding alone) and the parameters DDP's
hook left a ``.grad`` on.

* ``moe``: untied embeddings, entropy bonus on (the entropy backward);
* ``dense``: tied embeddings (``zero_out_wgrad``: the embedding's own gradient meets the kernel's
  in the same parameter), entropy off (the log-prob-only backward).
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

from layout_worker import make_config, make_samples  # noqa: E402

from megatron_gspo.engine import logprobs  # noqa: E402
from megatron_gspo.engine.parallel import destroy_parallel  # noqa: E402
from megatron_gspo.engine.sharding import gather_full_state  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402

CASES = {"moe": 0.01, "dense": 0.0}
MICRO_BATCH_TOKENS = 22
"""Several micro-batches per step: the fused path accumulates into a non-zero ``main_grad``."""
CHUNK_TOKENS = 8
"""Several chunks per micro-batch as well (``DEFAULT_CHUNK_SIZE`` caps the default chunk)."""


def gradients(case: str, entropy_coef: float, fused: bool) -> tuple[dict, list[bool], list[str]]:
    """Full gradients after one forward_backward, per weight-gradient backward whether it was
    added into ``main_grad``, and the parameters left with a ``.grad`` (DDP's hook must have
    cleared every one)."""
    destroy_parallel(destroy_process_group=False)
    cfg = make_config(case, "", MICRO_BATCH_TOKENS)
    cfg.algo.entropy_coef = entropy_coef
    engine = TrainEngine(cfg)
    original = logprobs._main_grad_target
    calls = []

    def target(weight):
        main_grad = original(weight) if fused else None
        calls.append(main_grad is not None)
        return main_grad

    logprobs._main_grad_target = target
    try:
        engine.forward_backward(make_samples())
    finally:
        logprobs._main_grad_target = original
    left = [
        name
        for chunk in engine.policy_chunks
        for name, param in chunk.named_parameters()
        if param.grad is not None
    ]
    return gather_full_state(engine.model, grads=True), calls, left


def main() -> None:
    torch.set_num_threads(1)
    logprobs.DEFAULT_CHUNK_SIZE = CHUNK_TOKENS
    report = {}
    for case, entropy_coef in CASES.items():
        fused, fused_calls, left = gradients(case, entropy_coef, fused=True)
        plain, plain_calls, _ = gradients(case, entropy_coef, fused=False)
        assert sorted(fused) == sorted(plain)
        errors = {
            name: ((fused[name] - plain[name]).norm() / plain[name].norm().clamp(min=1e-30)).item()
            for name in plain
        }
        report[case] = {
            "fused_calls": fused_calls,
            "plain_calls": plain_calls,
            "max_relative_error": max(errors.values()),
            "output_layer_error": max(
                error
                for name, error in errors.items()
                if "output_layer" in name or "word_embeddings" in name
            ),
            "grads_left_on_params": left,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
