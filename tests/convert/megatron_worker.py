"""One rank of the Megatron side of the conversion tests (one process, or torchrun).

``--plan`` is a JSON list of runs ``{"name", "architecture", "tp", "pp", "ep", "etp", "train",
"bias_update_rate"}`` (layout keys default to 1; ``bias_update_rate`` sets GLM-4.5's
``model.moe_router_bias_update_rate``); each run re-initialises the parallel layout and, for the HF
directory ``--hf-root/<architecture>`` (written by ``tiny_models.write_all``):

1. builds the policy and loads the HF weights (:func:`load_hf_weights`, each rank reading only
   its tensors); with ``train``, inside a :class:`TrainEngine` that then takes one GSPO optimizer
   step on random samples, recording the full Megatron weights before and after it;
2. with pp = 1, runs a forward on the reference input ids and keeps the full ``[B, S, V]``
   logits (hidden states times the output weight, gathered over sequence and vocab parallel);
3. streams the whole model back to HF names (:func:`iter_hf_weights`) and keeps what rank 0
   received; exports it as an HF directory from the live model (:func:`export_hf_checkpoint`);
4. saves a Megatron ``torch_dist`` checkpoint of the weights (``<name>_ckpt/``); with ``train``,
   a full training checkpoint with the engine's ``save_checkpoint`` (``<name>_root/step_000001``).

Outputs under ``--out``: ``<name>.pt`` = {"logits", "hf_weights", "load_report", "before",
"after"}, ``<name>_live_export/`` and the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def forward_logits(chunks, tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, S, V]`` fp32 logits of a pp = 1 policy on every rank."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import (
        gather_from_sequence_parallel_region,
        gather_from_tensor_model_parallel_region,
    )

    (model,) = chunks
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        hidden = model(input_ids=tokens, position_ids=positions, attention_mask=None)  # [s, b, h]
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        local_logits = hidden @ model.output_weight.T  # [s, b, V_pad / tp]
        logits = gather_from_tensor_model_parallel_region(local_logits)
    return logits[..., :vocab_size].transpose(0, 1).float().contiguous()


def train_config(model, parallel):
    """GSPO, one optimizer step per call, old log-probs = current (detach): a plain update."""
    from megatron_gspo.config import AlgoConfig, OptimConfig, TrainConfig

    algo = AlgoConfig(
        old_log_prob_source="detach",
        rollout_batch_size=2,
        num_return_sequences_in_group=2,
        num_mini_batches=1,
    )
    return TrainConfig(model=model, parallel=parallel, algo=algo, optim=OptimConfig(lr=1e-2))


def random_samples(vocab_size: int):
    """Four sequences over a quarter of the vocabulary (the other embedding rows get no
    gradient), advantages of both signs."""
    from megatron_gspo.samples import TrainSample

    generator = torch.Generator().manual_seed(11)
    samples = []
    for index, advantage in enumerate((1.0, -1.0, 0.5, -0.5)):
        tokens = torch.randint(0, vocab_size // 4, (10 + index,), generator=generator)
        samples.append(
            TrainSample(
                tokens=tokens,
                prompt_length=4,
                group_id=index // 2,
                advantages=torch.tensor(advantage),
            )
        )
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hf-root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plan", type=json.loads, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from megatron_gspo.config import ModelConfig, ParallelConfig, TrainConfig
    from megatron_gspo.convert.hf_config import resolve_model_config
    from megatron_gspo.engine.checkpoint import save_checkpoint
    from megatron_gspo.engine.hf_import_export import (
        export_hf_checkpoint,
        iter_full_megatron_weights,
        iter_hf_weights,
        load_hf_weights,
        save_torch_dist_weights,
    )
    from megatron_gspo.engine.model import build_policy_model
    from megatron_gspo.engine.parallel import destroy_parallel, initialize_parallel
    from megatron_gspo.engine.train_step import TrainEngine
    from megatron_gspo.rollout import sync_weights_paused
    from megatron_gspo.rollout.embedded import EmbeddedEngine

    try:
        for run in args.plan:
            name, hf_dir = run["name"], args.hf_root / run["architecture"]
            overrides = {}
            if "bias_update_rate" in run:
                overrides["moe_router_bias_update_rate"] = run["bias_update_rate"]
            model = resolve_model_config(ModelConfig(hf_path=str(hf_dir), **overrides))
            layout = {key: run.get(key, 1) for key in ("tp", "pp", "ep", "etp")}
            parallel = ParallelConfig(**layout)
            cfg = TrainConfig(model=model, parallel=parallel)
            destroy_parallel(destroy_process_group=False)
            state = initialize_parallel(parallel, seed=cfg.seed)
            if run.get("train"):
                cfg = train_config(model, parallel)
                engine = TrainEngine(cfg, parallel=state)
                chunks = engine.policy_chunks
            else:
                chunks = build_policy_model(cfg, state, routing_replay=False)
            report = load_hf_weights(chunks, str(hf_dir), cfg)
            result = {"load_report": vars(report)}
            if run.get("train"):
                result["before"] = dict(iter_full_megatron_weights(chunks, dst=0))
                metrics = engine.train_step(random_samples(model.vocab_size))
                assert metrics["skipped"] == 0.0 and metrics["grad_norm"] > 0, metrics
                result["after"] = dict(iter_full_megatron_weights(chunks, dst=0))
            if parallel.pp == 1:
                reference = torch.load(hf_dir / "reference.pt")
                result["logits"] = forward_logits(chunks, reference["input_ids"], model.vocab_size)
            received = {}
            for hf_name, tensor in iter_hf_weights(chunks, cfg, dst=0):
                assert hf_name not in received, f"{hf_name} streamed twice"
                received[hf_name] = tensor.clone()
            result["hf_weights"] = received
            # The weight sync of the RL loop: the gathered stream goes into the rollout engine,
            # whose weights must then equal the trainer's bit for bit.
            rollout_engine = EmbeddedEngine(model, seed=1)
            streamed = iter_hf_weights(chunks, cfg, dst=0)
            if state.rank == 0:
                stats = sync_weights_paused(rollout_engine, streamed, version=1)
                result["engine_weights"] = {k: v.clone() for k, v in rollout_engine.hf_state()}
                result["sync_stats"] = {"tensors": stats.num_tensors, "bytes": stats.num_bytes}
            else:
                for _ in streamed:  # gathering is collective: every rank drains the stream
                    pass
            export_hf_checkpoint(
                chunks, cfg, str(args.out / f"{name}_live_export"), origin_hf=str(hf_dir)
            )
            if run.get("train"):
                # A training checkpoint (optimizer state, RNG, checkpoint.json) of the engine.
                save_checkpoint(engine, str(args.out / f"{name}_root"), step=1)
            else:
                save_torch_dist_weights(chunks, str(args.out / f"{name}_ckpt"))
            if state.rank == 0:
                torch.save(result, args.out / f"{name}.pt")
            dist.barrier()
    finally:
        destroy_parallel()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
