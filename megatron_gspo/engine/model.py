"""The policy model: a Megatron-Core GPTModel for Qwen3-MoE, Mixtral, Qwen2-MoE, dense Qwen3,
GLM-4.5 (``glm4_moe``) and DeepSeek-V3 (``deepseek_v3``: GLM-4.5's router with multi-head latent
attention, Megatron's ``MLATransformerConfig``; docs/deepseek-v3.md).

:func:`transformer_config` maps our :class:`~megatron_gspo.config.ModelConfig` and
:class:`~megatron_gspo.config.ParallelConfig` to Megatron's ``TransformerConfig``;
:func:`build_policy_model` builds one :class:`PolicyModel` chunk per virtual pipeline stage;
:func:`wrap_with_ddp` wraps them in Megatron DDP for training.

:class:`PolicyModel`'s last pipeline stage returns the final hidden states ``[s, b, h]`` instead of
logits: log-probs come from the chunked vocab-parallel kernel (:mod:`megatron_gspo.engine.logprobs`)
with the output-layer weight (:attr:`PolicyModel.output_weight`), so ``[tokens, vocab]`` logits are
never materialised.

Layer spec: Transformer Engine's when TE imports and a GPU is present (its attention handles THD
and context parallel); otherwise the local spec with the CPU core attention
(:class:`~megatron_gspo.engine.attention.PackedCoreAttention`), sequence-parallel-capable torch
norms and ``SequentialMLP`` experts (``moe_grouped_gemm=False``).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from megatron_gspo.engine.attention import PackedCoreAttention
from megatron_gspo.engine.compat import (
    MEGATRON_CORE_VERSION,
    allow_mla_without_transformer_engine,
    cuda_available,
    gpt_postprocess_parameters,
    has_router_replay,
    has_transformer_engine,
    install_routed_token_counting,
)
from megatron_gspo.engine.cpu_shims import SequenceParallelTorchNorm
from megatron_gspo.engine.parallel import ParallelState
from megatron_gspo.engine.sharding import annotate_tensor_parallel_attributes

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def use_transformer_engine() -> bool:
    """TE layer spec only with a GPU (TE's kernels are CUDA-only)."""
    return cuda_available() and has_transformer_engine()


def native_bf16_cpu() -> bool:
    """The CPU has bf16 matrix instructions (AVX-512 BF16 or AMX), which make bf16 GEMMs ~2x
    faster than fp32; without them (AVX2 only) bf16 is emulated and slower than fp32."""
    # torch's private CPU-feature probes (present since torch 2.1); absent means unknown: no.
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocab rounded up to a multiple of ``tp`` (the vocab-parallel embedding and output layer
    split it evenly); the extra rows are never looked up and are left out of every softmax."""
    return -(-vocab_size // tp) * tp


def token_dispatcher(parallel: ParallelConfig, *, on_gpu: bool) -> str:
    """Megatron's MoE token dispatcher for ``parallel.moe_token_dispatcher``: ``auto`` is
    allgather on CPU when nothing is split (tp = ep = etp = pp = cp = 1), where it routes the
    tokens exactly as alltoall does with fewer operations (``tests/engine/test_engine.py``
    checks the two bit for bit), and alltoall otherwise."""
    choice = parallel.moe_token_dispatcher
    if choice != "auto":
        return choice
    alone = parallel.tp == parallel.ep == parallel.etp == parallel.pp == parallel.cp == 1
    return "allgather" if alone and not on_gpu else "alltoall"


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    moe_enable_routing_replay: bool = False,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` of the policy for this layout.

    Architecture: RMSNorm, SwiGLU, RoPE (``rope_theta``), grouped-query attention, no linear
    biases except Qwen2-MoE's q/k/v bias, QK-norm (Qwen3), top-k softmax router; renormalised
    top-k (Qwen3-MoE, Mixtral) is Megatron's ``moe_router_pre_softmax=False`` (softmax over the
    top-k logits), no renormalisation (Qwen2-MoE) is ``True`` (top-k of the full softmax).
    GLM-4.5 (``docs/glm4-moe.md``): sigmoid scores, selection by scores + ``expert_bias`` (the
    HF ``e_score_correction_bias``; updated after each optimizer step only when
    ``model.moe_router_bias_update_rate > 0``), group-limited top-k, renormalised top-k weights
    times ``routed_scaling_factor``, an un-gated shared expert, q/k/v bias and partial RoPE
    (``rotary_percent``, set on the model). Router logits in the model dtype, as for the other
    architectures (HF's GLM router computes them in fp32; docs/glm4-moe.md, section 5).
    Sequence parallel whenever tp > 1. CPU runs use the settings of
    ``docs/megatron-cpu.md`` (no fusions, CPU initialisation); ``model.dtype=bfloat16`` is
    Megatron's mixed precision on CPU as on a GPU (bf16 parameters and compute, fp32 main
    parameters and gradient reduction: ``docs/megatron-cpu.md``, "bf16 on CPU").
    """
    on_gpu = cuda_available()
    dtype = _DTYPES[model.dtype]
    if not on_gpu and dtype == torch.bfloat16 and not native_bf16_cpu():
        # Runs, as on a GPU (docs/megatron-cpu.md, "bf16 on CPU"), but slower than fp32 here.
        logger.warning(
            "model.dtype=bfloat16 on a CPU without native bf16 (avx512_bf16 or AMX): bf16 "
            "matrix products are emulated and slower than float32 here"
        )
    vpp = parallel.vpp if parallel.vpp and parallel.vpp > 1 else None
    if model.is_moe and parallel.pp > 1 and parallel.moe_token_dispatcher == "allgather":
        raise ValueError(
            "parallel.moe_token_dispatcher=allgather with pp > 1: Megatron's allgather dispatcher "
            "does not support the variable sequence lengths of packed micro-batches under "
            "pipeline parallel; use parallel.moe_token_dispatcher=alltoall"
        )
    moe: dict[str, Any] = {}
    if model.is_moe:
        moe = dict(
            num_moe_experts=model.num_experts,
            moe_ffn_hidden_size=model.moe_ffn_hidden_size,
            moe_router_topk=model.moe_router_topk,
            moe_router_pre_softmax=not model.moe_renormalize_topk,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coef > 0 else "none",
            moe_aux_loss_coeff=model.moe_aux_loss_coef,
            moe_grouped_gemm=use_transformer_engine(),
            moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size or None,
            moe_shared_expert_gate=model.shared_expert_intermediate_size > 0
            and model.architecture == "qwen2_moe",
            moe_shared_expert_overlap=False,
            moe_layer_freq=[0] * model.first_k_dense_layers
            + [1] * (model.num_layers - model.first_k_dense_layers),
            moe_permute_fusion=False,
            moe_router_fusion=False,
        )
        if model.architecture in ("glm4_moe", "deepseek_v3"):
            grouped = model.moe_router_num_groups > 1
            moe.update(
                moe_router_score_function="sigmoid",
                moe_router_pre_softmax=False,
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=model.moe_router_bias_update_rate,
                moe_router_num_groups=model.moe_router_num_groups if grouped else None,
                moe_router_group_topk=model.moe_router_group_topk if grouped else None,
                moe_router_topk_scaling_factor=model.moe_router_topk_scaling_factor,
            )
        if moe_enable_routing_replay:
            if not has_router_replay():
                raise RuntimeError(
                    "routing replay needs megatron-core >= 0.16 (RouterReplay); installed "
                    f"{'.'.join(map(str, MEGATRON_CORE_VERSION))}"
                )
            moe["moe_enable_routing_replay"] = True
    recompute: dict[str, Any] = {}
    if model.recompute_activations:
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    config_class: type = TransformerConfig
    mla: dict[str, Any] = {}
    if model.architecture == "deepseek_v3":
        config_class = MLATransformerConfig
        mla = _mla_settings(model, parallel)
    return config_class(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.head_dim,
        ffn_hidden_size=model.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=mla.pop("qk_layernorm", model.qk_layernorm),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        # Weights come from initialize_weights_from_seed (or a checkpoint), never from Megatron's
        # own initialisation, which depends on the layout.
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        sequence_parallel=parallel.tp > 1,
        # Packed micro-batches differ in length, so pipeline stages exchange shapes first.
        variable_seq_lengths=parallel.pp > 1,
        # Megatron validates the dispatcher even without experts; allgather rejects
        # variable_seq_lengths.
        moe_token_dispatcher_type=(
            token_dispatcher(parallel, on_gpu=on_gpu) if model.is_moe else "alltoall"
        ),
        # At pp=2 with virtual stages the previous and next rank are one process; batched p2p
        # then pairs same-shaped messages in the wrong order on gloo (megatron-cpu.md).
        batch_p2p_comm=vpp is None,
        overlap_p2p_comm=vpp is not None,
        calculate_per_token_loss=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        **moe,
        **recompute,
        **mla,
    )


def _mla_settings(model: ModelConfig, parallel: ParallelConfig) -> dict[str, Any]:
    """The ``MLATransformerConfig`` fields of DeepSeek-V3's multi-head latent attention
    (``docs/deepseek-v3.md``): latent ranks, head widths, plain RoPE or YaRN with its softmax
    mscale."""
    if parallel.cp > 1:
        raise ConfigError(
            "parallel.cp",
            f"{parallel.cp} with deepseek_v3",
            "megatron-core 0.16.1's MLA builds its YaRN rotary table at construction for the "
            "context-parallel rank (YarnRotaryEmbedding._set_cos_sin_cache -> "
            "rope_utils.get_pos_emb_on_this_cp_rank), which allocates pinned memory and fails "
            "without CUDA ('pin_memory=True requires a CUDA or other accelerator backend'); "
            "past it, the CPU core attention's context-parallel path is untested with MLA",
            "set parallel.cp=1 (use tp, ep or pp to split the model)",
        )
    if parallel.tp > 1 and not use_transformer_engine():
        raise ConfigError(
            "parallel.tp",
            f"{parallel.tp} with deepseek_v3 on the local (CPU) layer spec",
            "megatron-core 0.16.1's local MLA spec builds linear_kv_down_proj as a "
            "ColumnParallelLinear, so MLASelfAttention gathers its output over tensor-parallel "
            "ranks and every rank uses the shared rotary key k_pos_emb with its own heads only; "
            "the gather's backward keeps each rank's own slice, so the rotary key's gradient "
            "misses the other ranks' heads (measured: tp2 gradients 0.8% off one process, "
            "worst on the input layernorm; the forward is exact). TE's spec (a GPU) uses a "
            "duplicated TELinear there and reduces that gradient",
            "set parallel.tp=1 (dp, ep and pp are exact with MLA), or run on a GPU with "
            "Transformer Engine",
        )
    yarn = model.rope_scaling_factor != 1.0
    settings: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=model.q_lora_rank,
        kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim,
        qk_pos_emb_head_dim=model.qk_rope_head_dim,
        v_head_dim=model.v_head_dim,
        rope_type="yarn" if yarn else "rope",
        rotary_base=model.rope_theta,
        rotary_percent=1.0,
        # Without YaRN the softmax mscale must be 1: m(1, 0) = 1 (Megatron's default factor 40
        # with mscale_all_dim 0 also gives 1, but say what is meant).
        rotary_scaling_factor=model.rope_scaling_factor,
        mscale=model.yarn_mscale,
        mscale_all_dim=model.yarn_mscale_all_dim if yarn else 0.0,
        # The latent norms (HF q_a_layernorm, kv_a_layernorm): Megatron builds them only with
        # qk_layernorm (q_layernorm / kv_layernorm in the local spec, fused into the up
        # projections in TE's).
        qk_layernorm=True,
    )
    if yarn:
        settings.update(
            original_max_position_embeddings=model.rope_scaling_original_max_position_embeddings,
            beta_fast=model.yarn_beta_fast,
            beta_slow=model.yarn_beta_slow,
        )
    return settings


# ---------------------------------------------------------------------------------------------
# Layer spec
# ---------------------------------------------------------------------------------------------


def _local_layer_spec(spec: ModuleSpec, cache: dict[int, ModuleSpec]) -> ModuleSpec:
    """A copy of a local-spec layer with the CPU core attention and sequence-parallel norms."""
    if id(spec) in cache:
        return cache[id(spec)]
    spec = copy.deepcopy(spec)
    layer = spec.submodules
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(layer, name) is not IdentityOp:
            setattr(layer, name, SequenceParallelTorchNorm)
    attention = layer.self_attention.submodules
    attention.core_attention = PackedCoreAttention
    if layer.self_attention.module is MLASelfAttention:
        # The latent norms of multi-head latent attention (built with qk_layernorm).
        attention.q_layernorm = attention.kv_layernorm = SequenceParallelTorchNorm
        cache[id(spec)] = spec
        return spec
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, SequenceParallelTorchNorm)
    cache[id(spec)] = spec
    return spec


def decoder_block_spec(
    config: TransformerConfig, vp_stage: Optional[int] = None
) -> TransformerBlockSubmodules:
    """Layer specs of this pipeline stage (TE with a GPU, local + CPU attention otherwise)."""
    if use_transformer_engine():
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=vp_stage
    )
    cache: dict[int, ModuleSpec] = {}
    return TransformerBlockSubmodules(
        layer_specs=[_local_layer_spec(spec, cache) for spec in block.layer_specs],
        layer_norm=SequenceParallelTorchNorm,
    )


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

if "hidden_states" not in gpt_postprocess_parameters():
    raise ImportError(
        "GPTModel._postprocess of this megatron-core has no 'hidden_states' parameter; "
        "PolicyModel._postprocess must be adapted (megatron_gspo/engine/model.py)"
    )


class PolicyModel(GPTModel):
    """GPTModel whose last stage returns the final hidden states ``[s, b, h]`` (after the final
    norm; sequence-parallel scattered when tp > 1) instead of logits."""

    def __init__(self, *args: Any, unpadded_vocab_size: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.unpadded_vocab_size = unpadded_vocab_size

    def forward(self, *args: Any, padding_mask: Optional[torch.Tensor] = None, **kwargs: Any):
        # GPTModel scatters the MoE padding mask for sequence parallel only on the first stage;
        # later stages receive sequence-parallel hidden states too.
        if padding_mask is not None and not self.pre_process and self.config.sequence_parallel:
            padding_mask = (
                tensor_parallel.scatter_to_sequence_parallel_region(
                    padding_mask.transpose(0, 1).contiguous()
                )
                .transpose(0, 1)
                .contiguous()
            )
        return super().forward(*args, padding_mask=padding_mask, **kwargs)

    def _postprocess(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.config.mtp_num_layers:
            raise NotImplementedError("multi-token prediction is not supported by PolicyModel")
        return hidden_states

    @property
    def output_weight(self) -> torch.Tensor:
        """``[V_padded / tp, h]`` this rank's output-layer rows (the word embedding if tied).
        Only on the last pipeline stage."""
        if not self.post_process:
            raise RuntimeError("the output weight lives on the last pipeline stage")
        if self.share_embeddings_and_output_weights:
            return self.shared_embedding_or_output_weight()
        return self.output_layer.weight


def build_policy_model(
    cfg: TrainConfig,
    parallel_state: ParallelState,
    *,
    routing_replay: Optional[bool] = None,
) -> list[PolicyModel]:
    """One :class:`PolicyModel` chunk per virtual pipeline stage of this rank, on its device,
    with uninitialised weights (call :func:`~megatron_gspo.engine.sharding.
    initialize_weights_from_seed` or load a checkpoint).

    ``routing_replay`` (default: True for a MoE policy) turns on Megatron's
    ``moe_enable_routing_replay``: each router gets a ``RouterReplay``, which computes the native
    top-k unless :mod:`~megatron_gspo.engine.routing_replay` sets an action, so it also serves the
    routing metrics when ``algo.routing_replay`` is none. A reference model must be built with
    False (its routers then cannot replay). Building with True first empties Megatron's
    process-global ``RouterReplay`` registry, which otherwise keeps every earlier model's
    instances (and their index tensors) alive; megatron_gspo never drives replay through it.
    """
    if routing_replay is None:
        # Without RouterReplay (megatron-core < 0.16) only an explicit replay request fails.
        routing_replay = cfg.algo.routing_replay != "none" or has_router_replay()
    routing_replay = routing_replay and cfg.model.is_moe
    if routing_replay:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()
    config = transformer_config(cfg.model, cfg.parallel, moe_enable_routing_replay=routing_replay)
    if config.multi_latent_attention:
        allow_mla_without_transformer_engine()
    vocab = padded_vocab_size(cfg.model.vocab_size, parallel_state.tp)
    max_length = max(
        cfg.model.max_position_embeddings, cfg.algo.prompt_length + cfg.algo.response_length
    )
    chunks = []
    for vp_stage in range(parallel_state.vpp):
        stage = vp_stage if parallel_state.vpp > 1 else None
        chunk = PolicyModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(config, vp_stage=stage),
            vocab_size=vocab,
            max_sequence_length=max_length,
            pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=cfg.model.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=cfg.model.rotary_percent,
            rotary_base=int(cfg.model.rope_theta),
            vp_stage=stage,
            unpadded_vocab_size=cfg.model.vocab_size,
        )
        chunk.to(parallel_state.device)
        chunks.append(chunk)
    if cfg.model.architecture in ("glm4_moe", "deepseek_v3"):
        install_routed_token_counting(chunks)
    annotate_tensor_parallel_attributes(chunks)
    return chunks


def wrap_with_ddp(
    chunks: list[PolicyModel], *, use_distributed_optimizer: bool
) -> list[DistributedDataParallel]:
    """Megatron DDP around each chunk: fp32 gradient buffers reduced over data (x context)
    parallel ranks at the end of the step (no overlap: the step must be reproducible)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
        average_in_collective=False,
    )
    return [
        DistributedDataParallel(
            config=chunk.config,
            ddp_config=ddp_config,
            module=chunk,
            # Bucketing only pays off with overlapped reduction of the first chunk.
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(chunks)
    ]


def unwrap(chunk: torch.nn.Module) -> PolicyModel:
    """The :class:`PolicyModel` inside DDP (or the chunk itself)."""
    while not isinstance(chunk, PolicyModel):
        if not hasattr(chunk, "module"):
            raise TypeError(f"{type(chunk).__name__} does not wrap a PolicyModel")
        chunk = chunk.module
    return chunk
