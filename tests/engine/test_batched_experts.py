"""The ``batched_experts`` CPU shim (``engine/experts.py``) against upstream ``SequentialMLP.forward``.

The checks run in a fresh process (this file run as a script) because the CPU shims change torch
and megatron globals. Each compares the shimmed forward with the original one (kept as
``SequentialMLP.forward.__wrapped__``) on real Megatron modules: outputs and the gradients of
the input, the routing probabilities and every expert weight, to 1e-6 relative.

* uneven token counts, an expert without tokens, all tokens on one expert, no tokens at all, an
  expanded output gradient (``out.sum().backward()``), a strided input, a no-grad forward;
* the other configurations it claims: a plain (non-gated) activation, Megatron's glu clamp and
  linear offset, ``moe_apply_probs_on_input``;
* unsupported configurations fall back to upstream: expert biases, a hook on an expert, one
  local expert;
* a whole training forward/backward of a Qwen3-MoE policy under Megatron DDP: loss and every
  ``main_grad`` equal upstream's, and the shim did run.

``python tests/engine/test_batched_experts.py --time`` prints forward+backward times (upstream,
batched; 1 thread; medians) of the experts at two shapes and of a whole MoE layer.
"""

from __future__ import annotations

import copy
import functools
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from worker_launch import run_checks, run_json_worker

CHECKS = [
    "matches_upstream",
    "matches_upstream_for_other_activations",
    "falls_back_when_unsupported",
    "ddp_main_grads_match_upstream",
]
TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def results() -> dict:
    return run_json_worker(Path(__file__), timeout=300)


def test_every_check_ran(results):
    assert sorted(results) == sorted(CHECKS)


@pytest.mark.parametrize("check", CHECKS)
def test_batched_experts(results, check):
    assert results[check] == "ok", results[check]


# ---------------------------------------------------------------------------------------------
# Worker (a fresh process)
# ---------------------------------------------------------------------------------------------


def _build_experts(num_experts: int = 8, hidden: int = 64, ffn: int = 48, **config_changes):
    """A real ``SequentialMLP`` of ``num_experts`` local experts (local spec linears) with random
    weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.engine.model import transformer_config

    model = ModelConfig(
        hidden_size=hidden,
        moe_ffn_hidden_size=ffn,
        # The router's config; the experts module may hold fewer (one local expert).
        num_experts=max(num_experts, 2),
        moe_router_topk=2,
    )
    config = copy.deepcopy(transformer_config(model, ParallelConfig()))
    for name, value in config_changes.items():
        setattr(config, name, value)
    experts = SequentialMLP(
        num_experts,
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    generator = torch.Generator().manual_seed(num_experts * 1000 + hidden)
    with torch.no_grad():
        for parameter in experts.parameters():
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return experts


def _counts(total: int, num_experts: int, empty: tuple[int, ...] = ()) -> torch.Tensor:
    """Uneven tokens per expert summing to ``total``, zero for the experts in ``empty``."""
    generator = torch.Generator().manual_seed(total + num_experts)
    weights = torch.rand(num_experts, generator=generator) + 0.1
    weights[list(empty)] = 0.0
    counts = (weights / weights.sum() * total).floor().long()
    counts[int(weights.argmax())] += total - int(counts.sum())
    return counts


def _graph_nodes(tensor: torch.Tensor) -> set[str]:
    """Names of the autograd nodes behind ``tensor``."""
    seen, names, stack = set(), set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def _forward_backward(
    forward,
    experts,
    counts: torch.Tensor,
    *,
    expanded_gradient: bool = False,
    strided_input: bool = False,
):
    """Output, its autograd node names, and the gradients of input, probs and every parameter."""
    hidden_size = experts.local_experts[0].linear_fc1.weight.shape[1]
    total = int(counts.sum())
    generator = torch.Generator().manual_seed(total)
    leaf = torch.randn(total, hidden_size * (2 if strided_input else 1), generator=generator)
    leaf.requires_grad_()
    hidden = leaf[:, ::2] if strided_input else leaf
    probs = torch.rand(total, generator=generator).requires_grad_()
    experts.zero_grad(set_to_none=True)
    output, bias = forward(experts, hidden, counts, probs)
    assert bias is None
    if expanded_gradient:
        output.sum().backward()
    else:
        output.backward(torch.randn(output.shape, generator=generator))
    grads = {name: p.grad for name, p in experts.named_parameters()}
    return output.detach(), _graph_nodes(output), leaf.grad, probs.grad, grads


def _assert_close(actual, expected, what: str) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    error = (actual - expected).abs().max().item() if expected.numel() else 0.0
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert error <= TOLERANCE * max(scale, 1e-30), f"{what}: max error {error:.3g} of {scale:.3g}"


def _compare_with_upstream(experts, counts, **kwargs) -> set[str]:
    """Shimmed forward vs upstream; returns the autograd node names of the shimmed output."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    upstream = SequentialMLP.forward.__wrapped__
    output, nodes, hidden_grad, probs_grad, grads = _forward_backward(
        SequentialMLP.forward, experts, counts, **kwargs
    )
    ref_output, _, ref_hidden_grad, ref_probs_grad, ref_grads = _forward_backward(
        upstream, experts, counts, **kwargs
    )
    _assert_close(output, ref_output, "output")
    _assert_close(hidden_grad, ref_hidden_grad, "input gradient")
    _assert_close(probs_grad, ref_probs_grad, "probs gradient")
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        # Upstream gives an expert without tokens a zero gradient (not None): so must we.
        assert grad is not None and ref_grads[name] is not None, name
        _assert_close(grad, ref_grads[name], name)
    return nodes


MEGATRON_LINEAR_NODE = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def check_matches_upstream() -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = _build_experts()
    with torch.no_grad():  # a log-prob forward
        counts = _counts(100, 8, empty=(3,))
        hidden, probs = torch.randn(100, 64), torch.rand(100)
        output, _ = SequentialMLP.forward(experts, hidden, counts, probs)
        expected, _ = SequentialMLP.forward.__wrapped__(experts, hidden, counts, probs)
        _assert_close(output, expected, "no-grad output")
    cases = [
        (_counts(800, 8, empty=(1,)), {}),  # the benchmark's micro-batch, one idle expert
        (_counts(37, 8, empty=(0, 5)), {}),
        (torch.tensor([0, 0, 0, 21, 0, 0, 0, 0]), {}),
        (torch.zeros(8, dtype=torch.long), {}),
        (_counts(50, 8), {"expanded_gradient": True}),
        (_counts(40, 8), {"strided_input": True}),
    ]
    for counts, kwargs in cases:
        nodes = _compare_with_upstream(experts, counts, **kwargs)
        assert MEGATRON_LINEAR_NODE not in nodes, counts
        assert "_ExpertsBackward" in nodes, (counts, nodes)


def check_matches_upstream_for_other_activations() -> None:
    import torch.nn.functional as F

    configs = {
        "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
        "glu clamp + offset": dict(activation_func_clamp_value=0.05, glu_linear_offset=1.0),
        "probs on input": dict(moe_apply_probs_on_input=True, moe_router_topk=1),
    }
    for name, changes in configs.items():
        experts = _build_experts(num_experts=4, hidden=32, ffn=16, **changes)
        for counts in (_counts(30, 4, empty=(2,)), _counts(9, 4)):
            try:
                nodes = _compare_with_upstream(experts, counts)
            except AssertionError as error:
                raise AssertionError(f"{name}: {error}") from error
            assert MEGATRON_LINEAR_NODE not in nodes, name


def _error_of(forward, experts, counts: torch.Tensor, rows: int) -> str:
    try:
        forward(experts, torch.zeros(rows, 32, requires_grad=True), counts, torch.ones(rows))
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def check_falls_back_when_unsupported() -> None:
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_gspo.engine.experts import batched_experts_supported

    calls = []
    hooked = _build_experts(num_experts=4, hidden=32, ffn=16)
    hooked.local_experts[2].register_forward_hook(lambda *args: calls.append(args[0]))
    unsupported = {
        "forward hook on an expert": hooked,
        "one local expert": _build_experts(num_experts=1, hidden=32, ffn=16),
    }
    for name, experts in unsupported.items():
        counts = _counts(24, experts.num_local_experts)
        hidden = torch.zeros(24, 32)
        assert not batched_experts_supported(experts, hidden, counts, torch.ones(24)), name
        nodes = _compare_with_upstream(experts, counts)
        assert MEGATRON_LINEAR_NODE in nodes, (name, nodes)
    assert calls, "the expert's forward hook did not run"

    # Upstream's own errors surface unchanged: expert biases at ep = etp = 1 fail in MLP.forward
    # on CPU (an in-place add on a custom Function's returned input), and token counts that do
    # not add up to the rows fail in torch.split.
    upstream = SequentialMLP.forward.__wrapped__
    biased = _build_experts(num_experts=4, hidden=32, ffn=16, add_bias_linear=True)
    plain = _build_experts(num_experts=4, hidden=32, ffn=16)
    for name, experts, rows in (("expert bias", biased, 12), ("wrong counts", plain, 10)):
        counts = torch.tensor([3, 3, 3, 3])
        hidden = torch.zeros(rows, 32)
        assert not batched_experts_supported(experts, hidden, counts, torch.ones(rows))
        error = _error_of(SequentialMLP.forward, experts, counts, rows)
        assert error == _error_of(upstream, experts, counts, rows) != "no error", (name, error)


def check_ddp_main_grads_match_upstream() -> None:
    """One GSPO forward/backward of the layout tests' Qwen3-MoE under Megatron DDP (grad buffers
    filled by the per-parameter backward hooks), shimmed vs upstream."""
    sys.path.insert(0, str(Path(__file__).parent))
    from layout_worker import make_config, make_samples
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_gspo.engine import experts
    from megatron_gspo.engine.sharding import gather_full_state
    from megatron_gspo.engine.train_step import TrainEngine

    engine = TrainEngine(make_config("moe", "", 10_000))
    samples = make_samples()
    calls = []
    batched = experts.batched_experts_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return batched(*args, **kwargs)

    shimmed = SequentialMLP.forward
    experts.batched_experts_forward = counting
    try:
        metrics = engine.forward_backward(samples)
    finally:
        experts.batched_experts_forward = batched
    grads = gather_full_state(engine.model, grads=True)
    assert calls, "the batched experts did not run"
    SequentialMLP.forward = shimmed.__wrapped__
    try:
        ref_metrics = engine.forward_backward(samples)
    finally:
        SequentialMLP.forward = shimmed
    ref_grads = gather_full_state(engine.model, grads=True)
    loss, ref_loss = metrics["loss"], ref_metrics["loss"]
    assert abs(loss - ref_loss) <= TOLERANCE * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    expert_grads = [name for name in grads if ".experts." in name]
    assert expert_grads and all(grads[name].abs().sum() > 0 for name in expert_grads)
    for name, grad in grads.items():
        _assert_close(grad, ref_grads[name], name)


def _moe_layer():
    """A Qwen3-MoE layer of the vs_trl benchmark's shape: router, alltoall dispatcher, experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.engine.model import transformer_config

    config = transformer_config(ModelConfig(), ParallelConfig())
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm"
    )
    layer = build_module(
        block.layer_specs[0].submodules.mlp,
        config=config,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    layer.set_layer_number(1)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    return layer


def _median_ms(variants: dict, step, repeats: int) -> dict:
    """Interleaved runs (the cores are shared), first one dropped; median milliseconds."""
    times = {name: [] for name in variants}
    for _ in range(repeats + 1):
        for name, forward in variants.items():
            start = time.perf_counter()
            step(forward)
            times[name].append(time.perf_counter() - start)
    return {name: round(1e3 * statistics.median(t[1:]), 3) for name, t in times.items()}


def time_one_layer() -> None:
    """Forward+backward times (ms): upstream and batched."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    torch.set_num_threads(1)
    shimmed, upstream = SequentialMLP.forward, SequentialMLP.forward.__wrapped__
    variants = {"upstream": upstream, "batched": shimmed}
    for hidden, ffn, num_experts, rows, repeats in (
        (64, 48, 8, 800, 300),
        (1024, 512, 64, 4096, 5),
    ):
        experts = _build_experts(num_experts, hidden, ffn)
        counts = _counts(rows, num_experts, empty=(1,))
        step = functools.partial(_forward_backward, experts=experts, counts=counts)
        medians = _median_ms(variants, lambda forward, step=step: step(forward), repeats)
        print(f"experts h{hidden} F{ffn} E{num_experts} {rows} rows: {medians}")

    layer = _moe_layer()
    tokens = torch.randn(25, 16, layer.config.hidden_size)  # 16 sequences x 25 tokens

    def layer_step(forward) -> None:
        SequentialMLP.forward = forward
        try:
            layer.zero_grad(set_to_none=True)
            inputs = tokens.clone().requires_grad_()
            output, _ = layer(inputs)
            output.backward(torch.ones_like(output))
        finally:
            SequentialMLP.forward = shimmed

    print(f"MoE layer h64 E8 top-2, 400 tokens: {_median_ms(variants, layer_step, 300)}")


def main() -> None:
    warnings.filterwarnings("ignore")
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.engine.parallel import initialize_parallel

    initialize_parallel(ParallelConfig(), seed=1)
    if "--time" in sys.argv:
        time_one_layer()
        return
    print(json.dumps(run_checks({name: globals()[f"check_{name}"] for name in CHECKS})))


if __name__ == "__main__":
    main()
