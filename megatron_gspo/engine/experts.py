"""The MoE experts on CPU: Megatron's ``SequentialMLP`` math with the per-expert autograd layers
flattened into plain tensor ops.

Without Transformer Engine or ``grouped_gemm`` Megatron runs the local experts as a Python loop
of ``MLP`` modules, each with two Megatron linear autograd Functions, an activation and a probs
product: many small autograd nodes, which dominate at RL-test sizes on CPU.
:func:`batched_experts_forward` computes the same operations in the same order on the same
parameters (one ``matmul`` per expert and layer, the activation and the probs product once over
all rows), so outputs and gradients are bit-identical to upstream, and the parameters, their
names, the checkpoint layout and the DDP gradient hooks are untouched. ``engine/cpu_speed_shims.py``
routes ``SequentialMLP.forward`` here on CPU when :func:`batched_experts_supported`.

Forward+backward of the experts, 1 thread, medians on the shared 2-core CI box (ms), upstream ->
batched: h64 F48 8 experts 800 rows 2.9-3.6 -> 1.8-2.3; a whole MoE layer (router, dispatcher,
experts) 400 tokens top-2 3.3-3.8 -> 2.4-2.7; h1024 F512 64 experts 4096 rows 413-438 ->
400-497 (GEMM-bound: no gain, no loss). ``torch._grouped_mm`` over stacked weights was measured
too: as fast at the small size, much slower at the large one (the stack copies every weight
each forward), and its CPU kernel needs 16-byte aligned rows; not used.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import activations
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP


def _elementwise_activations() -> tuple[Callable, ...]:
    extra = (getattr(activations, name, None) for name in ("squared_relu", "quick_gelu"))
    return (F.silu, F.gelu, F.relu, *(f for f in extra if f is not None))


def _hooked(module: torch.nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    )


def _plain_linear_structure(linear: Any, kind: type) -> bool:
    """A local-spec linear that computes ``x @ W^T`` and nothing else (its dtype, device and
    hooks aside, which :func:`batched_experts_supported` checks per call)."""
    return (
        type(linear) is kind
        and linear.bias is None
        and not linear.gradient_accumulation_fusion
        and linear.weight is not None
        and (linear.tp_group is None or linear.tp_group.size() == 1)
    )


def _supported_structure(experts: Any) -> bool:
    """The part of :func:`batched_experts_supported` fixed when the module is built: its config,
    the types, forwards and activations of its local experts and the kind of their linears."""
    config = experts.config
    local_experts = getattr(experts, "local_experts", None)
    tp_group = getattr(experts, "tp_group", None)
    if (
        local_experts is None
        or len(local_experts) < 2
        or (tp_group is not None and tp_group.size() != 1)
        or getattr(config, "fp8", None)
        or getattr(config, "fp4", None)
        or getattr(config, "use_te_activation_func", False)
        or getattr(config, "bias_activation_fusion", False)
        or getattr(config, "defer_embedding_wgrad_compute", False)
        or getattr(config, "_cpu_offloading_context", None) is not None
        # Megatron allows probs on the input with top-1 routing only.
        or (getattr(config, "moe_apply_probs_on_input", False) and config.moe_router_topk != 1)
        or config.activation_func not in _elementwise_activations()
    ):
        return False
    return all(
        type(expert).forward is MLP.forward
        and (config.gated_linear_unit or expert.activation_func is config.activation_func)
        and _plain_linear_structure(getattr(expert, "linear_fc1", None), ColumnParallelLinear)
        and _plain_linear_structure(getattr(expert, "linear_fc2", None), RowParallelLinear)
        for expert in local_experts
    )


_STRUCTURE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""experts module -> (its config, the layer classes' forwards, :func:`_supported_structure`):
checked once per module and forward pair, since they do not change after the model is built; a
new config object or a patched ``MLP.forward`` checks again."""


def batched_experts_supported(
    experts: Any, hidden: torch.Tensor, tokens_per_expert: Any, probs: Any
) -> bool:
    """Whether :func:`batched_experts_forward` computes exactly what ``SequentialMLP.forward``
    would: CPU, several local experts, the local spec's linears without bias at expert tensor
    parallel 1, no fp8/fp4, no fused or TE activation, an elementwise activation, no hooks.

    What is fixed when the model is built is checked once per experts module (a few hundred
    microseconds per MoE layer and forward at 8 experts otherwise); the inputs, hooks, dtypes and
    devices on every call."""
    if (
        hidden.device.type != "cpu"
        or hidden.dim() != 2
        or not torch.is_tensor(probs)
        or probs.shape != hidden.shape[:1]
        or not torch.is_tensor(tokens_per_expert)
    ):
        return False
    key = (experts.config, MLP.forward)
    cached = _STRUCTURE.get(experts)
    if cached is None or cached[0] is not key[0] or cached[1] is not key[1]:
        cached = (*key, _supported_structure(experts))
        _STRUCTURE[experts] = cached
    if not cached[2]:
        return False
    local_experts = experts.local_experts
    if tokens_per_expert.shape != (len(local_experts),):
        return False
    dtype, device = hidden.dtype, hidden.device
    for expert in local_experts:
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        if _hooked(expert) or _hooked(fc1) or _hooked(fc2):
            return False
        for weight in (fc1.weight, fc2.weight):
            if weight.dtype != dtype or weight.device != device:
                return False
    return int(tokens_per_expert.sum()) == hidden.shape[0]


def _per_expert_linear(
    inputs: torch.Tensor, weights: Sequence[torch.Tensor], counts: list[int]
) -> torch.Tensor:
    """``[T, in] -> [T, out]``: the rows of expert ``e`` times ``weights[e]`` ``[out, in]``
    transposed, as the linear layers compute it at tensor parallel 1."""
    parts = torch.split(inputs, counts)
    return torch.cat([torch.mm(part, weight.t()) for part, weight in zip(parts, weights)])


def _activate(config: Any, intermediate: torch.Tensor, probs: torch.Tensor, dtype) -> torch.Tensor:
    """``[T, F1] -> [T, F]``: the (gated) activation times the routing probabilities."""
    if config.gated_linear_unit:
        gate, linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := getattr(config, "activation_func_clamp_value", None)) is not None:
            gate = gate.clamp(min=None, max=clamp)
            linear = linear.clamp(min=-clamp, max=clamp)
        offset = getattr(config, "glu_linear_offset", 0.0)
        activated = config.activation_func(gate) * (linear + offset)
    else:
        activated = config.activation_func(intermediate)
    return (activated * probs.unsqueeze(-1)).to(dtype)


class _Experts(torch.autograd.Function):
    """The experts' forward and backward as ONE autograd node.

    Saved for backward: the input rows, the first linear's output and the probabilities; the
    activation is recomputed in backward (as Megatron's ``moe_act`` recomputation does), so the
    activation's intermediates (gate, activated gate, product, scaled product) are not kept
    between forward and backward: at hidden 512 / 32 experts top-4 / intermediate 256 that is
    68 -> 34 MB per layer and mini-batch of 2,192 tokens. The gradients are the very products
    autograd forms for upstream's per-expert ``matmul(x_e, W_e^T)``: ``dx_e = g_e W_e`` and
    ``dW_e = g_e^T x_e``, and the activation's come from autograd on the recomputed activation.
    """

    @staticmethod
    def forward(ctx, hidden, probs, counts, config, num_experts, *weights):
        fc1, fc2 = weights[:num_experts], weights[num_experts:]
        intermediate = _per_expert_linear(hidden, fc1, counts)
        activated = _activate(config, intermediate, probs, hidden.dtype)
        out = _per_expert_linear(activated, fc2, counts)
        ctx.save_for_backward(hidden, intermediate, probs, *weights)
        ctx.counts, ctx.config, ctx.num_experts = counts, config, num_experts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, intermediate, probs, *weights = ctx.saved_tensors
        counts, num_experts = ctx.counts, ctx.num_experts
        fc1, fc2 = weights[:num_experts], weights[num_experts:]
        config = ctx.config
        plain_swiglu = (
            config.gated_linear_unit
            and config.activation_func is F.silu
            and getattr(config, "activation_func_clamp_value", None) is None
        )
        if plain_swiglu:
            # Autograd's own products for silu(g) * (l + c) * p, without a nested autograd run.
            gate, linear = torch.chunk(intermediate, 2, dim=-1)
            offset = getattr(config, "glu_linear_offset", 0.0)
            if offset:
                linear = linear + offset
            silu_gate = F.silu(gate)
            product = silu_gate * linear
            activated = (product * probs.unsqueeze(-1)).to(hidden.dtype)
        else:
            with torch.enable_grad():
                intermediate = intermediate.detach().requires_grad_()
                probs = probs.detach().requires_grad_(ctx.needs_input_grad[1])
                activated = _activate(config, intermediate, probs, hidden.dtype)
        grad_parts = torch.split(grad_out, counts)
        activated_parts = torch.split(activated.detach(), counts)
        grad_activated = torch.cat(
            [torch.mm(grad, weight) for grad, weight in zip(grad_parts, fc2)]
        )
        grad_fc2 = [torch.mm(grad.t(), part) for grad, part in zip(grad_parts, activated_parts)]
        if plain_swiglu:
            grad_activated = grad_activated.to(product.dtype)
            grad_product = grad_activated * probs.unsqueeze(-1)
            grad_probs = (grad_activated * product).sum(-1) if ctx.needs_input_grad[1] else None
            grad_gate = torch.ops.aten.silu_backward(grad_product * linear, gate)
            grads = (torch.cat([grad_gate, grad_product * silu_gate], dim=-1), grad_probs)
        else:
            inputs = (intermediate, probs) if ctx.needs_input_grad[1] else (intermediate,)
            grads = torch.autograd.grad(activated, inputs, grad_activated)
            if not ctx.needs_input_grad[1]:
                grads = (grads[0], None)
        grad_parts = torch.split(grads[0], counts)
        grad_hidden = torch.cat([torch.mm(grad, weight) for grad, weight in zip(grad_parts, fc1)])
        hidden_parts = torch.split(hidden, counts)
        grad_fc1 = [torch.mm(grad.t(), part) for grad, part in zip(grad_parts, hidden_parts)]
        return grad_hidden, grads[1], None, None, None, *grad_fc1, *grad_fc2


def batched_experts_forward(
    experts: Any,
    permuted_local_hidden_states: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    permuted_probs: torch.Tensor,
) -> tuple[torch.Tensor, None]:
    """``SequentialMLP.forward`` of ``experts``, with the per-expert modules flattened.

    Rows of ``permuted_local_hidden_states`` ``[T, h]`` are grouped by local expert
    (``tokens_per_expert`` ``[E]``); per expert ``e`` with ``W1_e`` ``[F1, h]``, ``W2_e``
    ``[h, F]`` (F1 = 2F gated) and ``p`` = ``permuted_probs`` ``[T]``::

        x = p * x                           if moe_apply_probs_on_input (top-1; then p = 1)
        a = x W1_e^T                        [T_e, F1]
        a = act(a[:, :F]) * (a[:, F:] + c)  gated (Megatron's glu; optional clamps, offset c)
        a = act(a)                          otherwise
        y = (a * p) W2_e^T                  [T_e, h]

    Returns ``(y [T, h], None)`` like upstream (no expert bias).
    """
    config = experts.config
    hidden, probs = permuted_local_hidden_states, permuted_probs
    dtype = hidden.dtype
    if config.moe_apply_probs_on_input:
        hidden = (probs.unsqueeze(-1) * hidden).to(dtype)
        probs = torch.ones_like(probs)
    counts = tokens_per_expert.tolist()
    fc1 = [expert.linear_fc1.weight for expert in experts.local_experts]
    fc2 = [expert.linear_fc2.weight for expert in experts.local_experts]
    if torch.is_grad_enabled() and (
        hidden.requires_grad or probs.requires_grad or any(w.requires_grad for w in fc1 + fc2)
    ):
        return _Experts.apply(hidden, probs, counts, config, len(fc1), *fc1, *fc2), None
    with torch.no_grad():
        activated = _activate(config, _per_expert_linear(hidden, fc1, counts), probs, dtype)
        return _per_expert_linear(activated, fc2, counts), None
