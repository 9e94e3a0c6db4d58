"""Worker for the checkpoint tests (one process, or under torchrun). Rank 0 writes what it
measured to ``--out/<phase>.json``; checkpoints and full weights go under ``--out`` too.

Model: tiny Qwen2-MoE shape with a dense first layer (a pipeline stage without experts has no
expert optimizer) and tied embeddings (a tied copy on the last stage under pp); AdamW with weight
decay, warm-up and cosine decay (a wrong restored step count changes the lr). Each engine runs the
same four mini-batches; checkpoints are taken after two optimizer steps.

Phases (run in this order; each reads the checkpoints of the earlier ones):

* ``one`` (1 process): save; exact resume; directory handling (interrupted saves, ``latest``,
  ``keep_last``); clear errors; RNG restore; keys equal to Megatron's own optimizer format;
  weights-only loads.
* ``four`` (4 processes): tp2.ep2 and tp2.ep2 + distributed optimizer: save, exact resume; load
  the 1-process checkpoint.
* ``two`` (2 processes): pp2 loads the tp2.ep2 checkpoint; pp2 and dp2 + distributed optimizer:
  save, exact resume; dp2 loads the tp2.ep2 distributed-optimizer checkpoint.
* ``last`` (1 process): loads the tp2.ep2 (both optimizers) and pp2 checkpoints.

Resharding a distributed-optimizer checkpoint (each load also compares the optimizer's fp32 main
parameters and Adam moments, gathered by name, with the saved ones): ``four`` saves at ep2 on 4
processes (dense dp4, experts ep2 x expert-dp2) and loads it at ep4; ``two`` at tp2 and pp2;
``last`` in one process. bf16: ``two`` saves at dp2 with the distributed optimizer and loads at
pp2, ``last`` in one process and saves what the trainer holds for the HF export test. The slow
tier's ``bf16_four`` (4 processes) saves bf16 at ep2 and loads at ep4, ``bf16_two`` at tp2.

Heavy imports stay inside functions: ``dist_checkpointing`` starts "spawn" processes, which
re-import this module.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path

VOCAB = 64
SAVE_AFTER = 2
CONTINUE = 2


def make_config(layout: str):
    """A layout such as ``tp2.ep2.distopt``; a ``bf16`` part sets ``model.dtype=bfloat16``."""
    from layout_worker import MODELS, parallel_overrides

    from megatron_gspo.config import TrainConfig, from_dict

    parts = layout.split(".")
    dtype = "bfloat16" if "bf16" in parts else "float32"
    layout = ".".join(part for part in parts if part != "bf16")
    return from_dict(
        TrainConfig,
        dict(
            seed=11,
            steps=SAVE_AFTER + CONTINUE + 2,
            # The layout tests' Qwen2-MoE (bias, shared expert, a dense layer), tied embeddings.
            model=dict(
                vocab_size=VOCAB,
                hidden_size=64,
                head_dim=16,
                **MODELS["qwen2"],
                tie_word_embeddings=True,
                dtype=dtype,
            ),
            parallel=parallel_overrides(layout, micro_batch_tokens=60),
            algo=dict(
                rollout_batch_size=2,
                num_return_sequences_in_group=4,
                num_mini_batches=1,
                clip_low=0.2,
                clip_high=0.2,
                response_length=12,
            ),
            optim=dict(
                lr=1e-3,
                weight_decay=0.1,
                lr_warmup_steps=2,
                lr_decay_style="cosine",
                min_lr=1e-4,
                adam_eps=1e-6,
                clip_grad=1.0,
            ),
            checkpoint=dict(keep_last=2),
        ),
    )


def make_samples(batch: int):
    """8 samples of different lengths; a different batch per optimizer step."""
    import torch

    from megatron_gspo.samples import TrainSample

    generator = torch.Generator().manual_seed(1000 + batch)
    samples = []
    for index in range(8):
        prompt, response = 2 + (index * 3) % 5, 3 + (index * 5 + batch) % 9
        old = -math.log(VOCAB) + 0.05 * torch.randn(response, generator=generator)
        samples.append(
            TrainSample(
                tokens=torch.randint(0, VOCAB, (prompt + response,), generator=generator),
                prompt_length=prompt,
                group_id=index // 4,
                advantages=torch.randn((), generator=generator),
                loss_mask=torch.ones(response, dtype=torch.bool),
                old_log_probs=old,
            )
        )
    return samples


class Run:
    """Engines built one after another in this process (Megatron groups rebuilt each time)."""

    def __init__(self, out: Path):
        import torch.distributed as dist

        self.out = out
        self.dist = dist
        self.report: dict = {}

    def engine(self, layout: str, cfg=None, load_weights=None):
        from megatron_gspo.engine.parallel import destroy_parallel
        from megatron_gspo.engine.train_step import TrainEngine

        if self.dist.is_initialized():
            destroy_parallel(destroy_process_group=False)
        return TrainEngine(cfg or make_config(layout), load_weights=load_weights)

    @property
    def rank(self) -> int:
        return self.dist.get_rank()

    def weights(self, engine) -> dict:
        """Every full one-process tensor of the model, on every rank (a collective)."""
        from megatron_gspo.engine.sharding import gather_full_state

        parts: list = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(parts, gather_full_state(engine.model))
        full: dict = {}
        for part in parts:
            full.update(part)
        return full

    def optimizer_state(self, engine) -> dict:
        """``{"<state>/<global name>": full tensor}`` for the Adam moments (``exp_avg``,
        ``exp_avg_sq``) and the fp32 main parameters (``main``) of every parameter, on every rank
        (a collective). Read from the optimizer's own tensors, not through the checkpoint code:
        the distributed optimizer's ``[start, end)`` spans are summed zero-padded over its
        data-parallel group (each element has one owner: exact), then tp / expert-tp shards are
        joined like the weights."""
        import torch
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        from megatron_gspo.engine.optimizer_state import sub_optimizers
        from megatron_gspo.engine.sharding import gather_full_tensor, iter_global_parameters

        names = ("exp_avg", "exp_avg_sq", "main")
        # id(model parameter) -> (Megatron optimizer, inner torch optimizer, main parameter or
        # None when another data-parallel rank holds it, span or None)
        located: dict = {}
        for sub in sub_optimizers(engine.optimizer):
            inner = sub.optimizer
            if isinstance(sub, DistributedOptimizer):
                for buffer in sub.buffers:
                    for param in buffer.params:
                        main, span = None, None
                        if param in sub.model_param_group_index_map:
                            group, order = sub.model_param_group_index_map[param]
                            main = inner.param_groups[group]["params"][order]
                            span = sub._get_model_param_range_map(param)["param"]
                        located[id(param)] = (sub, inner, main, span)
            elif hasattr(sub, "float16_groups"):  # bf16: fp32 copies of the bf16 parameters
                for model_group, main_group in zip(
                    sub.float16_groups, sub.fp32_from_float16_groups
                ):
                    for param, main in zip(model_group, main_group):
                        located[id(param)] = (sub, inner, main, None)
                for group in sub.fp32_from_fp32_groups:
                    for param in group:
                        located[id(param)] = (sub, inner, param, None)
            else:
                for group in inner.param_groups:
                    for param in group["params"]:
                        located[id(param)] = (sub, inner, param, None)
        mine: dict = {}
        for name, param, info in iter_global_parameters(engine.model):
            if info.tied_copy:
                continue
            sub, inner, main, span = located[id(param)]
            rows = torch.zeros(len(names), param.numel(), dtype=torch.float32)
            if main is not None:
                state = inner.state[main]
                values = (state["exp_avg"], state["exp_avg_sq"], main.detach())
                start, end = (span.start, span.end) if span is not None else (0, param.numel())
                for row, value in enumerate(values):
                    rows[row, start:end] = value.float().view(-1)
            if isinstance(sub, DistributedOptimizer):
                self.dist.all_reduce(rows, group=sub.data_parallel_group)
            for row, state_name in enumerate(names):
                full = gather_full_tensor(rows[row].view(param.shape), info)
                mine[f"{state_name}/{name}"] = full
        parts: list = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(parts, mine)
        full_state: dict = {}
        for part in parts:
            full_state.update(part)
        return full_state

    def steps(self, engine, first: int, count: int) -> list[dict]:
        keep = ("loss", "grad_norm", "lr")
        metrics = []
        for batch in range(first, first + count):
            result = engine.train_step(make_samples(batch))
            metrics.append({name: result[name] for name in keep})
        return metrics

    def save(self, name: str, tensors) -> None:
        import torch

        if self.rank == 0:
            torch.save(tensors, self.out / f"{name}.pt")

    def load(self, name: str):
        import torch

        return torch.load(self.out / f"{name}.pt", weights_only=False)

    def record(self, name: str, value) -> None:
        self.report[name] = value

    def write(self, phase: str) -> None:
        if self.rank == 0:
            (self.out / f"{phase}.json").write_text(json.dumps(self.report, indent=1))


def max_abs(first: dict, second: dict) -> float:
    assert sorted(first) == sorted(second), set(first) ^ set(second)
    return max((first[n].double() - second[n].double()).abs().max().item() for n in first)


def trajectory(run: Run, layout: str, root: Path, tag: str) -> None:
    """From the seed: SAVE_AFTER steps, save, CONTINUE more steps; then a fresh engine loads
    the checkpoint and runs the same CONTINUE steps. Records both and saves the reference."""
    from megatron_gspo.engine.checkpoint import load_checkpoint, save_checkpoint

    begun = time.perf_counter()
    engine = run.engine(layout)
    run.steps(engine, 0, SAVE_AFTER)
    extra = {"data": {"epoch": 0, "offset": 16}, "reward_moments": {"mean": 0.25, "count": 16}}
    started = time.perf_counter()
    path = save_checkpoint(engine, str(root), SAVE_AFTER, extra)
    run.record(f"{tag}/save_seconds", time.perf_counter() - started)
    at_save = run.weights(engine)
    run.save(f"{tag}_optimizer_at_save", run.optimizer_state(engine))
    continued = run.steps(engine, SAVE_AFTER, CONTINUE)
    final = run.weights(engine)
    run.save(f"{tag}_at_save", at_save)
    run.save(f"{tag}_final", final)

    engine = run.engine(layout)
    started = time.perf_counter()
    restored_extra = load_checkpoint(engine, path)
    run.record(f"{tag}/load_seconds", time.perf_counter() - started)
    run.record(f"{tag}/loaded_weights_max_abs", max_abs(run.weights(engine), at_save))
    run.record(f"{tag}/extra_state_equal", restored_extra == extra)
    run.record(f"{tag}/step_count", engine.step_count)
    resumed = run.steps(engine, SAVE_AFTER, CONTINUE)
    run.record(f"{tag}/continued", continued)
    run.record(f"{tag}/resumed", resumed)
    run.record(f"{tag}/resumed_weights_max_abs", max_abs(run.weights(engine), final))
    run.record(f"{tag}/path", path)
    run.record(f"{tag}/seconds", time.perf_counter() - begun)


def cross_load(run: Run, layout: str, source: Path, tag: str, source_tag: str) -> None:
    """Load a checkpoint written at another layout: the weights are the saved ones bit for bit;
    the next mini-batch's loss and the continued trajectory match the source run's."""
    from megatron_gspo.engine.checkpoint import load_checkpoint

    begun = time.perf_counter()
    engine = run.engine(layout)
    started = time.perf_counter()
    load_checkpoint(engine, str(source))
    run.record(f"{tag}/load_seconds", time.perf_counter() - started)
    run.record(
        f"{tag}/loaded_weights_max_abs",
        max_abs(run.weights(engine), run.load(f"{source_tag}_at_save")),
    )
    run.record(
        f"{tag}/loaded_optimizer_max_abs",
        max_abs(run.optimizer_state(engine), run.load(f"{source_tag}_optimizer_at_save")),
    )
    run.record(f"{tag}/step_count", engine.step_count)
    run.record(f"{tag}/resumed", run.steps(engine, SAVE_AFTER, CONTINUE))
    run.record(
        f"{tag}/resumed_weights_max_abs",
        max_abs(run.weights(engine), run.load(f"{source_tag}_final")),
    )
    run.record(f"{tag}/seconds", time.perf_counter() - begun)


def rng_and_directory_checks(run: Run, out: Path) -> None:
    """One process: RNG restore, interrupted saves, ``latest``, ``keep_last``, clear errors,
    and that the optimizer keys are those of Megatron's own non-distributed format."""
    import os
    import random

    import numpy as np
    import torch
    from megatron.core import dist_checkpointing, tensor_parallel

    from megatron_gspo.engine import checkpoint as ckpt
    from megatron_gspo.runtime.checkpoint_files import latest_checkpoint, read_checkpoint_metadata

    root = out / "directories"

    def draws() -> list:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracker = torch.rand(2).tolist()
        return [random.random(), float(np.random.rand()), *torch.rand(2).tolist(), *tracker]

    engine = run.engine("")
    run.steps(engine, 0, 1)
    first = ckpt.save_checkpoint(engine, str(root), 1, {"position": 1})
    expected = draws()
    engine = run.engine("")
    ckpt.load_checkpoint(engine, first)
    run.record("rng/restored", draws() == expected)

    # Megatron's own FP32Optimizer format (chained_optim_avoid_prefix) has the same tensor keys.
    model_sd = engine.policy_chunks[0].sharded_state_dict()
    theirs = engine.optimizer.sharded_state_dict(
        model_sd, metadata={"chained_optim_avoid_prefix": True}
    )
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    their_keys = {
        t.key for t in nested_values(theirs) if hasattr(t, "key") and t.key.startswith("optim")
    }
    ours = {k for k in dist_checkpointing.load_tensors_metadata(first) if k.startswith("optim")}
    run.record("format/same_keys_as_megatron", ours == their_keys and len(ours) > 0)

    # An interrupted save (the .tmp dir) and a step dir without the marker are never "latest".
    (root / "step_000007.tmp-0123abcd").mkdir()
    (root / "step_000007.tmp-0123abcd" / "__0_0.distcp").write_bytes(b"partial")
    (root / "step_000009").mkdir()
    run.record("dirs/latest_ignores_incomplete", latest_checkpoint(str(root)) == first)
    try:
        ckpt.load_checkpoint(engine, str(root / "step_000009"))
        run.record("dirs/incomplete_refused", False)
    except ckpt.CheckpointError as error:
        run.record("dirs/incomplete_refused", "not a complete" in str(error))
    second = ckpt.save_checkpoint(engine, str(root), 2, {"position": 2})
    names = sorted(os.listdir(root))
    run.record("dirs/stale_removed", names == ["latest", "step_000001", "step_000002"])
    third = ckpt.save_checkpoint(engine, str(root), 3, {"position": 3})
    third_weights = run.weights(engine)
    names = sorted(os.listdir(root))
    run.record("dirs/pruned_to_keep_last", names == ["latest", "step_000002", "step_000003"])
    run.record("dirs/latest_file", (root / "latest").read_text().strip() == "step_000003")
    run.record("dirs/latest", latest_checkpoint(str(root)) == third)
    (root / "latest").write_text("step_000042\n")  # names a directory that does not exist
    run.record("dirs/latest_fallback", latest_checkpoint(str(root)) == third)
    (root / "latest").write_text("step_000002\n")
    run.record("dirs/latest_followed", latest_checkpoint(str(root)) == second)
    # The same step saved again (a resumed run passing it once more) replaces it.
    again = ckpt.save_checkpoint(engine, str(root), 3, {"position": "again"})
    names = sorted(os.listdir(root))
    run.record(
        "dirs/same_step_replaced",
        again == third
        and names == ["latest", "step_000002", "step_000003"]
        and read_checkpoint_metadata(third)["extra_state"] == {"position": "again"},
    )

    # Bad extra_state: refused before anything is written.
    try:
        ckpt.save_checkpoint(engine, str(root), 4, {"moments": torch.zeros(2)})
        run.record("errors/non_json_extra_state", False)
    except ckpt.CheckpointError as error:
        run.record("errors/non_json_extra_state", "JSON" in str(error))
    try:
        ckpt.save_checkpoint(engine, str(root), 4, {1: "int key"})
        run.record("errors/int_keys_extra_state", False)
    except ckpt.CheckpointError as error:
        run.record("errors/int_keys_extra_state", "string keys" in str(error))
    run.record("errors/nothing_written", not any("000004" in n for n in os.listdir(root)))

    # Another schedule: refused unless asked; then the new schedule continues from the saved
    # step (ck_one: in the cosine decay).
    cfg = make_config("")
    cfg.optim.lr = 2e-3
    engine = run.engine("", cfg)
    try:
        ckpt.load_checkpoint(engine, str(out / "ck_one"))
        run.record("errors/schedule_change", False)
    except ckpt.CheckpointError as error:
        run.record("errors/schedule_change", "max_lr" in str(error))
    ckpt.load_checkpoint(engine, str(out / "ck_one"), allow_schedule_change=True)
    run.record("schedule/new_lr_after_load", engine.optimizer.param_groups[0]["lr"])
    # Another architecture: refused with the field named.
    cfg = make_config("")
    cfg.model.moe_ffn_hidden_size = 32
    engine = run.engine("", cfg)
    try:
        ckpt.load_checkpoint(engine, third)
        run.record("errors/model_change", False)
    except ckpt.CheckpointError as error:
        run.record("errors/model_change", "model.moe_ffn_hidden_size" in str(error))
    # Weights only (checkpoint.load_path), from the root (its latest), before the optimizer
    # exists: the optimizer starts fresh.
    engine = run.engine("", load_weights=lambda chunks: ckpt.load_weights_only(chunks, str(root)))
    run.record("weights_only/max_abs", max_abs(run.weights(engine), third_weights))
    run.record(
        "weights_only/optimizer_state_empty",
        all(len(sub.optimizer.state) == 0 for sub in engine.optimizer.chained_optimizers),
    )


def weights_only_controls(run: Run, out: Path) -> None:
    """``load_optimizer=False`` continues on another trajectory (fresh Adam): the exact-resume
    comparisons can tell a lost optimizer state apart. A weights-only torch_dist directory (the
    ``hf-to-megatron`` format: no checkpoint.json) loads with ``load_weights_only``."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.engine import checkpoint as ckpt

    engine = run.engine("")
    extra = ckpt.load_checkpoint(engine, str(out / "ck_one"), load_optimizer=False)
    run.record("control/extra_state_returned", extra["data"]["offset"] == 16)
    run.steps(engine, SAVE_AFTER, CONTINUE)
    run.record("control/weights_only_max_abs", max_abs(run.weights(engine), run.load("one_final")))
    plain = out / "plain_torch_dist"
    plain.mkdir()
    dist_checkpointing.save({"model": engine.policy_chunks[0].sharded_state_dict()}, str(plain))
    expected = run.weights(engine)
    engine = run.engine("", load_weights=lambda chunks: ckpt.load_weights_only(chunks, str(plain)))
    run.record("control/plain_torch_dist_max_abs", max_abs(run.weights(engine), expected))


def bf16_trainer_view(run: Run, source: Path) -> None:
    """One process: load the bf16 checkpoint and save what the trainer holds, for the HF export
    test: its weights under HF names (the weight-sync stream, the trainer's own Megatron -> HF
    path, not the offline converter's) and the response log-probs of a batch (fp32 from the bf16
    forward, as the trainer computes them)."""
    from megatron_gspo.engine.checkpoint import load_checkpoint

    begun = time.perf_counter()
    engine = run.engine("bf16")
    load_checkpoint(engine, str(source), load_optimizer=False)
    weights = {name: tensor.detach().clone() for name, tensor in engine.hf_weights()}
    samples = make_samples(SAVE_AFTER)
    log_probs = engine.forward_log_probs(samples)
    run.save(
        "bf16_trainer_view",
        {
            "hf_weights": weights,
            "tokens": [sample.tokens for sample in samples],
            "prompt_lengths": [sample.prompt_length for sample in samples],
            "log_probs": [tensor.clone() for tensor in log_probs.log_probs],
            "temperature": engine.cfg.rollout.temperature,
        },
    )
    run.record("bf16_view/saved", True)
    run.record("bf16_view/seconds", time.perf_counter() - begun)


def phase_one(run: Run, out: Path) -> None:
    trajectory(run, "", out / "ck_one", "one")
    rng_and_directory_checks(run, out)
    weights_only_controls(run, out)


def phase_four(run: Run, out: Path) -> None:
    trajectory(run, "tp2.ep2", out / "ck_four", "four")
    trajectory(run, "tp2.ep2.distopt", out / "ck_four_distopt", "four_distopt")
    cross_load(run, "tp2.ep2", out / "ck_one", "one_to_four", "one")
    # ep2 on 4 processes: dense dp4, experts ep2 x expert-dp2, both sharded by the distributed
    # optimizer; then ep4 (one expert per rank, dense dp4 spans cut elsewhere).
    trajectory(run, "ep2.distopt", out / "ck_ep2_distopt", "ep2_distopt")
    cross_load(run, "ep4.distopt", out / "ck_ep2_distopt", "ep2_distopt_to_ep4", "ep2_distopt")


def phase_two(run: Run, out: Path) -> None:
    cross_load(run, "pp2", out / "ck_four", "four_to_pp2", "four")
    trajectory(run, "pp2", out / "ck_two", "two")
    trajectory(run, "dp2.distopt", out / "ck_two_distopt", "two_distopt")
    cross_load(run, "dp2.distopt", out / "ck_four_distopt", "four_distopt_to_dp2", "four_distopt")
    cross_load(run, "tp2", out / "ck_ep2_distopt", "ep2_distopt_to_tp2", "ep2_distopt")
    cross_load(run, "pp2", out / "ck_ep2_distopt", "ep2_distopt_to_pp2", "ep2_distopt")
    # bf16: the fp32 main parameters travel as optimizer.state.fp32_param.
    trajectory(run, "bf16.dp2.distopt", out / "ck_bf16_dp2_distopt", "bf16_dp2_distopt")
    cross_load(
        run, "bf16.pp2", out / "ck_bf16_dp2_distopt", "bf16_dp2_distopt_to_pp2", "bf16_dp2_distopt"
    )


def phase_last(run: Run, out: Path) -> None:
    cross_load(run, "", out / "ck_four", "four_to_one", "four")
    cross_load(run, "", out / "ck_four_distopt", "four_distopt_to_one", "four_distopt")
    cross_load(run, "", out / "ck_two", "two_to_one", "two")
    cross_load(run, "", out / "ck_ep2_distopt", "ep2_distopt_to_one", "ep2_distopt")
    cross_load(
        run, "bf16", out / "ck_bf16_dp2_distopt", "bf16_dp2_distopt_to_one", "bf16_dp2_distopt"
    )
    bf16_trainer_view(run, out / "ck_bf16_dp2_distopt")


def phase_bf16_four(run: Run, out: Path) -> None:
    """The slow tier: bf16 at ep2 on 4 processes with the distributed optimizer, resumed at ep4."""
    trajectory(run, "bf16.ep2.distopt", out / "ck_bf16_ep2_distopt", "bf16_ep2_distopt")
    cross_load(
        run, "bf16.ep4.distopt", out / "ck_bf16_ep2_distopt", "bf16_ep2_distopt_to_ep4",
        "bf16_ep2_distopt",
    )  # fmt: skip


def phase_bf16_two(run: Run, out: Path) -> None:
    """The slow tier: that bf16 checkpoint resumed at tp2 (the non-distributed optimizer)."""
    cross_load(
        run, "bf16.tp2", out / "ck_bf16_ep2_distopt", "bf16_ep2_distopt_to_tp2", "bf16_ep2_distopt"
    )


PHASES = {
    "one": phase_one,
    "four": phase_four,
    "two": phase_two,
    "last": phase_last,
    "bf16_four": phase_bf16_four,
    "bf16_two": phase_bf16_two,
}


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--phase", choices=sorted(PHASES), required=True)
    args = parser.parse_args()
    started = time.perf_counter()
    run = Run(args.out)
    PHASES[args.phase](run, args.out)
    run.record("seconds", time.perf_counter() - started)
    run.write(args.phase)
    from megatron_gspo.engine.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    sys.exit(main())
