"""Checks of the CPU shims, run in a fresh process (shims change torch/megatron globals).

1. ``need``: on the UNPATCHED upstream, whether the thing each shim (and each part of one) covers
   still fails or still has the CUDA-only code: ``"needed"`` or ``"not needed"``, compared by
   ``test_compat.py`` with what ``compat.declared_needs()`` declares for the installed version.
2. ``gpu``: with CUDA reported available, ``apply_cpu_shims`` patches nothing.
3. ``applied``: what ``apply_cpu_shims`` patched on CPU (only what the installed version needs).
4. ``works``: after ``apply_cpu_shims``, each covered call works on CPU, whether a shim or upstream
   itself makes it work (the layouts that need them run in test_layouts.py).

Prints one JSON object.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import re
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from worker_launch import run_checks  # noqa: E402

from megatron_gspo.engine import compat, cpu_shims  # noqa: E402

CUDA_LITERAL = re.compile(r"device=['\"]cuda['\"]")


def _raises(function) -> bool:
    try:
        function()
    except Exception:
        return True
    return False


def need_probes() -> dict:
    """shim name -> probe returning True when upstream still needs the shim."""
    from megatron.core import utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.language_module import language_module
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    finalize_model_grads = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")

    def allocates_on_cuda(module_name: str) -> bool:
        return bool(CUDA_LITERAL.search(inspect.getsource(importlib.import_module(module_name))))

    modules = {
        f"cuda_allocations[{name}]": functools.partial(allocates_on_cuda, name)
        for name in cpu_shims.CUDA_ALLOCATING_MODULES
    }
    return modules | {
        "current_device": lambda: (
            "torch.cuda.current_device()" in inspect.getsource(param_and_grad_buffer)
            and _raises(torch.cuda.current_device)
        ),
        "cuda_allocations": lambda: any(probe() for probe in modules.values()),
        "local_l2_norm": lambda: (
            clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm
            and bool(CUDA_LITERAL.search(inspect.getsource(utils.local_multi_tensor_l2_norm)))
        ),
        "cuda_rng": lambda: (
            _raises(tp_random._get_cuda_rng_state) and _raises(torch.cuda.get_rng_state)
        ),
        "synchronize_and_streams": lambda: (
            _raises(torch.cuda.Stream)
            and "torch.cuda.Stream()" in inspect.getsource(token_dispatcher)
        ),
        "tensor_type_names": lambda: (
            torch.zeros(1).type() == "torch.FloatTensor"
            and "torch.cuda.FloatTensor"
            in inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32)
            and "torch.cuda.FloatTensor"
            in inspect.getsource(
                distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups
            )
        ),
        "tied_embedding_cuda": lambda: (
            ".cuda()"
            in inspect.getsource(language_module.LanguageModule.setup_embeddings_and_output_layer)
        ),
        # bf16 parameters are told apart by their CUDA type name, which CPU tensors lack.
        "mixed_precision_type_names": lambda: (
            torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
            and all(
                "'torch.cuda.BFloat16Tensor'"
                in inspect.getsource(getattr(importlib.import_module(module), name).__init__)
                for module, name in cpu_shims.MIXED_PRECISION_OPTIMIZER_INITS
            )
        ),
        "te_general_gemm": lambda: (
            not hasattr(moe_utils, "te_general_gemm")
            and "te_general_gemm" in inspect.getsource(moe_utils.RouterGatingLinearFunction)
        ),
        "router_expert_bias_compile": lambda: hasattr(
            TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable"
        ),
        "split_sizes_to_numpy": lambda: isinstance(
            moe_utils.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True), torch.Tensor
        ),
        "uneven_all_gather": lambda: (
            "torch.distributed.all_gather(output_tensor_list"
            in inspect.getsource(mappings._gather_along_first_dim)
        ),
        "batched_experts": lambda: (
            "for expert, tokens, probs in zip(self.local_experts"
            in inspect.getsource(SequentialMLP.forward)
        ),
        # Per call: the packed table from a loop over sequences, then its cos and sin.
        "thd_rope_tables": lambda: (
            "torch.split(t, seqlens)" in inspect.getsource(rope_utils._apply_rotary_pos_emb_thd)
            and "torch.cos(freqs)" in inspect.getsource(rope_utils._apply_rotary_pos_emb_bshd)
        ),
        # The collective runs whatever the group's size.
        "lone_grad_sync": lambda: (
            "torch.distributed.all_reduce(\n"
            in inspect.getsource(param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync)
            and ".size() == 1"
            not in inspect.getsource(param_and_grad_buffer._ParamAndGradBucketGroup.start_grad_sync)
        ),
        # The all-reduce of the squared norm runs whatever the group's size.
        "lone_grad_norm": lambda: (
            "torch.distributed.all_reduce(\n            total_norm, op=torch.distributed.ReduceOp.SUM, "
            "group=grad_stats_parallel_group"
            in inspect.getsource(clip_grads.get_grad_norm_fp32)
            and ".size() == 1" not in inspect.getsource(clip_grads.get_grad_norm_fp32)
            and "get_grad_norm_fp32(" in inspect.getsource(optimizer_module.MegatronOptimizer)
        ),
        # The walk runs whatever the settings, and finalize_model_grads calls it every step.
        "idle_temporary_reset": lambda: (
            "for module in get_attr_wrapped_model(model_chunk, 'modules')()"
            in inspect.getsource(finalize_model_grads.reset_model_temporary_tensors)
            and "reset_model_temporary_tensors(config, model)"
            in inspect.getsource(finalize_model_grads.finalize_model_grads)
        ),
    }


def workaround_need_probes() -> dict:
    """workaround name -> probe returning True when upstream still needs it (on any device)."""
    from types import SimpleNamespace

    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe.router import TopKRouter

    def count_routed_tokens() -> bool:
        # Upstream's own count (the compiled wrapper's original: no torch.compile on CPU here)
        # with 3 tokens, 4 experts and a padding mask: [3, 4] & [3] does not broadcast.
        upstream = TopKRouter._apply_expert_bias
        upstream = getattr(upstream, "_torchdynamo_orig_callable", upstream)
        router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
        routing_map = torch.ones(3, 4, dtype=torch.bool)
        padding_mask = torch.tensor([False, False, True])
        return _raises(lambda: upstream(router, routing_map, padding_mask))

    def allow_mla_without_transformer_engine() -> bool:
        # MultiLatentAttention.__init__ runs ``HAVE_TE and isinstance(self.linear_proj,
        # TELinear)``: it raises where HAVE_TE is true and TELinear is not a type.
        te_linear = getattr(multi_latent_attention, "TELinear", None)
        return (
            bool(getattr(multi_latent_attention, "HAVE_TE", False))
            and te_linear is not None
            and _raises(lambda: isinstance(object(), te_linear))
        )

    return {
        "count_routed_tokens": count_routed_tokens,
        "allow_mla_without_transformer_engine": allow_mla_without_transformer_engine,
    }


def workaround_checks() -> dict:
    """workaround name -> check that, with the workaround where the installed version needs it,
    the covered call works (run after the necessity probes: the MLA one patches a global)."""
    from types import SimpleNamespace

    from megatron.core.transformer import multi_latent_attention

    def count_routed_tokens() -> bool:
        router = SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
        routing_map = torch.tensor([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
        padding_mask = torch.tensor([False, False, True])  # the last token is padding
        compat.count_routed_tokens(router, routing_map, padding_mask)
        assert torch.equal(router.local_tokens_per_expert, torch.tensor([1.0, 2.0, 1.0, 0.0]))
        with torch.no_grad():  # recomputation and evaluation do not count
            compat.count_routed_tokens(router, routing_map, padding_mask)
        return torch.equal(router.local_tokens_per_expert, torch.tensor([1.0, 2.0, 1.0, 0.0]))

    def allow_mla_without_transformer_engine() -> bool:
        compat.allow_mla_without_transformer_engine()
        te_linear = getattr(multi_latent_attention, "TELinear", None)
        if te_linear is None:  # upstream guards its isinstance with HAVE_TE
            return not multi_latent_attention.HAVE_TE
        return isinstance(te_linear, type) and not isinstance(torch.nn.Linear(2, 2), te_linear)

    return {
        "count_routed_tokens": count_routed_tokens,
        "allow_mla_without_transformer_engine": allow_mla_without_transformer_engine,
    }


def norm_probe() -> bool:
    """WrappedTorchNorm (local spec without apex) still rejects sequence parallel, which is why
    the local spec uses cpu_shims.SequenceParallelTorchNorm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        sequence_parallel=True,
        tensor_model_parallel_size=2,
        use_cpu_initialization=True,
    )
    return _raises(lambda: WrappedTorchNorm(config, 8))


def works_checks() -> dict:
    """After apply_cpu_shims (needs torch.distributed initialised, world size 1)."""
    import numpy as np
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads, distrib_optimizer
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.router import TopKRouter

    def rng() -> bool:
        seed_before = torch.initial_seed()
        state_before = torch.get_rng_state()
        tensor_parallel.model_parallel_cuda_manual_seed(123)
        with tensor_parallel.get_cuda_rng_tracker().fork():
            pass
        tp_random._set_cuda_rng_state(tp_random._get_cuda_rng_state())
        # The CPU generator is neither reseeded nor advanced.
        return torch.initial_seed() == seed_before and torch.equal(
            state_before, torch.get_rng_state()
        )

    def clip() -> bool:
        param = torch.nn.Parameter(torch.ones(4))
        param.grad = torch.full((4,), 3.0)
        norm = clip_grads.get_grad_norm_fp32([param.grad])
        clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=norm)
        return abs(norm - 6.0) < 1e-6 and torch.allclose(
            param.grad, torch.full((4,), 0.5), atol=1e-6
        )

    def lone_grad_norm() -> bool:
        """The shimmed norm equals upstream's (all-reduce over the one-rank world included) bit
        for bit, for a list, a single tensor and no tensor at all."""
        optimizer_module = importlib.import_module("megatron.core.optimizer.optimizer")
        shimmed = optimizer_module.get_grad_norm_fp32
        generator = torch.Generator().manual_seed(0)
        grads = [torch.randn(shape, generator=generator) for shape in ((7, 3), (5,), (2, 2, 2))]
        group = dist.group.WORLD
        cases = (grads, grads[0], [])
        return (
            getattr(shimmed, "_cpu_shim", False)
            and group.size() == 1
            and all(
                shimmed(case, grad_stats_parallel_group=group)
                == clip_grads.get_grad_norm_fp32(case, grad_stats_parallel_group=group)
                for case in cases
            )
        )

    def idle_temporary_reset() -> bool:
        """Upstream's reset still runs (and zeroes the expert-bias counters) with expert bias or a
        global aux loss; with neither, the model's modules are not walked at all."""
        from types import SimpleNamespace

        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")

        class Router(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.expert_bias = torch.zeros(2)
                self.local_tokens_per_expert = torch.ones(2)
                self.global_tracker_resets = 0

            def reset_global_aux_loss_tracker(self) -> None:
                self.global_tracker_resets += 1

        class Unwalkable(torch.nn.Module):
            def modules(self):
                raise AssertionError("walked although nothing can be reset")

        def settings(bias: bool, balancing) -> SimpleNamespace:
            return SimpleNamespace(
                moe_router_enable_expert_bias=bias, moe_router_load_balancing_type=balancing
            )

        reset = finalize.reset_model_temporary_tensors
        biased, global_loss = Router(), Router()
        reset(settings(True, "aux_loss"), [torch.nn.Sequential(biased)])
        reset(settings(False, ["aux_loss", "global_aux_loss"]), [torch.nn.Sequential(global_loss)])
        for balancing in ("aux_loss", "none", ["aux_loss", "seq_aux_loss"]):
            reset(settings(False, balancing), [Unwalkable()])
        return (
            getattr(reset, "_cpu_shim", False)
            and not biased.local_tokens_per_expert.any()
            and global_loss.global_tracker_resets == 1
        )

    def rope_tables() -> bool:
        """Bit-identical to upstream in value and gradient, with the tables built and reused,
        for both of upstream's frequency mappings (per sequence, and the whole packed row)."""
        shimmed = rope_utils._apply_rotary_pos_emb_thd
        upstream = shimmed.__wrapped__
        generator = torch.Generator().manual_seed(0)
        cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
        weights = torch.randn(20, 3, 8, generator=generator)
        for freqs in (torch.randn(16, 1, 1, 8), torch.randn(20, 1, 1, 8)):
            for _ in range(2):
                t = torch.randn(20, 3, 8, generator=generator, requires_grad=True)
                ours = shimmed(t, cu_seqlens, freqs, cp_group=dist.group.WORLD)
                (ours_grad,) = torch.autograd.grad((ours * weights).sum(), t)
                theirs = upstream(t, cu_seqlens, freqs, cp_group=dist.group.WORLD)
                (their_grad,) = torch.autograd.grad((theirs * weights).sum(), t)
                if not (torch.equal(ours, theirs) and torch.equal(ours_grad, their_grad)):
                    return False
        return getattr(shimmed, "_cpu_shim", False)

    def mixed_precision() -> bool:
        """Megatron's bf16 optimizer on CPU keeps an fp32 main copy of a bf16 parameter: an
        update below half a bf16 ulp (1 - 5e-4 rounds back to 1 in bf16) stays in the main
        parameter, and the model parameter is its bf16 rounding. (The distributed optimizer's
        part is exercised by the bf16 dp2 / tp2 x ep2 layouts with it in test_layouts.py.)"""
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

        param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
        config = OptimizerConfig(
            optimizer="sgd", lr=5e-4, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0
        )
        inner = torch.optim.SGD([param], lr=5e-4)
        optimizer = Float16OptimizerWithFloat16Params(inner, config, None, lambda *args: None)
        param.main_grad = torch.tensor([1.0, -1.0])
        optimizer.step()
        (main,) = inner.param_groups[0]["params"]
        return (
            getattr(distrib_optimizer.DistributedOptimizer.__init__, "_cpu_shim", False)
            and main is not param
            and main.dtype == torch.float32
            and torch.equal(main, torch.tensor([1.0 - 5e-4, -2.0 + 5e-4]))
            and torch.equal(param.detach(), main.to(torch.bfloat16))
            and torch.equal(param.detach(), torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
            # Scoped: outside the constructors a bf16 CPU tensor keeps its real type name.
            and torch.zeros(1, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"
        )

    return {
        "current_device": lambda: torch.cuda.current_device() == torch.device("cpu"),
        "cuda_allocations": lambda: all(
            importlib.import_module(name).torch.zeros([], device="cuda").device.type == "cpu"
            for name, needed in cpu_shims.CUDA_ALLOCATING_MODULES.items()
            if compat.needed_here(needed)
        ),
        "local_l2_norm": clip,
        "cuda_rng": rng,
        "synchronize_and_streams": lambda: (
            torch.cuda.synchronize() is None
            and torch.cuda.current_stream() == torch.cuda.Stream()
            and token_dispatcher.torch.cuda.Stream is cpu_shims._CpuStream
        ),
        "tensor_type_names": lambda: (
            getattr(clip_grads.clip_grad_by_total_norm_fp32, "_cpu_shim", False)
            and getattr(
                distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups,
                "_cpu_shim",
                False,
            )
            # Scoped: outside the shimmed functions CPU tensors keep their real type name.
            and torch.zeros(1).type() == "torch.FloatTensor"
        ),
        "tied_embedding_cuda": lambda: (
            getattr(LanguageModule.setup_embeddings_and_output_layer, "_cpu_shim", False)
            and _raises(lambda: torch.zeros(1).cuda())
        ),
        "mixed_precision_type_names": mixed_precision,
        "te_general_gemm": lambda: (
            moe_utils.router_gating_linear(
                torch.ones(3, 4), torch.ones(2, 4), None, torch.float32
            ).shape
            == (3, 2)
        ),
        "router_expert_bias_compile": lambda: (
            not hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
            and TopKRouter._apply_expert_bias.__name__ == "_apply_expert_bias"
        ),
        "split_sizes_to_numpy": lambda: isinstance(
            token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True),
            np.ndarray,
        ),
        "uneven_all_gather": lambda: getattr(
            tensor_parallel.mappings._gather_along_first_dim, "_cpu_shim", False
        ),
        "batched_experts": lambda: getattr(SequentialMLP.forward, "_cpu_shim", False),
        "thd_rope_tables": rope_tables,
        # Exactness at dp = 1 (and the collective at dp > 1): tests/engine/test_layouts.py.
        "lone_grad_sync": lambda: getattr(
            _ParamAndGradBucketGroup.start_grad_sync, "_cpu_shim", False
        ),
        "idle_temporary_reset": idle_temporary_reset,
        "lone_grad_norm": lone_grad_norm,
    }


def extension_checks() -> dict:
    """extension name -> check that the upstream class still has what our subclass relies on,
    with the signatures it overrides, and that the subclass behaves on the installed version."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    def router_replay() -> bool:
        (extension,) = [e for e in compat.registered_extensions() if e.name == "router_replay"]
        registry = RouterReplay.global_router_replay_instances
        before = list(registry)
        instance = RouterReplay()
        try:
            missing = [m for m in extension.relies_on if not hasattr(instance, m)]
            assert not missing, f"RouterReplay lacks {missing}"
            parameters = tuple(inspect.signature(RouterReplay.get_replay_topk).parameters)
            assert parameters == compat.ROUTER_REPLAY_TOPK_PARAMETERS, parameters
            adopted = compat.PolicyRouterReplay.adopt(instance, layer_number=3, moe_index=1)
            assert adopted is instance and instance in registry  # re-classed, not replaced
            scores = torch.tensor([[0.1, 0.5, 0.2, 0.9], [0.7, 0.1, 0.6, 0.3]])

            def native_topk(values, k, num_groups=None, group_topk=None):
                weights, indices = torch.topk(values, k, dim=-1)
                return weights, indices

            forced = torch.tensor([[0, 2], [1, 3]])
            adopted.set_target_indices(forced)
            adopted.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            adopted.record_native = True
            _, indices = adopted.get_replay_topk(scores, 2, default_compute_topk=native_topk)
            assert torch.equal(indices, forced) and adopted.forward_uses == 1
            assert torch.equal(adopted.native_topk_idx, torch.tensor([[3, 1], [0, 2]]))
            try:
                adopted.get_replay_topk(scores, 2, default_compute_topk=native_topk)
            except compat.RoutingReplayError as error:
                assert "decoder layer 2" in str(error) and "twice" in str(error)
            else:
                raise AssertionError("a second replaying call in one forward did not raise")
            adopted.reset()
            assert adopted.router_replay_action is None and adopted.target_topk_idx is None
            return True
        finally:
            registry[:] = before

    return {"router_replay": router_replay}


def run(checks: dict) -> dict:
    return run_checks(checks, traceback_limit=3, falsy_fails=True)


def probe(probes: dict) -> dict:
    """Each probe's answer, ``"needed"`` / ``"not needed"``, or the traceback it raised."""
    answers = {"ok": "needed", "returned False": "not needed"}
    return {name: answers.get(text, text) for name, text in run(probes).items()}


def applied() -> list[str]:
    """The shims, and the parts of the CUDA-allocation shim, that are in place."""
    modules = [
        f"cuda_allocations[{name}]"
        for name in cpu_shims.CUDA_ALLOCATING_MODULES
        if isinstance(importlib.import_module(name).torch, cpu_shims._CpuAllocatingTorch)
    ]
    return compat.applied_shims() + modules


def main() -> None:
    out: dict = {
        "version": ".".join(map(str, compat.MEGATRON_CORE_VERSION)),
        "checked_versions": list(compat.CHECKED_VERSIONS),
        "registered": [shim.name for shim in compat.registered_shims()],
        "declared": compat.declared_needs(),
        "extensions": [extension.name for extension in compat.registered_extensions()],
        "extensions_needed": {
            extension.name: compat.needed_here(extension.needed)
            for extension in compat.registered_extensions()
        },
    }
    out["extensions_fit"] = run(extension_checks())
    out["need"] = probe(
        need_probes() | workaround_need_probes() | {"sequence_parallel_norm": norm_probe}
    )
    out["workarounds"] = [workaround.name for workaround in compat.registered_workarounds()]
    out["workarounds_work"] = run(workaround_checks())

    real_is_available = torch.cuda.is_available
    real_current_device = torch.cuda.current_device
    torch.cuda.is_available = lambda: True
    try:
        applied_on_gpu = compat.apply_cpu_shims()
    finally:
        torch.cuda.is_available = real_is_available
    untouched = (
        torch.cuda.current_device is real_current_device
        and not compat.cpu_shims_active()
        and not applied()
    )
    out["gpu"] = {"nothing_patched": "ok" if not applied_on_gpu and untouched else "patched on GPU"}

    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.engine.parallel import destroy_parallel, initialize_parallel

    initialize_parallel(ParallelConfig(), seed=1)
    assert compat.apply_cpu_shims() and compat.apply_cpu_shims()  # idempotent
    out["applied"] = applied()
    out["works"] = run(works_checks())
    destroy_parallel()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
