"""Process groups: torch.distributed + Megatron-Core model parallel (tp, pp, vpp, ep, etp, cp).

Rank order is Megatron's default ``tp-cp-ep-dp-pp`` (tensor parallel innermost). Expert groups
are carved out of the tp x cp x dp ranks of one pipeline stage: ``etp x ep x expert-dp``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_gspo.config import ParallelConfig
from megatron_gspo.engine.compat import apply_cpu_shims, cuda_available

logger = logging.getLogger(__name__)


@dataclass
class ParallelState:
    """Sizes, ranks and process groups of this process (see Megatron's ``parallel_state``)."""

    world_size: int
    rank: int
    device: torch.device
    tp: int
    pp: int
    vpp: int
    """Model chunks per pipeline rank (1 without virtual pipeline)."""
    cp: int
    dp: int
    ep: int
    etp: int
    expert_dp: int
    tp_rank: int
    pp_rank: int
    cp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int
    expert_dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    """Data parallel without context parallel."""
    dp_cp_group: dist.ProcessGroup
    """Data x context parallel: the ranks DDP reduces dense gradients over."""
    tp_cp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    expert_dp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    """tp x pp x cp (everything that holds one model replica)."""
    world_group: dist.ProcessGroup

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def virtual_pipeline(self) -> Optional[int]:
        """``virtual_pipeline_model_parallel_size`` as Megatron expects it (None when off)."""
        return self.vpp if self.vpp > 1 else None

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size}: tp {self.tp_rank}/{self.tp} pp {self.pp_rank}/"
            f"{self.pp} (vpp {self.vpp}) cp {self.cp_rank}/{self.cp} dp {self.dp_rank}/{self.dp} "
            f"ep {self.ep_rank}/{self.ep} etp {self.etp_rank}/{self.etp}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _init_torch_distributed(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if cuda_available() else "gloo"
    if "RANK" not in os.environ:
        # One process without torchrun: a private rendezvous on a free loopback port.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def initialize_parallel(
    parallel: ParallelConfig, seed: int, *, timeout_minutes: int = 30
) -> ParallelState:
    """Initialise torch.distributed (from torchrun's env vars; world size 1 works without
    torchrun) and Megatron's model-parallel groups, and seed Megatron's RNG tracker.

    Gloo on CPU (with :func:`~megatron_gspo.engine.compat.apply_cpu_shims`), NCCL on GPU.
    Calling it again with the same layout returns the existing state.
    """
    apply_cpu_shims()
    _init_torch_distributed(timeout_minutes)
    world_size = dist.get_world_size()
    parallel.check_world(world_size)
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else None
    if parallel_state.model_parallel_is_initialized():
        current = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        )
        wanted = (parallel.tp, parallel.pp, parallel.cp, parallel.ep, parallel.etp, vpp)
        if current != wanted:
            raise RuntimeError(
                f"Megatron model parallel is already initialised with (tp, pp, cp, ep, etp, vpp) ="
                f" {current}, not {wanted}; call destroy_parallel() first"
            )
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=timeout_minutes,
            # On CPU every group already is a gloo group; duplicates would only cost start-up.
            create_gloo_process_groups=cuda_available(),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    state = current_parallel_state()
    logger.info("parallel layout: %s", state.describe())
    return state


def current_parallel_state() -> ParallelState:
    """The :class:`ParallelState` of the initialised Megatron groups."""
    ps = parallel_state
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if cuda_available()
        else torch.device("cpu")
    )
    return ParallelState(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        device=device,
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        vpp=vpp,
        cp=ps.get_context_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        expert_dp=ps.get_expert_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        expert_dp_rank=ps.get_expert_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        cp_group=ps.get_context_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        tp_cp_group=ps.get_tensor_and_context_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        expert_dp_group=ps.get_expert_data_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        world_group=dist.group.WORLD,
    )


def all_reduce(
    tensor: torch.Tensor, group: Optional[dist.ProcessGroup], op: Any = dist.ReduceOp.SUM
) -> torch.Tensor:
    """``dist.all_reduce`` of ``tensor`` in place, skipped over a group of one rank (where it is
    the identity): gloo hands every collective to a worker thread, ~30 us on an idle CPU and
    milliseconds on a busy one, several times per optimizer step of a one-process run."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def destroy_parallel(*, destroy_process_group: bool = True) -> None:
    """Tear down Megatron's groups (and torch.distributed unless told otherwise)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
