"""The policy update: one optimizer step per mini-batch through Megatron's forward_backward_func.

Loss normalisation (pitfalls 5 and 6 of ``docs/loss-pitfalls.md``). Each micro-batch's
loss ``L_mb`` is :func:`megatron_gspo.algo.policy_loss` over this rank's tokens with the GLOBAL
denominators of the mini-batch (sequences, tokens, per-sequence lengths), so
``sum over micro-batches, dp and cp ranks of L_mb`` is exactly the loss of the whole mini-batch.
Megatron then scales what the loss closure returns (2-tuple path: ``x cp / num_microbatches``)
and DDP averages gradients over ``dp x cp``; returning ``L_mb x num_microbatches x dp`` cancels
both, so the gradient is exactly ``grad sum L_mb`` whatever the layout and micro-batch count.
Under context parallel the per-sequence sums of GSPO are all-reduced (differentiably) over the
cp group inside ``policy_loss``.

The MoE load-balancing loss keeps Megatron's semantics: computed per micro-batch over all its
tokens (tensor- and context-parallel parts combined, padding excluded), weighted
``coef / (num_microbatches x dp)``, i.e. ``coef x`` its mean over the step's micro-batches. It is
therefore independent of tp, pp, ep, etp and cp, and depends only on how samples are grouped into
micro-batches (``dp=2, k=1`` and ``dp=1, k=2`` form the same groups). When a mini-batch has fewer
samples than ``dp x k`` micro-batches, the empty ones run a one-token filler sequence (no policy
loss) that also counts in that mean.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from megatron_gspo.algo import finish_correction_metrics, policy_loss, policy_loss_settings
from megatron_gspo.config import TrainConfig
from megatron_gspo.engine.batches import (
    GlobalDenominators,
    MicroBatch,
    build_micro_batches,
    global_denominators,
    plan_mini_batch,
    validate_samples,
)
from megatron_gspo.engine.checkpoint import stop_writer_result_queue
from megatron_gspo.engine.compat import cuda_available
from megatron_gspo.engine.hf_import_export import iter_hf_weights
from megatron_gspo.engine.logprobs import vocab_parallel_log_probs
from megatron_gspo.engine.model import (
    PolicyModel,
    build_policy_model,
    unwrap,
    wrap_with_ddp,
)
from megatron_gspo.engine.optimizer import build_optimizer, build_scheduler, clip_gradients
from megatron_gspo.engine.packing import padding_multiple
from megatron_gspo.engine.parallel import ParallelState, all_reduce, initialize_parallel
from megatron_gspo.engine.routing_replay import PolicyRouting, RoutingPass, check_never_replays
from megatron_gspo.engine.sharding import initialize_weights_from_seed
from megatron_gspo.engine.step_metrics import load_balancing_loss, reduce_loss_metrics
from megatron_gspo.runtime.health import RunStopped
from megatron_gspo.samples import TrainSample

if TYPE_CHECKING:
    from megatron_gspo.weight_sync import StableTensorStream

logger = logging.getLogger(__name__)


class NonFiniteStepsError(RunStopped):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


def packed_seq_params(
    micro_batch: MicroBatch, cp_group: dist.ProcessGroup, device: torch.device
) -> PackedSeqParams:
    """Megatron's THD description of a packed micro-batch (``cu_seqlens`` of the FULL row: TE
    and Megatron's RoPE divide them by cp themselves)."""
    packed = micro_batch.packed
    cu_seqlens = packed.cu_seqlens.to(device)
    cu_seqlens_padded = packed.cu_seqlens_padded.to(device)
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=packed.max_length,
        max_seqlen_kv=packed.max_length,
        cp_group=cp_group,
    )


@dataclass
class ForwardLogProbs:
    """What :meth:`TrainEngine.forward_log_probs` returns, the same on every rank."""

    log_probs: list[torch.Tensor]
    """Per sample ``[R]`` float32 response log-probs at the rollout temperature."""
    routes: Optional[list[torch.Tensor]] = None
    """Per sample ``[L - 1, M, K]`` native routes of the policy's MoE layers (the old policy's
    routes), when the forward recorded them; None otherwise."""
    route_weights: Optional[list[torch.Tensor]] = None
    """Per sample ``[L - 1, M, K]`` float32 combine weights of ``routes``, recorded with them
    when ``algo.routing_replay_weights=replayed``; None otherwise."""


class TrainEngine:
    """Policy (and optional frozen reference) model, optimizer and scheduler of one run.

    Every rank calls every method with the same arguments (the full mini-batch).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        parallel: Optional[ParallelState] = None,
        load_weights: Optional[Callable[[list[PolicyModel]], Any]] = None,
    ):
        """Build everything for ``cfg`` (initialising the process groups unless ``parallel``
        is given). Weights: seed-determined (:func:`~megatron_gspo.engine.sharding.
        initialize_weights_from_seed` with ``cfg.seed``), then ``load_weights(chunks)`` if
        given (e.g. Hugging Face weights), which runs before DDP, the optimizer (its fp32 main
        copies) and the reference model copy are made. To change weights later, go through
        the checkpoint loader, then :meth:`copy_policy_to_reference` if needed."""
        self.cfg = cfg
        self.loss_settings = policy_loss_settings(cfg.algo)
        self.parallel = parallel or initialize_parallel(
            cfg.parallel, cfg.seed, timeout_minutes=cfg.parallel.collective_timeout_minutes
        )
        chunks = build_policy_model(cfg, self.parallel)
        initialize_weights_from_seed(chunks, cfg.seed, cfg.model.init_std)
        # The policy's RouterReplay instances, found by walking its chunks (routing_replay.py).
        self.routing: Optional[PolicyRouting] = None
        if cfg.model.is_moe and getattr(chunks[0].config, "moe_enable_routing_replay", False):
            self.routing = PolicyRouting(chunks, self.parallel, cfg)
        if load_weights is not None:
            load_weights(chunks)
        self.model = wrap_with_ddp(
            chunks, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer
        )
        self.config = chunks[0].config
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = [chunk.no_sync for chunk in self.model]
        if len(self.model) == 1:
            self.config.no_sync_func = self.config.no_sync_func[0]
        self.optimizer = build_optimizer(cfg, self.model)
        self.scheduler = build_scheduler(cfg, self.optimizer)
        self._lr_override: float | None = None  # fixed_lr
        self.reference_model: Optional[list[PolicyModel]] = None
        if cfg.algo.needs_reference_model:
            self.reference_model = build_policy_model(cfg, self.parallel, routing_replay=False)
            check_never_replays(self.reference_model)
            self.copy_policy_to_reference()
        self.multiple = padding_multiple(
            self.parallel.tp, self.parallel.cp, sequence_parallel=self.parallel.tp > 1
        )
        self.consecutive_skips = 0
        self.skipped_steps = 0
        self.step_count = 0

    def close(self) -> None:
        """Stop the process the first checkpoint save started (Megatron's writer result queue),
        so that a run that ends while its process goes on leaves no child behind. The models and
        process groups stay usable."""
        stop_writer_result_queue()

    def __enter__(self) -> TrainEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------

    @property
    def policy_chunks(self) -> list[PolicyModel]:
        return [unwrap(chunk) for chunk in self.model]

    def hf_weights(self) -> StableTensorStream:
        """The policy's weights as full tensors under Hugging Face names, for the rollout
        engine (:func:`~megatron_gspo.engine.hf_import_export.iter_hf_weights`: on global rank 0).
        Collective: every rank must drain the stream (gathering shards)."""
        return iter_hf_weights(self.policy_chunks, self.cfg)

    @torch.no_grad()
    def copy_policy_to_reference(self) -> None:
        """Reference := current policy weights (call after loading initial weights)."""
        if self.reference_model is None:
            raise RuntimeError(
                "no reference model: algo.use_kl_loss and add_token_level_kl are off"
            )
        for policy, reference in zip(self.policy_chunks, self.reference_model):
            for (name, source), (other, target) in zip(
                policy.named_parameters(), reference.named_parameters()
            ):
                assert name == other, (name, other)
                target.copy_(source)
            reference.requires_grad_(False)
        self._offload_reference()

    @contextmanager
    def uncorrected(self):
        """Train without ``algo.rollout_correction`` inside the block: for supervised steps,
        whose samples were not sampled by the rollout engine (no behaviour log-probs)."""
        saved = self.loss_settings
        self.loss_settings = dataclasses.replace(saved, rollout_correction=None)
        try:
            yield
        finally:
            self.loss_settings = saved

    @contextmanager
    def fixed_lr(self, lr: float | None):
        """Every optimizer step inside the block applies ``lr`` instead of the schedule's (the
        supervised cold start's ``sft_warmup_lr``); None changes nothing. The schedule still
        advances with each step, and the first step after the block applies its lr."""
        saved, self._lr_override = self._lr_override, lr if lr is not None else self._lr_override
        try:
            yield
        finally:
            self._lr_override = saved

    @contextmanager
    def native_routing(self):
        """Route natively inside the block (no replay, no routing metrics): for supervised
        steps, whose samples carry neither rollout nor recorded routes."""
        if self.routing is None:
            yield
            return
        saved = self.routing.mode, self.routing.measure
        self.routing.mode, self.routing.measure = "none", False
        try:
            yield
        finally:
            self.routing.mode, self.routing.measure = saved

    def _offload_reference(self) -> None:
        """On GPU the frozen reference lives in host memory between its forwards, so that it
        costs no device memory during rollouts and updates (it has no optimizer state)."""
        if self.reference_model is not None and cuda_available():
            for chunk in self.reference_model:
                chunk.to("cpu")
            torch.cuda.empty_cache()

    @contextmanager
    def _reference_on_device(self):
        if cuda_available():
            for chunk in self.reference_model:
                chunk.to(self.parallel.device)
        try:
            yield
        finally:
            self._offload_reference()

    def _micro_batches(
        self, samples: Sequence[TrainSample], **options: bool
    ) -> tuple[GlobalDenominators, list[MicroBatch]]:
        """The mini-batch's global denominators and this rank's packed micro-batches
        (``options``: :func:`build_micro_batches`' ``with_*`` flags)."""
        parallel = self.parallel
        plan = plan_mini_batch(
            samples,
            dp_size=parallel.dp,
            micro_batch_tokens=self.cfg.parallel.micro_batch_tokens,
            multiple=self.multiple,
            micro_batches_multiple=parallel.pp if parallel.vpp > 1 else 1,
        )
        denominators = global_denominators(samples)
        micro_batches = build_micro_batches(
            samples,
            plan[parallel.dp_rank],
            lengths=denominators.lengths,
            multiple=self.multiple,
            cp_size=parallel.cp,
            cp_rank=parallel.cp_rank,
            **options,
        )
        return denominators, micro_batches

    def _run_schedule(
        self,
        model: list,
        micro_batches: list[MicroBatch],
        loss_func,
        *,
        forward_only: bool,
        routing: Optional[RoutingPass] = None,
    ) -> list[dict]:
        cp_group, device = self.parallel.cp_group, self.parallel.device

        def forward_step(data_iterator, chunk):
            micro_batch = next(data_iterator)
            packed = micro_batch.packed
            if routing is not None:
                routing.before_forward(chunk, micro_batch)
            output = chunk(
                packed.input_ids.to(device),
                packed.position_ids.to(device),
                None,
                packed_seq_params=packed_seq_params(micro_batch, cp_group, device),
                padding_mask=packed.padding_mask.to(device),
            )
            if routing is not None:
                routing.after_forward(chunk, micro_batch)
            return output, partial(loss_func, micro_batch)

        iterators = [iter(micro_batches) for _ in model]
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(model) > 1 else iterators[0],
            model=model if len(model) > 1 else model[0],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.packed.num_tokens for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def _log_probs(
        self, chunk: PolicyModel, micro_batch: MicroBatch, hidden: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``[N]`` response log-probs (and entropy) of this rank's tokens from ``[s, 1, h]``."""
        if self.parallel.tp > 1:
            # All-gather the sequence-parallel slices; the backward reduce-scatters (sums) the
            # per-vocab-shard partial gradients the log-prob kernel leaves (see its docstring).
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=True, group=self.parallel.tp_group
            )
        hidden = hidden.squeeze(1)
        rows = micro_batch.response_rows.to(hidden.device)
        if rows.numel() == 0:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return empty, (empty if with_entropy else None)
        return vocab_parallel_log_probs(
            hidden.index_select(0, rows),
            chunk.output_weight,
            micro_batch.labels.to(hidden.device),
            tp_group=self.parallel.tp_group,
            temperature=self.cfg.rollout.temperature,
            with_entropy=with_entropy,
            vocab_size=chunk.unpadded_vocab_size,
        )

    # -----------------------------------------------------------------------------------------

    def forward_log_probs(
        self,
        samples: Sequence[TrainSample],
        *,
        reference: bool = False,
        record_routes: bool = False,
    ) -> ForwardLogProbs:
        """Per-sample ``[R]`` float32 response log-probs at ``rollout.temperature`` (no grad),
        returned on every rank. Uses the same micro-batches as :meth:`train_step`, so the
        old log-probs it recomputes match the training forward bit for bit.

        MoE policy forwards replay each sample's ``rollout_routes`` under
        ``algo.routing_replay=r3``. ``record_routes=True`` makes this the old-policy forward:
        every MoE layer's native top-k is recorded and returned on every rank as
        ``ForwardLogProbs.routes`` (``[L - 1, M, K]`` uint8/int16, CPU), which the caller stores
        as ``TrainSample.old_routes`` (R2 replays them in the training forwards). Dense models
        record nothing. The reference model never replays nor records.
        """
        validate_samples(samples, need_old=False, need_advantages=False, need_ref=False)
        if reference and self.reference_model is None:
            raise RuntimeError(
                "no reference model: algo.use_kl_loss and add_token_level_kl are off"
            )
        if reference and record_routes:
            raise ValueError("record_routes: the old policy's routes come from the policy model")
        model = self.reference_model if reference else self.model
        _, micro_batches = self._micro_batches(samples, with_loss_inputs=False)
        offsets = [0]
        for sample in samples:
            offsets.append(offsets[-1] + sample.response_length)
        flat = torch.zeros(offsets[-1], dtype=torch.float32)
        chunks = [unwrap(chunk) for chunk in model]

        def loss_func(micro_batch: MicroBatch, hidden: torch.Tensor):
            log_probs, _ = self._log_probs(chunks[-1], micro_batch, hidden, with_entropy=False)
            # One contributor per position: tp rank 0 of the last stage (dp and cp ranks hold
            # disjoint positions), so the world all-reduce below is an exact gather.
            if self.parallel.tp_rank == 0 and micro_batch.sample_indices:
                starts = torch.tensor([offsets[i] for i in micro_batch.sample_indices])
                where = starts[micro_batch.response_sample] + micro_batch.response_index
                flat[where] = log_probs.detach().float().cpu()
            return hidden.sum() * 0.0, {}

        routing = nullcontext()
        if self.routing is not None and not reference:
            routing = self.routing.old_policy_pass(samples, micro_batches, record=record_routes)
        placement = self._reference_on_device() if reference else nullcontext()
        with placement, routing as routing_pass, torch.no_grad():
            self._run_schedule(
                model, micro_batches, loss_func, forward_only=True, routing=routing_pass
            )
        flat = flat.to(self.parallel.device)
        all_reduce(flat, self.parallel.world_group)
        flat = flat.cpu()
        return ForwardLogProbs(
            log_probs=[flat[offsets[i] : offsets[i + 1]].clone() for i in range(len(samples))],
            routes=None if routing_pass is None else routing_pass.recorded,
            route_weights=None if routing_pass is None else routing_pass.recorded_weights,
        )

    # -----------------------------------------------------------------------------------------

    def train_step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """ONE optimizer step on this mini-batch (the same full list on every rank):
        :meth:`forward_backward` then :meth:`optimizer_step`.

        Returns the metrics of ``policy_loss`` summed over the mini-batch (``*_max``: maximum,
        ``*_min``: minimum; with a rollout correction, ``rollout_correction/*`` and their effective
        sample sizes, :func:`~megatron_gspo.algo.finish_correction_metrics`),
        plus ``loss``, ``grad_norm``, ``lr`` (the one this step applied), ``skipped`` (1.0 if the
        step was skipped because the loss or the gradient norm was not finite),
        ``skipped_total``, ``num_micro_batches`` (per rank), ``tokens`` and ``padding_tokens``
        (packed, all ranks) and, with the load-balancing loss on, ``moe_load_balancing_loss``.
        MoE with ``algo.log_routing_change``: ``routing_change_frac`` (when the samples carry the
        old policy's routes, see :meth:`forward_log_probs`), ``routing_change_frac_vs_rollout``
        and ``routing_mismatch_vs_rollout`` (when they carry the rollout's routes) and their
        ``/layer_{i}`` values (``i``: decoder layer), reduced over all ranks (module
        ``routing_replay``).
        """
        return self.optimizer_step(self.forward_backward(samples))

    def forward_backward(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Gradients of the mini-batch loss in the DDP buffers (``param.main_grad``), reduced
        over data parallel; no optimizer step. Returns the loss metrics (see :meth:`train_step`)."""
        algo = self.cfg.algo
        detach_old = algo.old_log_prob_source == "detach"
        corrected = self.loss_settings.rollout_correction is not None
        validate_samples(
            samples,
            need_old=not detach_old,
            need_advantages=True,
            need_ref=algo.use_kl_loss,
            need_behaviour=corrected,
        )
        denominators, micro_batches = self._micro_batches(
            samples, with_ref=algo.use_kl_loss, with_behaviour=corrected
        )
        num_micro_batches = len(micro_batches)
        # Cancels Megatron's x cp / num_microbatches and DDP's / (dp x cp): see module docstring.
        loss_scale = float(num_micro_batches * self.parallel.dp)
        last_chunk = self.policy_chunks[-1]
        with_entropy = algo.entropy_coef > 0
        device = self.parallel.device

        def loss_func(micro_batch: MicroBatch, hidden: torch.Tensor):
            log_probs, entropy = self._log_probs(last_chunk, micro_batch, hidden, with_entropy=True)
            log_probs = micro_batch.unpack(log_probs)
            entropy = micro_batch.unpack(entropy if with_entropy else entropy.detach())
            old = micro_batch.old_log_probs.to(device)
            if detach_old:
                old = log_probs.detach()
            loss, metrics = policy_loss(
                log_probs,
                old,
                micro_batch.advantages.to(device),
                micro_batch.local_mask.to(device),
                self.loss_settings,
                ref_log_probs=(micro_batch.ref_log_probs.to(device) if algo.use_kl_loss else None),
                entropy=entropy,
                behaviour_log_probs=(
                    micro_batch.behaviour_log_probs.to(device) if corrected else None
                ),
                num_sequences=denominators.num_sequences,
                num_tokens=denominators.num_tokens,
                sequence_lengths=micro_batch.lengths.to(device),
                sequence_group=self.parallel.cp_group if self.parallel.cp > 1 else None,
            )
            metrics = {name: value.detach().float() for name, value in metrics.items()}
            metrics["loss"] = loss.detach().float()
            # "+ 0 * sum": every rank joins the backward (and the pipeline's gradient send)
            # even when it holds no loss token of this micro-batch.
            return loss * loss_scale + hidden.sum() * 0.0, metrics

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        routing = nullcontext()
        if self.routing is not None:
            routing = self.routing.training_pass(samples, micro_batches, backward=True)
        with routing as routing_pass:
            outputs = self._run_schedule(
                self.model, micro_batches, loss_func, forward_only=False, routing=routing_pass
            )
        metrics = finish_correction_metrics(reduce_loss_metrics(outputs, self.parallel))
        if routing_pass is not None:
            metrics.update(routing_pass.metrics)
        if self.cfg.model.is_moe and self.cfg.model.moe_aux_loss_coef > 0:
            metrics["moe_load_balancing_loss"] = load_balancing_loss(
                self.config.num_layers,
                len(self.cfg.model.moe_layer_indices),
                num_micro_batches,
                self.parallel,
            )
        padding = sum(mb.packed.padding_tokens for mb in micro_batches if mb.sample_indices)
        tokens = sum(mb.packed.num_tokens for mb in micro_batches)
        counts = torch.tensor([padding, tokens], dtype=torch.float64, device=device)
        # Each dp rank packs its own micro-batches; tp/cp/pp replicas pack the same ones.
        all_reduce(counts, self.parallel.dp_group)
        metrics.update(
            num_micro_batches=float(num_micro_batches),
            padding_tokens=float(counts[0]),
            tokens=float(counts[1]),
        )
        return metrics

    def optimizer_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Clip and apply the gradients of :meth:`forward_backward` (whose metrics it takes and
        extends), unless the loss or the gradient norm is not finite: then the step is skipped
        (weights, optimizer state and lr schedule untouched) and counted;
        ``optim.max_consecutive_skips`` skips in a row raise :class:`NonFiniteStepsError`."""
        # The learning rate this step applies (the scheduler moves on after the step).
        scheduled = None
        if self._lr_override is not None:  # fixed_lr; the scheduler's step writes its lr back
            scheduled = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = self._lr_override
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        finite = math.isfinite(metrics["loss"]) and math.isfinite(grad_norm)
        if finite:
            clip_gradients(self.optimizer, grad_norm)
            self.optimizer.step_with_ready_grads()
            self.scheduler.step(1)
            self.consecutive_skips = 0
        else:
            self.optimizer.zero_grad()
            for group, value in zip(self.optimizer.param_groups, scheduled or []):
                group["lr"] = value  # a skipped step leaves the schedule's lr in place
            self.consecutive_skips += 1
            self.skipped_steps += 1
            logger.warning(
                "optimizer step %d skipped: loss=%s grad_norm=%s (%d in a row, %d in total)",
                self.step_count,
                metrics["loss"],
                grad_norm,
                self.consecutive_skips,
                self.skipped_steps,
            )
        self.step_count += 1
        metrics = dict(metrics)
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            skipped=0.0 if finite else 1.0,
            skipped_total=float(self.skipped_steps),
        )
        if self.consecutive_skips >= self.cfg.optim.max_consecutive_skips:
            raise NonFiniteStepsError(
                f"{self.consecutive_skips} consecutive optimizer steps had a non-finite loss or "
                f"gradient norm (last: loss={metrics['loss']}, grad_norm={grad_norm})",
                "each was skipped, so the weights are those of the last good step, and the "
                "next steps would most likely be skipped as well",
                "lower optim.lr, check the rewards and advantages for inf/NaN, or raise "
                "optim.max_consecutive_skips",
            )
        return metrics
