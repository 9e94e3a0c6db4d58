"""Optimizer state in model space: one checkpoint format for every Megatron optimizer and layout.

For every model parameter and every Adam state tensor ``k`` (``exp_avg``, ``exp_avg_sq``), a
ShardedTensor ``optimizer.state.<k>.<model sharded key>`` sharded like the parameter itself (plus
``optimizer.state.fp32_param.<key>``, the fp32 main weights, when the model is bf16). These are
the keys Megatron's non-distributed optimizer writes with ``chained_optim_avoid_prefix``; they
reshard over tp, pp, vpp, ep, etp, cp and dp like the weights, and the distributed and
non-distributed optimizers read each other's. The Adam step shared by every parameter is plain
metadata; the hyper-parameters are rebuilt from the config and the restored lr schedule.

Why not Megatron's own optimizer ``sharded_state_dict`` (megatron-core 0.16.1, CPU,
``docs/megatron-cpu.md``):

* Non-distributed: its plain part (param groups, step) is saved by rank 0 only and handed to
  every rank on load, so a rank whose chained optimizers differ from rank 0's (a pipeline stage
  without expert parameters, another ep) fails (``KeyError: 'pre_wd_mult'``).
* Distributed: ``fully_sharded_model_space`` raises ``ShardedTensor.flattened_range is not
  supported``; ``fully_reshardable`` raises ``KeyError: 'step'`` (Megatron's ``init_state_fn``
  creates ``exp_avg``/``exp_avg_sq`` but not the per-parameter ``step`` torch's AdamW reads);
  ``dp_reshardable`` loads but the next step differs, and reshards only over dp.

Distributed optimizer: each data-parallel rank holds a flat ``[start, end)`` span of some
parameters. On save, the spans are reduced (zero-padded sums: exact, each element has one owner)
onto the rank holding the parameter's main replica, which writes the full local tensor; on load
each rank reads its parameters' full local state and keeps its span. The cost, like Megatron's
``fully_reshardable``: the main-replica ranks hold their parameters' full optimizer state during a
save, and every rank during a load.

Megatron internals used (checked on 0.16.1): ``ChainedOptimizer.chained_optimizers``,
``DistributedOptimizer.buffers`` / ``model_param_group_index_map`` /
``_get_model_param_range_map``, ``Float16OptimizerWithFloat16Params.float16_groups`` /
``fp32_from_float16_groups`` / ``fp32_from_fp32_groups``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import is_main_replica
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_gspo.runtime.checkpoint_files import CheckpointError


@dataclass
class _ParamState:
    """One model parameter as one Megatron sub-optimizer holds it on this rank."""

    model_param: torch.nn.Parameter
    sharded: Any
    """The parameter's ShardedTensor (or ShardedTensorFactory) in the model state dict."""
    main_param: Optional[torch.Tensor]
    """The tensor the inner optimizer updates: the parameter itself, its fp32 copy, or (the
    distributed optimizer) a flat slice; None when another data-parallel rank holds all of it."""
    inner: Optional[torch.optim.Optimizer]
    span: Optional[tuple[int, int]]
    """Distributed optimizer: this rank's ``[start, end)`` of the flattened parameter."""

    @property
    def state(self) -> dict:
        return self.inner.state[self.main_param] if self.main_param is not None else {}

    @property
    def has_separate_main(self) -> bool:
        return self.main_param is not None and self.main_param.dtype != self.model_param.dtype


def _sharded_by_parameter(model_sharded_state: dict) -> dict[int, Any]:
    """``{id(parameter): its ShardedTensor or ShardedTensorFactory}`` (Megatron's model
    ``sharded_state_dict`` holds the Parameter objects themselves: ``keep_vars=True``)."""
    sharded, _ = extract_sharded_tensors_and_factories(model_sharded_state)
    return {id(tensor.data): tensor for tensor in nested_values(sharded)}


def sub_optimizers(optimizer: Any) -> list:
    """The Megatron optimizers inside ``optimizer`` that own a torch optimizer (a
    ``ChainedOptimizer`` holds one per parameter kind: dense, experts)."""
    children = getattr(optimizer, "chained_optimizers", [optimizer])
    return [child for child in children if getattr(child, "optimizer", None) is not None]


def _parameter_states(sub: Any, by_param: dict[int, Any]) -> list[_ParamState]:
    """Every model parameter ``sub`` updates (on any data-parallel rank of its group), in an
    order shared by the ranks of that group."""

    def sharded(param: torch.Tensor) -> Any:
        if id(param) not in by_param:
            raise CheckpointError(
                f"a parameter of shape {tuple(param.shape)} is not in the model's "
                "sharded_state_dict",
                "its optimizer state could not be placed in the checkpoint",
                "report this: every trainable parameter must be checkpointable",
            )
        return by_param[id(param)]

    inner = sub.optimizer
    if isinstance(sub, DistributedOptimizer):
        if sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            raise CheckpointError(
                "the precision-aware distributed optimizer is not supported by checkpoint.py",
                "its states live inside Transformer Engine's FusedAdam in scaled form",
                "turn use_precision_aware_optimizer off",
            )
        result = []
        for buffer in sub.buffers:
            for param in buffer.params:
                if param in sub.model_param_group_index_map:
                    group, order = sub.model_param_group_index_map[param]
                    span = sub._get_model_param_range_map(param)["param"]
                    main = inner.param_groups[group]["params"][order]
                    result.append(
                        _ParamState(param, sharded(param), main, inner, (span.start, span.end))
                    )
                else:
                    result.append(_ParamState(param, sharded(param), None, inner, (0, 0)))
        return result
    if hasattr(sub, "float16_groups"):  # Float16OptimizerWithFloat16Params (bf16 on GPU)
        pairs = [
            pair
            for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups)
            for pair in zip(model_group, main_group)
        ] + [(param, param) for group in sub.fp32_from_fp32_groups for param in group]
        return [_ParamState(p, sharded(p), main, inner, None) for p, main in pairs]
    return [
        _ParamState(param, sharded(param), param, inner, None)
        for group in inner.param_groups
        for param in group["params"]
    ]


def _step_is_per_parameter(inner: torch.optim.Optimizer) -> bool:
    """torch's Adam/AdamW keep ``state[p]["step"]``; apex / TE FusedAdam keep ``group["step"]``."""
    return type(inner).__module__.startswith("torch.optim")


def _local_step_and_keys(entries: list[_ParamState]) -> tuple[Optional[int], list[str]]:
    steps, keys = set(), set()
    for entry in entries:
        state = entry.state
        if state:
            keys.update(k for k, v in state.items() if k != "step" and torch.is_tensor(v))
            if "step" in state:
                steps.add(int(float(state["step"])))
    for inner in {id(e.inner): e.inner for e in entries if e.main_param is not None}.values():
        if not _step_is_per_parameter(inner):
            steps.update(int(g["step"]) for g in inner.param_groups if "step" in g and g["params"])
    if len(steps) > 1:
        raise CheckpointError(
            f"optimizer steps differ between parameters: {sorted(steps)}",
            "the checkpoint stores one Adam step shared by every parameter",
            "report this: Megatron steps every parameter together",
        )
    return (steps.pop() if steps else None), sorted(keys)


def _flat_state(entry: _ParamState, keys: list[str], with_main: bool) -> torch.Tensor:
    """``[len(keys) (+1), numel]`` zeros except this rank's span of each state (and main)."""
    rows = len(keys) + int(with_main)
    flat = torch.zeros(rows, entry.model_param.numel(), dtype=torch.float32)
    flat = flat.to(entry.model_param.device)
    if entry.main_param is not None:
        start, end = entry.span
        state = entry.state
        for row, key in enumerate(keys):
            flat[row, start:end] = state[key].view(-1)
        if with_main:
            flat[-1, start:end] = entry.main_param.detach().view(-1)
    return flat


def _gathered_distributed_states(
    sub: DistributedOptimizer, entries: list[_ParamState], keys: list[str], with_main: bool
) -> dict[int, torch.Tensor]:
    """Collective over ``sub``'s data-parallel group: ``{entry index: [rows, numel]}`` full local
    states, on the rank holding each parameter's main replica (a parameter nobody in the group
    writes, e.g. a tensor-parallel duplicate, is skipped)."""
    group = sub.data_parallel_group
    size = dist.get_world_size(group)
    device = entries[0].model_param.device if entries else torch.device("cpu")
    names = "\n".join(str(entry.sharded.key) for entry in entries)
    digests: list = [None] * size
    dist.all_gather_object(digests, hashlib.sha1(names.encode()).hexdigest(), group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(
            "data-parallel ranks list the distributed optimizer's parameters "
            "in different orders; its state cannot be gathered"
        )
    mine = torch.tensor(
        [int(is_main_replica(entry.sharded.replica_id)) for entry in entries],
        dtype=torch.int32,
        device=device,
    )
    flags = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(flags, mine, group=group)
    owners = torch.stack(flags).cpu()
    rank_in_group = dist.get_rank(group)
    gathered = {}
    for index, entry in enumerate(entries):
        holders = owners[:, index].nonzero().flatten().tolist()
        if not holders:
            continue
        if len(holders) > 1:
            raise RuntimeError(f"{entry.sharded.key}: several main replicas {holders}")
        flat = _flat_state(entry, keys, with_main)
        # Exactly one rank owns each element, so the sum of zero-padded spans is exact.
        dist.reduce(flat, dst=dist.get_global_rank(group, holders[0]), group=group)
        if holders[0] == rank_in_group:
            gathered[index] = flat.cpu()
    return gathered


def optimizer_sharded_state(
    optimizer: Any, model_sharded_state: dict
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state of ``optimizer`` (Megatron's, chained or not, distributed or not) as
    ShardedTensors sharded like the parameters in ``model_sharded_state``, and its plain metadata
    ``{"step", "state_keys", "has_main_params", "distributed"}``. A collective (the distributed
    optimizer's spans are reduced over its data-parallel group); before the first optimizer step
    there is no state and the dict is empty."""
    by_param = _sharded_by_parameter(model_sharded_state)
    subs = [(sub, _parameter_states(sub, by_param)) for sub in sub_optimizers(optimizer)]
    local = [_local_step_and_keys(entries) for _, entries in subs]
    steps = {step for step, _ in local if step is not None}
    keys = sorted({key for _, sub_keys in local for key in sub_keys})
    with_main = any(e.has_separate_main for _, entries in subs for e in entries)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sorted(steps), keys, with_main))
    all_steps = {step for rank_steps, _, _ in everyone for step in rank_steps}
    all_keys = sorted({key for _, rank_keys, _ in everyone for key in rank_keys})
    with_main = any(flag for _, _, flag in everyone)
    if len(all_steps) > 1:
        raise CheckpointError(
            f"ranks are at different optimizer steps {sorted(all_steps)}",
            "a checkpoint must be taken between optimizer steps, by every rank",
            "call save_checkpoint on every rank at the same point of training",
        )
    step = all_steps.pop() if all_steps else 0
    metadata = {
        "step": step,
        "state_keys": all_keys if step else [],
        # At step 0 the main weights are the model's (the optimizer copied them at build time).
        "has_main_params": with_main and bool(step),
        "distributed": any(isinstance(sub, DistributedOptimizer) for sub, _ in subs),
    }
    tensors: dict[str, Any] = {}
    if not step:
        return tensors, metadata  # before the first step Adam has no state

    def add(entry: _ParamState, key: str, value: torch.Tensor) -> None:
        prefix = f"optimizer.state.{key}"
        tensors[f"{len(tensors)}"] = make_sharded_optimizer_tensor(entry.sharded, value, prefix)

    names = all_keys + (["fp32_param"] if with_main else [])
    for sub, entries in subs:
        if isinstance(sub, DistributedOptimizer):
            gathered = _gathered_distributed_states(sub, entries, all_keys, with_main)
            for index, flat in gathered.items():
                shape = entries[index].model_param.shape
                for row, name in enumerate(names):
                    add(entries[index], name, flat[row].view(shape))
            continue
        for entry in entries:
            for key in all_keys:
                add(entry, key, entry.state[key])
            if with_main:
                add(entry, "fp32_param", entry.main_param.detach())
    return tensors, metadata


def optimizer_load_request(
    optimizer: Any, model_sharded_state: dict, metadata: dict
) -> tuple[dict[str, Any], list]:
    """What to load for this rank's optimizer state (no communication): ``(request, targets)``,
    the request holding one full local ``[parameter shape]`` fp32 buffer per parameter and saved
    state name, ``targets`` what :func:`apply_optimizer_state` needs to place them."""
    by_param = _sharded_by_parameter(model_sharded_state)
    entries = [
        entry
        for sub in sub_optimizers(optimizer)
        for entry in _parameter_states(sub, by_param)
        if entry.main_param is not None  # the distributed optimizer: held by other dp ranks
    ]
    names = list(metadata["state_keys"])
    if metadata["has_main_params"] and any(entry.has_separate_main for entry in entries):
        names.append("fp32_param")
    request: dict[str, Any] = {}
    targets = []
    for entry in entries:
        slots = {}
        for name in names:
            buffer = torch.empty(
                entry.model_param.shape, dtype=torch.float32, device=entry.model_param.device
            )
            slots[name] = str(len(request))
            request[slots[name]] = make_sharded_optimizer_tensor(
                entry.sharded, buffer, f"optimizer.state.{name}"
            )
        targets.append((entry, slots))
    return request, targets


@torch.no_grad()
def apply_optimizer_state(optimizer: Any, targets: list, loaded: dict, step: int) -> None:
    """Replace every inner optimizer's state by the ``loaded`` request of
    :func:`optimizer_load_request` (the distributed optimizer keeps its span of each tensor),
    with the shared Adam ``step``; at step 0 the state is cleared (Adam starts fresh)."""
    inners = {}
    for sub in sub_optimizers(optimizer):
        sub.optimizer.state.clear()
        inners[id(sub.optimizer)] = sub.optimizer
    if not step:
        return
    for entry, slots in targets:
        main = entry.main_param
        state = {}
        for name, slot in slots.items():
            value = loaded[slot].reshape(-1)
            if entry.span is not None:
                value = value[entry.span[0] : entry.span[1]]
            value = value.reshape(main.shape).to(device=main.device, dtype=main.dtype)
            if name == "fp32_param":
                main.copy_(value)
            else:
                state[name] = value.clone()
        if _step_is_per_parameter(entry.inner):
            defaults = entry.inner.defaults
            on_device = defaults.get("capturable") or defaults.get("fused")
            state["step"] = torch.tensor(
                float(step), dtype=torch.float32, device=main.device if on_device else None
            )
        entry.inner.state[main] = state
    for inner in inners.values():
        if not _step_is_per_parameter(inner):
            for group in inner.param_groups:
                group["step"] = step
