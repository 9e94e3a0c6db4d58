"""A training step's metrics reduced over the ranks that computed them: the loss metrics of the
micro-batches (:func:`reduce_loss_metrics`) and Megatron's MoE load-balancing loss
(:func:`load_balancing_loss`). Every rank calls each function with its own values and gets the
same result."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

from megatron_gspo.engine.parallel import ParallelState, all_reduce


def reduce_loss_metrics(outputs: list[dict], parallel: ParallelState) -> dict[str, float]:
    """Sum (``*_max``: max, ``*_min``: min) the loss closures' metric tensors over the step's
    micro-batches and the dp x cp ranks; the last pipeline stage computes them and broadcasts
    the result over pp (``outputs``: one dict of scalar tensors per micro-batch, as
    ``forward_backward_func`` returns them on the last stage)."""
    result: Optional[dict[str, float]] = None
    if parallel.is_last_stage:
        names = sorted(outputs[0])
        sums = [n for n in names if not n.endswith(("_max", "_min"))]
        maxima = [n for n in names if n.endswith("_max")]
        # Minima travel negated, so that one MAX all-reduce serves both.
        minima = [n for n in names if n.endswith("_min")]
        device = parallel.device
        if len(outputs) == 1:
            # One micro-batch: its values are their own maximum and minimum, and their own sum
            # once ``+ 0.0`` (a sum starts from +0: -0.0 comes out +0.0): one operation for all
            # sums instead of two per metric (~40 per optimizer step), the same numbers.
            (only,) = outputs
            sum_vector = (torch.stack([only[n] for n in sums]) + 0.0).to(device, torch.float64)
            extremes = [only[n] for n in maxima] + [-only[n] for n in minima]
        else:
            sum_vector = torch.stack(
                [torch.stack([out[n] for out in outputs]).sum() for n in sums]
            ).to(device, torch.float64)
            extremes = [torch.stack([out[n] for out in outputs]).max() for n in maxima] + [
                -torch.stack([out[n] for out in outputs]).min() for n in minima
            ]
        max_vector = (
            torch.stack(extremes).to(device, torch.float64)
            if extremes
            else torch.zeros(0, dtype=torch.float64, device=device)
        )
        all_reduce(sum_vector, parallel.dp_cp_group)
        if extremes:
            all_reduce(max_vector, parallel.dp_cp_group, dist.ReduceOp.MAX)
        result = dict(zip(sums, sum_vector.tolist()))
        values = max_vector.tolist()
        result.update(zip(maxima, values[: len(maxima)]))
        result.update(zip(minima, [-value for value in values[len(maxima) :]]))
    if parallel.pp > 1:
        holder = [result]
        source = dist.get_global_rank(parallel.pp_group, parallel.pp - 1)
        dist.broadcast_object_list(holder, src=source, group=parallel.pp_group)
        result = holder[0]
    return result


def load_balancing_loss(
    num_layers: int, num_moe_layers: int, num_micro_batches: int, parallel: ParallelState
) -> float:
    """Megatron's load-balancing loss (before ``moe_aux_loss_coef``) averaged over the
    ``num_moe_layers`` MoE layers and the step's micro-batches (``num_micro_batches`` per dp
    rank); resets Megatron's tracker.

    Each rank's tracker holds, per layer (``num_layers`` decoder layers), its part of every
    micro-batch's loss (tp and cp ranks hold partial sums over their tokens; pp ranks their
    layers; dp ranks their micro-batches), so one SUM over the world gives the total.
    """
    tracker = get_moe_layer_wise_logging_tracker()
    entry = tracker.get("load_balancing_loss")
    values = torch.zeros(num_layers, dtype=torch.float64, device=parallel.device)
    if entry is not None:
        values += entry["values"][:num_layers].to(values)
    all_reduce(values, parallel.world_group)
    clear_aux_losses_tracker()
    return float(values.sum()) / (num_moe_layers * num_micro_batches * parallel.dp)
