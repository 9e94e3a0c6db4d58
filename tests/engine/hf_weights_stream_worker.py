"""The trainer's HF weight stream at tp = 1 (run in a fresh process by test_hf_weights_stream.py).

For an untied MoE and a tied dense model: ``iter_hf_weights`` yields views of the live
parameters (no clones) as a ``StableTensorStream``; ``iter_full_megatron_weights`` still clones
by default; the embedded engine loaded from the stream by reference (``borrow=True``) equals the
trainer bit for bit and keeps its weights when the trainer then takes an optimizer step (the
commit copied them; nothing aliases). Prints one JSON object ``{case: {check: value}}``.
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

from megatron_gspo.engine.hf_import_export import iter_full_megatron_weights, iter_hf_weights  # noqa: E402
from megatron_gspo.engine.parallel import destroy_parallel  # noqa: E402
from megatron_gspo.engine.train_step import TrainEngine  # noqa: E402
from megatron_gspo.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_gspo.rollout.weight_loader import HFWeightLayout  # noqa: E402
from megatron_gspo.weight_sync import StableTensorStream  # noqa: E402


def storages(tensors) -> set[int]:
    return {tensor.untyped_storage().data_ptr() for tensor in tensors}


def run_case(case: str) -> dict:
    destroy_parallel(destroy_process_group=False)
    cfg = make_config(case, "", 10_000)
    engine = TrainEngine(cfg)
    chunks = engine.policy_chunks
    parameter_storages = storages(p for chunk in chunks for p in chunk.parameters())

    stream = iter_hf_weights(chunks, cfg)
    streamed = list(stream)
    clones = dict(iter_full_megatron_weights(chunks))
    snapshot = {name: tensor.clone() for name, tensor in clones.items()}
    rollout = EmbeddedEngine(cfg.model, seed=3)
    num_tensors, num_bytes = HFWeightLayout(rollout.hf_model).load(
        iter_hf_weights(chunks, cfg), borrow=True
    )
    synced = {name: tensor.clone() for name, tensor in rollout.hf_state()}
    expected = {name: tensor.clone() for name, tensor in streamed}

    metrics = engine.train_step(make_samples())
    after = {name: tensor.clone() for name, tensor in iter_hf_weights(chunks, cfg)}
    changed = [name for name in expected if not torch.equal(after[name], expected[name])]
    return {
        "stable_stream": isinstance(stream, StableTensorStream),
        "tensors": len(streamed),
        # q/k/v are regrouped out of Megatron's interleaved qkv (a reshape that must copy).
        "not_views_of_parameters": [
            name
            for name, tensor in streamed
            if tensor.untyped_storage().data_ptr() not in parameter_storages
        ],
        "clones_share_no_storage": not (storages(clones.values()) & parameter_storages),
        "synced_names_match": sorted(synced) == sorted(expected),
        "synced_bit_equal": all(torch.equal(synced[n], expected[n]) for n in expected),
        "sync_counts": [num_tensors, num_bytes],
        "stream_bytes": sum(t.numel() * t.element_size() for t in expected.values()),
        "step_skipped": metrics["skipped"],
        "trainer_tensors_changed_by_step": len(changed),
        "rollout_unchanged_by_step": all(
            torch.equal(tensor, synced[name]) for name, tensor in rollout.hf_state()
        ),
        "clones_unchanged_by_step": all(torch.equal(clones[n], snapshot[n]) for n in snapshot),
    }


def main() -> None:
    torch.set_num_threads(1)
    print(json.dumps({case: run_case(case) for case in ("moe", "dense")}))


if __name__ == "__main__":
    main()
