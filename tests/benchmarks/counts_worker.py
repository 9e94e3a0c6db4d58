"""Runs one-step RL loops in this process and records what ``test_counts.py`` checks.

For each scenario (a list of config overrides) it counts, through forward hooks registered on
the engine's own policy and reference chunks right after the engine is built:

* ``policy_grad``: policy forwards with autograd on (the training forwards),
* ``policy_no_grad``: policy forwards without autograd (the old-log-prob recompute),
* ``reference``: reference-model forwards,

and records every optimizer step's metrics, and every weight sync into the embedded rollout
engine (the names and bytes of the streamed tensors and the engine's ``SyncStats``). The
tensors of the last sync are saved (safetensors) so the test can bucket the real stream.

    python tests/benchmarks/counts_worker.py OUT_DIR
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

# Pinned rather than left to the schema defaults (the CPU demo's, which change with it).
BASE = [
    "steps=1",
    "seed=7",
    "sft_warmup_steps=0",
    "data.task=digit_reversal",
    "model.vocab_size=64",
    "parallel.micro_batch_tokens=4096",
    "algo.rollout_batch_size=4",
    "algo.num_return_sequences_in_group=4",
    "algo.response_length=8",
    "reward.executor=thread",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "logging.log_level=WARNING",
]
SCENARIOS = {
    # GSPO as the paper runs it: rollout log-probs, 4 optimizer steps per rollout batch, no KL.
    "rollout": ["algo.old_log_prob_source=rollout", "algo.num_mini_batches=4"],
    # One optimizer step per rollout batch: old = current, detached.
    "detach": ["algo.old_log_prob_source=detach", "algo.num_mini_batches=1"],
    # The baseline: a recompute forward and a KL term against the reference model.
    "recompute_kl": [
        "algo.old_log_prob_source=recompute",
        "algo.use_kl_loss=true",
        "algo.num_mini_batches=2",
    ],
}


def run_scenario(name: str, overrides: list[str], out_dir: Path) -> dict:
    from megatron_gspo import loop
    from megatron_gspo.config.loader import load_config
    from megatron_gspo.engine.train_step import TrainEngine
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    counts: Counter = Counter()
    step_metrics: list[dict] = []
    syncs: list[dict] = []
    model_bytes: dict[str, int] = {}
    last_stream: dict[str, torch.Tensor] = {}

    def counter(kind: str):
        def hook(module, inputs, output):
            if kind == "reference":
                counts["reference"] += 1
            else:
                counts["policy_grad" if torch.is_grad_enabled() else "policy_no_grad"] += 1

        return hook

    original_init = TrainEngine.__init__
    original_step = TrainEngine.train_step
    original_sync = EmbeddedEngine.sync_weights

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        for chunk in self.policy_chunks:
            chunk.register_forward_hook(counter("policy"))
        for chunk in self.reference_model or []:
            chunk.register_forward_hook(counter("reference"))
        model_bytes["trainer"] = sum(
            p.numel() * p.element_size() for chunk in self.policy_chunks for p in chunk.parameters()
        )

    def train_step(self, samples):
        metrics = original_step(self, samples)
        step_metrics.append({k: float(v) for k, v in metrics.items()})
        return metrics

    def sync_weights(self, named_tensors, version):
        streamed: list[tuple[str, int]] = []
        last_stream.clear()

        def tee():
            for tensor_name, tensor in named_tensors:
                streamed.append((tensor_name, tensor.numel() * tensor.element_size()))
                last_stream[tensor_name] = tensor.detach().clone().contiguous()
                yield tensor_name, tensor

        stats = original_sync(self, tee(), version)
        model_bytes["rollout"] = sum(
            p.numel() * p.element_size() for p in self.hf_model.parameters()
        )
        syncs.append(
            {
                "version": version,
                "names": [n for n, _ in streamed],
                "bytes": sum(b for _, b in streamed),
                "rollout_disk_names": [n for n, _ in self.hf_state()],
                "stats": {
                    "num_tensors": stats.num_tensors,
                    "num_bytes": stats.num_bytes,
                    "num_buckets": stats.num_buckets,
                },
            }
        )
        return stats

    TrainEngine.__init__, TrainEngine.train_step = init, train_step
    EmbeddedEngine.sync_weights = sync_weights
    try:
        config = load_config(None, BASE + overrides + [f"output_dir={out_dir / name}"])
        records = loop.run(config)
    finally:
        TrainEngine.__init__, TrainEngine.train_step = original_init, original_step
        EmbeddedEngine.sync_weights = original_sync

    from safetensors.torch import save_file

    save_file(last_stream, str(out_dir / f"{name}_stream.safetensors"))
    return {
        "counts": dict(counts),
        "optimizer_steps": len(step_metrics),
        "micro_batches": [m["num_micro_batches"] for m in step_metrics],
        "records": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in records],
        "syncs": syncs,
        "model_bytes": model_bytes,
    }


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    results = {
        name: run_scenario(name, overrides, out_dir) for name, overrides in SCENARIOS.items()
    }
    (out_dir / "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
