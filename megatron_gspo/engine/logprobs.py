"""Vocab-parallel per-token log-probs (and entropy) fused with the output projection.

For ``N`` tokens with final hidden states ``h [N, H]`` and the output-layer weight ``W [V, H]``
split by rows over tensor-parallel (tp) ranks (rank ``r`` holds ``W_r [V_local, H]``, the ids
``[r * V_local, (r + 1) * V_local)``, exactly Megatron's ``ColumnParallelLinear`` output layer):

    z     = (h @ W.T).float() / T                                  [N, V]   logits at temperature T
    lse   = log sum_v exp(z_v)                                      [N]
    logp  = z_y - lse                                               [N]      y = label
    H     = lse - sum_v p_v z_v,   p = softmax(z)                   [N]      entropy

The full ``[N, V]`` (or ``[N, V_local]``) fp32 logits never exist: tokens are processed in chunks
of ``chunk_size`` rows, the forward keeps only ``lse`` (and ``E_p[z]`` for entropy) per token, and
the backward recomputes each chunk's logits. Gradients wrt the logits:

    d logp / dz_v = onehot_y(v) - p_v
    d H / dz_v    = -p_v (z_v - E_p[z])

and ``dz/dx = 1/T`` for the raw logits ``x = h @ W.T``. Peak extra memory is one fp32
``[chunk_size, V_local]`` buffer (plus its bf16 twin for bf16 inputs and a 4 MB scratch) on top
of the weight gradient (see ``benchmarks/logprob_memory.py``); the price is one more
``[N, H] x [H, V_local]`` matmul (the recompute) in the backward. The default chunk size
(:func:`default_chunk_size`) keeps that buffer no larger than the weight shard itself (or 32 MiB).

Under Megatron DDP the weight gradient is accumulated straight into ``weight.main_grad`` (Megatron's
gradient-accumulation-fusion contract, see :func:`_main_grad_target`): no ``[V_local, H]``
gradient tensor is materialised.

Pure torch + torch.distributed: no Megatron import, so it is tested on CPU with gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# Measured on the 2-core CPU box (benchmarks/README.md; fp32, V=151,936, H=256, N=2048, log-probs
# + entropy, forward + backward): C=256 uses 346 MB extra against 5,963 MB for naive log_softmax
# (1/17) and is no slower; C=1024 misses 1/8, C=128 saves little more. Memory grows linearly in C.
DEFAULT_CHUNK_SIZE = 256
"""The most tokens per chunk :func:`default_chunk_size` picks (what it picks whenever the logits
buffer of 256 tokens is no larger than the output weight shard or 32 MiB)."""
LOGITS_BUDGET_FLOOR_BYTES = 32 << 20
"""The logits workspace may always use this much, however small the weight shard."""
# Elementwise passes (exp, entropy terms) run on blocks of this many logits (4 MB fp32) at a time:
# big enough that the per-block overhead vanishes, small next to the [C, V_local] buffer.
ELEMENTWISE_BLOCK_ELEMENTS = 1 << 20


def default_chunk_size(local_vocab: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Tokens per chunk when the caller gives none, from the weight shard ``[V_local, H]``::

        row_bytes = V_local * (4 + (b if dtype is not fp32 else 0))   one token of the workspace
        budget    = max(32 MiB, V_local * H * b)                        b = bytes per element
        C         = clamp(budget // row_bytes, 1, 256), rounded down to a multiple of 8 (C >= 8)

    so the fp32 logits buffer (and its input-dtype twin) never outgrows the weight shard it
    multiplies, whose gradient the backward writes anyway, unless that is under 32 MiB. Small
    vocabularies and large hidden sizes keep the measured 256; a large vocabulary with a small
    hidden size gets fewer tokens (Qwen3's V = 151,936 at H = 64, fp32: C = 64, 39 MB instead of
    148 MiB). ``local_vocab`` is the shard's row count including vocab padding: every tp rank has
    the same shape, so all ranks chunk alike, as the per-chunk collectives require.
    """
    element_bytes = torch.empty((), dtype=dtype).element_size()
    row_bytes = max(local_vocab, 1) * (4 + (element_bytes if dtype != torch.float32 else 0))
    budget = max(LOGITS_BUDGET_FLOOR_BYTES, local_vocab * hidden_size * element_bytes)
    chunk = max(1, min(DEFAULT_CHUNK_SIZE, budget // row_bytes))
    return chunk - chunk % 8 if chunk >= 8 else chunk


def vocab_parallel_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    tp_group: ProcessGroup | None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    with_entropy: bool = False,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token ``log softmax(h @ W.T / T)[label]`` (and entropy) over a vocab split on ``tp_group``.

    Args:
        hidden: ``[..., H]`` final hidden states (after the final norm), the same on every tp rank
            (under sequence parallel: already gathered over tp, see "Gradient contract").
        weight: ``[V_local, H]`` this rank's rows of the output-layer weight; rank ``r`` of
            ``tp_group`` owns token ids ``[r * V_local, (r + 1) * V_local)``. Same dtype as hidden.
        labels: ``[...]`` (``hidden.shape[:-1]``) integer target ids, the same on every tp rank.
            Ids ``< 0`` (e.g. -100 or a padding marker) are ignored: log-prob 0, entropy 0 and no
            gradient from that position.
        tp_group: the tensor-parallel group the vocab is split over; ``None`` (or a group of one)
            means the full vocab is local.
        temperature: the sampling temperature ``T > 0``; logits are divided by it before softmax.
        chunk_size: tokens per chunk; peak extra memory is about ``chunk_size * V_local * 4``
            bytes (``* 6`` for bf16 inputs) besides the gradients. ``None``:
            :func:`default_chunk_size` of the weight shard. Every tp rank must use the same.
        with_entropy: also return the entropy of ``softmax(z)`` per token (differentiable).
        vocab_size: the true vocab size when Megatron padded the weight rows to a multiple of
            ``make_vocab_size_divisible_by * tp``; ids ``>= vocab_size`` are left out of the
            softmax so the result equals the unpadded model's (and the rollout engine's). ``None``
            means every row counts.

    Returns:
        ``(log_probs, entropy)``: fp32 tensors of ``labels.shape``; ``entropy`` is ``None`` unless
        ``with_entropy``. Gradients reach ``hidden`` and ``weight`` in their own dtypes; for a
        weight under Megatron DDP whose ``main_grad`` has the weight's dtype, the weight gradient
        is added to ``weight.main_grad`` directly and ``weight.grad_added_to_main_grad`` is set,
        exactly as Megatron's own linear layers do with gradient-accumulation fusion (so
        ``torch.autograd.grad`` wrt such a weight returns a placeholder, not the gradient).

    Gradient contract under tp (read this before calling with ``tp_group`` of size > 1):
        The gradient written to ``weight`` is complete for this rank's rows (no tp reduction; the
        usual data-parallel reduction still applies). The gradient written to ``hidden`` is only
        the **partial** sum over this rank's vocab shard, ``dz_local @ W_local``; the full
        gradient is its SUM over ``tp_group``. This function does NOT reduce it, exactly like the
        matmul inside Megatron's ``ColumnParallelLinear``; the caller provides the reduction the
        same way ``ColumnParallelLinear`` does:

        * no sequence parallel: ``hidden = copy_to_tensor_model_parallel_region(hidden)``
          (identity forward, all-reduce SUM backward) before calling;
        * sequence parallel: ``hidden = gather_from_sequence_parallel_region(hidden,
          tensor_parallel_output_grad=True)`` (all-gather forward, reduce-scatter backward),
          which sums the partials and hands each rank its own sequence slice; an extra
          all-reduce here would multiply the gradient by the tp size.

        The forward issues two collectives per chunk on ``tp_group`` (all-reduce MAX of shard
        maxima, then one all-reduce SUM of ``[sum exp, target logit, sum p z]``); every tp rank
        must call it with the same token count and ``chunk_size``. The backward has no collective.

    Synchronisation: labels are range-checked on the host (one device sync per call), so a bad
    id raises here instead of silently reading target logit 0.

    Precision: logits, softmax statistics, log-probs and entropy are fp32. The matmuls run in the
    input dtype (bf16 on GPU, with fp32 accumulation inside each GEMM); the weight gradient is
    accumulated across chunks in the weight dtype, as Liger's fused linear cross-entropy does.
    """
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], weight.shape[1], weight.dtype)
    _check_inputs(hidden, weight, labels, temperature, chunk_size, vocab_size)
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    local_vocab = weight.shape[0]
    vocab_start = tp_rank * local_vocab
    if vocab_size is None:
        vocab_size = local_vocab * tp_size
    if vocab_size > local_vocab * tp_size:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the tp-padded vocab {local_vocab} * {tp_size}: "
            "weight holds fewer rows than the vocabulary; pass this rank's shard of the full "
            "output-layer weight and the unpadded vocab size"
        )
    _check_label_range(labels, vocab_size)
    # Padded rows (ids >= vocab_size) are dropped by slicing the shard, so they get neither
    # probability mass nor gradient; a shard can be entirely padding (0 valid rows).
    valid_local_vocab = min(max(vocab_size - vocab_start, 0), local_vocab)

    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).long()
    outputs = _VocabParallelLogProbs.apply(
        hidden_2d,
        weight,
        labels_1d,
        tp_group,
        float(temperature),
        int(chunk_size),
        bool(with_entropy),
        vocab_start,
        valid_local_vocab,
    )
    if with_entropy:
        log_probs, entropy = outputs
        return log_probs.reshape(labels.shape), entropy.reshape(labels.shape)
    return outputs.reshape(labels.shape), None


def _check_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    chunk_size: int,
    vocab_size: int | None,
) -> None:
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match: expected "
            "hidden [..., H] and weight [V_local, H] (the output layer's local rows)"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}: labels must "
            "have shape hidden.shape[:-1]; Megatron hidden states are [s, b, H] while batches are "
            "[b, s], so transpose one of them first"
        )
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(
            f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share one floating dtype; "
            "cast the hidden states to the output layer's dtype"
        )
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) must "
            "be on one device"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 (or int32) token ids, got {labels.dtype}")
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature}; use the sampling temperature"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")


def _check_label_range(labels: torch.Tensor, vocab_size: int) -> None:
    # One host sync; an id outside every shard would otherwise silently give target logit 0.
    if labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(
            f"label id {int(labels.max())} is >= the vocab size {vocab_size}; the tokenizer and "
            "the model disagree, or padding uses a positive id (mark ignored positions with -100)"
        )


class _VocabParallelLogProbs(torch.autograd.Function):
    """Chunked fused linear + vocab-parallel log-softmax; recomputes logits in backward.

    Saves ``hidden``, ``weight``, ``labels`` and per token ``lse`` (+ ``E_p[z]`` with entropy).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        tp_group: ProcessGroup | None,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        vocab_start: int,
        valid_local_vocab: int,
    ):
        num_tokens = hidden.shape[0]
        local_weight = weight[:valid_local_vocab]
        local_labels, on_shard = _local_labels(labels, vocab_start, valid_local_vocab)
        log_probs = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
        log_sum_exp = torch.empty_like(log_probs)
        entropy = torch.empty_like(log_probs) if with_entropy else None
        expected_logit = torch.empty_like(log_probs) if with_entropy else None
        workspace = _Workspace(min(chunk_size, num_tokens), valid_local_vocab, hidden)

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = workspace.logits(hidden[start:end], local_weight, temperature)
            row_max = _row_max(logits)
            if tp_group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
            # Shift by the GLOBAL max so every shard's exp() is on one scale (and cannot overflow).
            logits.sub_(row_max.unsqueeze(1))
            statistics = torch.empty(3 if with_entropy else 2, end - start, device=hidden.device)
            statistics[1] = _target_logit(logits, local_labels[start:end], on_shard[start:end])
            for block in workspace.row_blocks(end - start):
                exp_logits = torch.exp(logits[block], out=workspace.scratch(block))
                statistics[0, block] = exp_logits.sum(1)
                if with_entropy:
                    # sum_v e_v (z_v - m): E_p[z] - m once divided by the global sum of exp.
                    statistics[2, block] = exp_logits.mul_(logits[block]).sum(1)
            if tp_group is not None:
                dist.all_reduce(statistics, op=dist.ReduceOp.SUM, group=tp_group)
            log_sum_exp_shifted = statistics[0].log()
            log_probs[start:end] = statistics[1] - log_sum_exp_shifted
            log_sum_exp[start:end] = row_max + log_sum_exp_shifted
            if with_entropy:
                # H = lse - E_p[z] = log S - sum_v p_v (z_v - m), computed in shifted form.
                expected_shifted = statistics[2] / statistics[0]
                entropy[start:end] = log_sum_exp_shifted - expected_shifted
                expected_logit[start:end] = row_max + expected_shifted

        ignored = labels < 0
        log_probs.masked_fill_(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, labels, log_sum_exp, expected_logit)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.vocab_start = vocab_start
        ctx.valid_local_vocab = valid_local_vocab
        ctx.set_materialize_grads(False)
        if with_entropy:
            entropy.masked_fill_(ignored, 0.0)
            return log_probs, entropy
        return log_probs

    @staticmethod
    def backward(ctx, *grad_outputs):
        hidden, weight, labels, log_sum_exp, expected_logit = ctx.saved_tensors
        grad_log_probs = grad_outputs[0]
        grad_entropy = grad_outputs[1] if len(grad_outputs) > 1 else None
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_log_probs is None and grad_entropy is None) or not (need_hidden or need_weight):
            return (None,) * 9

        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        ignored = (labels < 0).unsqueeze(1)
        # Ignored positions contribute nothing, whatever gradient the caller sends them. dL/dz is
        # linear in (g_lp, g_H), so dz/dx = 1/T is folded into them: one pass less over [C, V].
        if grad_log_probs is not None:
            grad_log_probs = grad_log_probs.float().unsqueeze(1).masked_fill(ignored, 0.0)
            grad_log_probs = grad_log_probs / temperature
        if grad_entropy is not None:
            grad_entropy = grad_entropy.float().unsqueeze(1).masked_fill(ignored, 0.0)
            grad_entropy = grad_entropy / temperature

        valid_local_vocab = ctx.valid_local_vocab
        local_weight = weight[:valid_local_vocab]
        local_labels, on_shard = _local_labels(labels, ctx.vocab_start, valid_local_vocab)
        num_tokens = hidden.shape[0]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        main_grad = _main_grad_target(weight) if need_weight else None
        grad_weight = None
        if need_weight and main_grad is None:
            grad_weight = torch.zeros_like(weight)
        if valid_local_vocab == 0:
            if main_grad is not None:
                grad_weight = _placeholder_grad(weight)
            return grad_hidden, grad_weight, *(None,) * 7
        grad_local_weight = None
        if need_weight:
            accumulator = main_grad if main_grad is not None else grad_weight
            grad_local_weight = accumulator[:valid_local_vocab]
        workspace = _Workspace(min(chunk_size, num_tokens), valid_local_vocab, hidden)

        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            hidden_chunk = hidden[start:end]
            # Recompute: z, then z - lse = log p in place.
            grad_logits = workspace.logits(hidden_chunk, local_weight, temperature)
            grad_logits.sub_(log_sum_exp[start:end].unsqueeze(1))
            if grad_entropy is None:
                # dL/dz = g_lp * (onehot - p): only the -g_lp * p part here, onehot below.
                grad_logits.exp_().mul_(grad_log_probs[start:end].neg())
            else:
                # log p + (lse - E_p[z]) = z - E_p[z]; dH/dz = -p (z - E_p[z]).
                shift = (log_sum_exp[start:end] - expected_logit[start:end]).unsqueeze(1)
                neg_grad_entropy = grad_entropy[start:end].neg()
                for block in workspace.row_blocks(end - start):
                    probs = torch.exp(grad_logits[block], out=workspace.scratch(block))
                    grad_logits[block].add_(shift[block]).mul_(probs).mul_(neg_grad_entropy[block])
                    if grad_log_probs is not None:
                        grad_logits[block].addcmul_(
                            probs, grad_log_probs[start:end][block], value=-1.0
                        )
            if grad_log_probs is not None:
                # onehot_y * g_lp for the rows whose label lives on this shard (others add 0).
                owned = torch.where(
                    on_shard[start:end].unsqueeze(1),
                    grad_log_probs[start:end],
                    torch.zeros_like(grad_log_probs[start:end]),
                )
                grad_logits.scatter_add_(1, local_labels[start:end].unsqueeze(1), owned)
            grad_logits = workspace.narrow(grad_logits)
            if need_hidden:
                # Partial over this vocab shard; the caller's tp region op sums it (see docstring).
                torch.mm(grad_logits, local_weight, out=grad_hidden[start:end])
            if need_weight:
                grad_local_weight.addmm_(grad_logits.t(), hidden_chunk)
        if main_grad is not None:
            grad_weight = _placeholder_grad(weight)
        return grad_hidden, grad_weight, *(None,) * 7


def _main_grad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight.main_grad`` when the weight gradient may be accumulated into it directly, else None.

    Megatron DDP gives each parameter ``main_grad`` (a view of its gradient buffer) and
    ``grad_added_to_main_grad`` (reset by ``zero_grad_buffer``); its backward hook adds
    ``param.grad`` to ``main_grad`` unless that flag is set, which is how Megatron's linear layers
    with gradient-accumulation fusion skip the ``[V_local, H]`` gradient tensor. Same dtype only:
    a bf16 weight over an fp32 buffer keeps the path below (bf16 GEMMs, then DDP's fp32 add).
    """
    main_grad = getattr(weight, "main_grad", None)
    if (
        main_grad is None
        or not hasattr(weight, "grad_added_to_main_grad")
        or main_grad.dtype != weight.dtype
        or main_grad.shape != weight.shape
    ):
        return None
    return main_grad


def _placeholder_grad(weight: torch.Tensor) -> torch.Tensor:
    """What autograd receives for a weight whose gradient already is in ``main_grad``.

    Megatron's protocol: mark the gradient as added (DDP's hook then drops ``param.grad``
    instead of adding it) and hand autograd an uninitialised tensor, whose pages are never touched
    (no resident memory on CPU). Zeros when the weight is also used elsewhere on this pipeline
    stage (``zero_out_wgrad``, tied embeddings): autograd sums the embedding's gradient into the
    placeholder, and DDP's hook then adds that sum.
    """
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros_like(weight)
    return torch.empty_like(weight)


def _local_labels(
    labels: torch.Tensor, vocab_start: int, valid_local_vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard-local column of each label (0 where not on this shard) and the on-shard mask."""
    local = labels - vocab_start
    on_shard = (local >= 0) & (local < valid_local_vocab) & (labels >= 0)
    return torch.where(on_shard, local, torch.zeros_like(local)), on_shard


def _target_logit(
    logits: torch.Tensor, local_labels: torch.Tensor, on_shard: torch.Tensor
) -> torch.Tensor:
    """``logits[i, local_labels[i]]`` where the label is on this shard, else 0 (summed over tp)."""
    if logits.shape[1] == 0:
        return torch.zeros(logits.shape[0], device=logits.device)
    target = logits.gather(1, local_labels.unsqueeze(1)).squeeze(1)
    return torch.where(on_shard, target, torch.zeros_like(target))


def _row_max(logits: torch.Tensor) -> torch.Tensor:
    if logits.shape[1] == 0:
        # A shard made only of padded rows: no mass, lets the other shards set the max.
        return torch.full((logits.shape[0],), float("-inf"), device=logits.device)
    return logits.amax(1)


class _Workspace:
    """Per-call buffers reused across chunks: fp32 logits ``[chunk, V_local]``, a copy of them in
    the input dtype when that is not fp32 (the GEMM writes its own dtype), and a small fp32
    scratch ``[rows, V_local]`` for elementwise passes done a block of rows at a time.

    Reuse matters on CPU, where each fresh large allocation is a new mmap whose pages fault in
    again (on GPU the caching allocator does this for us). The row blocks keep the second
    chunk-sized fp32 buffer (``exp(z)``) from ever existing: peak memory is about one
    ``[chunk, V_local]`` fp32 buffer, half that again for bf16 inputs.
    """

    def __init__(self, rows: int, columns: int, like: torch.Tensor) -> None:
        self._logits = torch.empty(rows, columns, dtype=torch.float32, device=like.device)
        self._narrow = (
            torch.empty(rows, columns, dtype=like.dtype, device=like.device)
            if like.dtype != torch.float32
            else None
        )
        self._block_rows = max(1, min(rows, ELEMENTWISE_BLOCK_ELEMENTS // max(columns, 1)))
        self._scratch = torch.empty(
            self._block_rows, columns, dtype=torch.float32, device=like.device
        )

    def logits(
        self, hidden_chunk: torch.Tensor, weight: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        """``(hidden_chunk @ weight.T).float() / temperature`` into the reused fp32 buffer."""
        rows = hidden_chunk.shape[0]
        logits = self._logits[:rows]
        if self._narrow is None:
            torch.mm(hidden_chunk, weight.t(), out=logits)
        else:
            logits.copy_(torch.mm(hidden_chunk, weight.t(), out=self._narrow[:rows]))
        if temperature != 1.0:
            logits.div_(temperature)
        return logits

    def narrow(self, values: torch.Tensor) -> torch.Tensor:
        """fp32 ``values`` in the input dtype, for the backward GEMMs (no copy for fp32)."""
        if self._narrow is None:
            return values
        return self._narrow[: values.shape[0]].copy_(values)

    def row_blocks(self, rows: int) -> list[slice]:
        return [
            slice(start, min(start + self._block_rows, rows))
            for start in range(0, rows, self._block_rows)
        ]

    def scratch(self, block: slice) -> torch.Tensor:
        return self._scratch[: block.stop - block.start]
