"""The CPU shims: each is needed upstream exactly on the megatron-core versions it declares, none
is applied on GPU, each covered call works once they are applied.

The checks run in a fresh process (``compat_worker.py``) because the shims change torch and
megatron globals; they run on the installed megatron-core, and CI runs them on each of
``compat.CHECKED_VERSIONS`` (``.ci/run``: 0.16.1 on Python 3.11, 0.17.1 on Python 3.12). That the
layouts each shim enables really train is covered by ``test_layouts.py``: dp/tp/pp/ep/cp and the
distributed optimizer need shims 1-8; tp2+ep2+etp2 exercises the uneven all-gather (15 uneven
gathers per step); dense pp2 the tied embedding copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from worker_launch import run_json_worker


@pytest.fixture(scope="module")
def report() -> dict:
    return run_json_worker(Path(__file__).with_name("compat_worker.py"), timeout=300)


def test_every_shim_has_a_necessity_probe_and_a_check(report):
    registered = set(report["registered"])
    assert registered == set(report["works"])
    assert registered <= set(report["declared"])
    assert set(report["declared"]) == set(report["need"])


def test_every_workaround_has_a_necessity_probe_and_a_check(report):
    """The upstream workarounds applied on every device (``shim_registry.upstream_workaround``:
    GLM-4.5's and DeepSeek-V3's routed-token count, MLA without Transformer Engine) are declared
    and probed like the CPU shims (``test_shims_are_still_needed_upstream``), and each covered
    call works with the workaround where the installed version needs it."""
    workarounds = set(report["workarounds"])
    assert workarounds == {"count_routed_tokens", "allow_mla_without_transformer_engine"}
    assert workarounds <= set(report["declared"]) and workarounds <= set(report["need"])
    failures = {name: text for name, text in report["workarounds_work"].items() if text != "ok"}
    assert set(report["workarounds_work"]) == workarounds and not failures, failures


def test_class_extensions_fit_the_installed_version(report):
    """Every upstream class we extend (``compat.registered_extensions``, on CPU and GPU) still has
    the members and signatures our subclass relies on, and the subclass works on it."""
    assert set(report["extensions"]) == set(report["extensions_fit"]) == {"router_replay"}
    assert all(report["extensions_needed"].values())
    failures = {name: text for name, text in report["extensions_fit"].items() if text != "ok"}
    assert not failures, failures


def test_installed_megatron_core_is_a_checked_version(report):
    """CHECKED_VERSIONS lists every version CI runs: a CI pin moved without checking the shims on
    the new version fails here."""
    assert report["version"] in report["checked_versions"]


def test_shims_are_still_needed_upstream(report):
    """On the installed megatron-core, a shim (or part of one) declared needed is still needed
    upstream, and one declared not needed is unnecessary there and not applied. Fails when an
    upgrade fixed what a shim covers (then end its ``NeededOn`` at that version: ``fixed_in``)."""
    version = report["version"]
    wrong = {}
    for name, declared in report["declared"].items():
        expected = "needed" if declared else "not needed"
        if report["need"][name] != expected:
            wrong[name] = f"declared {expected} on {version}; upstream: {report['need'][name]}"
        elif not declared and name in report["applied"]:
            wrong[name] = f"declared not needed on {version}, but applied"
    assert not wrong, wrong


def test_needed_on_versions():
    from megatron_gspo.engine.shim_registry import NeededOn, parse_version

    assert parse_version("0.17.1") == (0, 17, 1) and parse_version("0.19.0rc1") == (0, 19, 0)
    until_017 = NeededOn(fixed_in="0.17.0")
    assert (0, 16, 1) in until_017 and (0, 17, 0) not in until_017 and (0, 17, 1) not in until_017
    assert (0, 16, 0) not in until_017  # older than the oldest supported version
    assert (0, 19, 2) in NeededOn() and (0, 18, 2) not in NeededOn(since="0.19.0")


def test_nothing_is_patched_when_cuda_is_available(report):
    assert report["gpu"] == {"nothing_patched": "ok"}


def test_shims_work_on_cpu(report):
    """Fails when an upstream change makes a shim ineffective."""
    failures = {name: text for name, text in report["works"].items() if text != "ok"}
    assert not failures, failures


def test_transformer_config_per_architecture():
    import torch

    from megatron_gspo.config import ModelConfig, ParallelConfig
    from megatron_gspo.engine.model import transformer_config

    qwen3 = transformer_config(ModelConfig(), ParallelConfig(tp=2, ep=2, cp=2))
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias
    assert qwen3.moe_router_pre_softmax is False  # softmax over the top-k: renormalised
    assert qwen3.sequence_parallel and qwen3.normalization == "RMSNorm"
    assert qwen3.gated_linear_unit and qwen3.moe_shared_expert_intermediate_size is None
    assert qwen3.moe_router_load_balancing_type == "none"
    assert not qwen3.perform_initialization and qwen3.use_cpu_initialization
    assert qwen3.context_parallel_size == 2 and qwen3.expert_model_parallel_size == 2

    qwen2 = transformer_config(
        ModelConfig(
            architecture="qwen2_moe",
            qk_layernorm=False,
            add_qkv_bias=True,
            moe_renormalize_topk=False,
            shared_expert_intermediate_size=32,
            first_k_dense_layers=1,
            moe_aux_loss_coef=0.01,
        ),
        ParallelConfig(),
    )
    assert qwen2.moe_router_pre_softmax is True  # top-k of the full softmax, no renormalising
    assert qwen2.moe_shared_expert_gate and qwen2.moe_shared_expert_intermediate_size == 32
    assert qwen2.add_qkv_bias and not qwen2.qk_layernorm and not qwen2.sequence_parallel
    assert qwen2.moe_layer_freq == [0, 1]
    assert qwen2.moe_router_load_balancing_type == "aux_loss" and qwen2.moe_aux_loss_coeff == 0.01

    mixtral = transformer_config(
        ModelConfig(architecture="mixtral", qk_layernorm=False), ParallelConfig(pp=2, vpp=1)
    )
    assert not mixtral.qk_layernorm and mixtral.moe_router_pre_softmax is False
    assert mixtral.variable_seq_lengths and mixtral.batch_p2p_comm

    dense = transformer_config(ModelConfig(architecture="qwen3"), ParallelConfig(pp=2, vpp=2))
    assert dense.num_moe_experts is None
    # Virtual pipeline at pp=2: gloo pairs batched p2p messages wrongly (megatron-cpu.md).
    assert not dense.batch_p2p_comm and dense.overlap_p2p_comm

    glm4 = transformer_config(
        ModelConfig(
            architecture="glm4_moe",
            shared_expert_intermediate_size=48,
            first_k_dense_layers=1,
            moe_router_num_groups=2,
            moe_router_group_topk=1,
            moe_router_topk_scaling_factor=2.5,
            rotary_percent=0.5,
            add_qkv_bias=True,
        ),
        ParallelConfig(),
    )
    assert glm4.moe_router_score_function == "sigmoid" and glm4.moe_router_pre_softmax is False
    assert glm4.moe_router_enable_expert_bias and glm4.moe_router_bias_update_rate == 0.0
    assert (glm4.moe_router_num_groups, glm4.moe_router_group_topk) == (2, 1)
    assert glm4.moe_router_topk_scaling_factor == 2.5
    assert glm4.moe_shared_expert_intermediate_size == 48 and not glm4.moe_shared_expert_gate
    assert glm4.moe_layer_freq == [0, 1] and glm4.add_qkv_bias
    ungrouped = transformer_config(
        ModelConfig(architecture="glm4_moe", shared_expert_intermediate_size=48), ParallelConfig()
    )
    assert ungrouped.moe_router_num_groups is None and ungrouped.moe_router_group_topk is None

    replay = transformer_config(ModelConfig(), ParallelConfig(), moe_enable_routing_replay=True)
    assert replay.moe_enable_routing_replay

    # bf16 runs on CPU too (Megatron's mixed precision; docs/megatron-cpu.md, "bf16 on CPU").
    bf16 = transformer_config(ModelConfig(dtype="bfloat16"), ParallelConfig())
    assert bf16.bf16 and bf16.params_dtype == bf16.pipeline_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="alltoall"):
        transformer_config(ModelConfig(), ParallelConfig(pp=2, moe_token_dispatcher="allgather"))
