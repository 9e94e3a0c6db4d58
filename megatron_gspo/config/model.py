"""The configuration of the model and its parallel layout (``model.*``, ``parallel.*``); part of
the one configuration tree, :mod:`megatron_gspo.config`, whose rules hold here: every default
lives here once, with its source."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config.schema import ConfigError, check_choice, check_positive

# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3", "glm4_moe", "deepseek_v3")

SIGMOID_ROUTER_ARCHITECTURES = ("glm4_moe", "deepseek_v3")
"""The architectures with GLM-4.5 / DeepSeek-V3's router: sigmoid scores, score-correction bias,
group-limited top-k, routed scaling factor, un-gated shared experts."""

GLM4_ONLY_FIELDS = {
    "moe_router_num_groups": 1,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 1.0,
    "moe_router_bias_update_rate": 0.0,
    "rotary_percent": 1.0,
}
"""The :class:`ModelConfig` fields only the sigmoid-router architectures (glm4_moe, deepseek_v3)
express, with the value every other architecture has (``convert.hf_config`` rejects any other
value there; deepseek_v3 has no partial RoPE, so ``rotary_percent`` stays 1 there)."""

MLA_FIELDS = {
    "q_lora_rank": None,
    "kv_lora_rank": 0,
    "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
    "rope_scaling_factor": 1.0,
    "rope_scaling_original_max_position_embeddings": 0,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
}
"""The multi-head latent attention and YaRN fields only deepseek_v3 expresses, with the value
every other architecture has (``convert.hf_config`` rejects any other value there)."""


@dataclass
class ModelConfig:
    """Architecture of the policy. The defaults are the tiny CPU demo MoE (Qwen3-MoE shaped)."""

    architecture: str = "qwen3_moe"
    """One of qwen3_moe, mixtral, qwen2_moe (MoE with a gated shared expert), qwen3 (dense) or
    glm4_moe (GLM-4.5 / GLM-4.5-Air: sigmoid router with a score-correction bias, un-gated shared
    experts, partial RoPE; docs/glm4-moe.md) or deepseek_v3 (DeepSeek-V3 / R1 / Kimi-K2: the
    GLM-4.5 router with multi-head latent attention and YaRN; docs/deepseek-v3.md)."""
    hf_path: Optional[str] = None
    """Start from this Hugging Face directory: architecture and sizes are read from its
    config.json (fields set here must agree) and each rank loads its own shards."""
    vocab_size: int = 16
    """Rows of the embedding and output layer; at least the tokenizer's size (the synthetic tasks
    need 15)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_query_groups: int = 2
    """Key/value heads (GQA). Must divide num_attention_heads."""
    head_dim: int = 16
    """Width of one attention head (Qwen3 sets it independently of hidden_size / heads)."""
    ffn_hidden_size: int = 128
    """Intermediate size of dense MLP layers (dense architectures and first_k_dense_layers)."""
    num_experts: int = 8
    """Routed experts per MoE layer."""
    moe_ffn_hidden_size: int = 48
    """Intermediate size of one routed expert."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_renormalize_topk: bool = True
    """Renormalise the top-k router probabilities (Qwen3-MoE norm_topk_prob=True, Mixtral always;
    Qwen2-MoE uses False; GLM-4.5 True, and Megatron's sigmoid router always renormalises)."""
    moe_router_num_groups: int = 1
    """Expert groups of group-limited routing (GLM-4.5 / DeepSeek-V3 ``n_group``; Megatron
    ``moe_router_num_groups``): each token first picks ``moe_router_group_topk`` groups, ranked
    by the sum of their top-2 biased scores, then its top-k experts inside them. 1: no groups."""
    moe_router_group_topk: int = 1
    """Groups each token may route into (``topk_group``; Megatron ``moe_router_group_topk``)."""
    moe_router_topk_scaling_factor: float = 1.0
    """Factor on the (renormalised) top-k weights (GLM-4.5 ``routed_scaling_factor``: 1.0 in
    GLM-4.5-Air, 2.5 in GLM-4.5; Megatron ``moe_router_topk_scaling_factor``). glm4_moe only."""
    moe_router_bias_update_rate: float = 0.0
    """glm4_moe only: step of Megatron's aux-loss-free load balancing (DeepSeek-V3 section 2.1.2,
    arXiv 2412.19437; Megatron ``moe_router_bias_update_rate``), which after every optimizer step
    moves each expert's score-correction bias (HF ``e_score_correction_bias``, a buffer, not a
    trained weight) by +rate if the expert got fewer tokens than the mean, -rate if more. 0 (the
    default, as slime's GLM-4.5 RL scripts) keeps the pretrained bias frozen: RL batches are small
    and on-policy, and a drifting bias changes the routing of the rollout engine between weight
    syncs for reasons unrelated to the reward (docs/glm4-moe.md, "The correction bias")."""
    shared_expert_intermediate_size: int = 0
    """Size of the shared expert: gated in Qwen2-MoE, un-gated in glm4_moe
    (``moe_intermediate_size * n_shared_experts``); 0 means none."""
    first_k_dense_layers: int = 0
    """The first k decoder layers use a dense MLP instead of experts."""
    qk_layernorm: bool = True
    """Per-head RMSNorm on queries and keys (Qwen3); False for Mixtral and Qwen2-MoE; GLM-4.5's
    ``use_qk_norm`` (true in GLM-4.5, false in GLM-4.5-Air)."""
    add_qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2-MoE; GLM-4.5's ``attention_bias``, q/k/v only)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding (Qwen3: 1e6)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates, the first ones; the rest pass through
    (GLM-4.5 ``partial_rotary_factor`` 0.5; Megatron ``rotary_percent``). glm4_moe only."""
    q_lora_rank: Optional[int] = None
    """deepseek_v3 only: rank of the low-rank query projection of multi-head latent attention
    (DeepSeek-V2, arXiv 2405.04434, section 2.1.2; HF ``q_lora_rank``: 1536 in DeepSeek-V3 and
    R1; Megatron ``MLATransformerConfig.q_lora_rank``): ``q = W_up RMSNorm(W_down x)``. None:
    one full-rank ``q_proj`` (DeepSeek-V2-Lite)."""
    kv_lora_rank: int = 0
    """deepseek_v3 only: width of the compressed key/value latent that MLA caches (HF
    ``kv_lora_rank``: 512 in DeepSeek-V3; Megatron ``kv_lora_rank``), normalised by its own RMSNorm
    (HF ``kv_a_layernorm``) before the per-head up projection. 0 on other architectures."""
    qk_nope_head_dim: int = 0
    """deepseek_v3 only: query/key channels per head without position encoding (HF
    ``qk_nope_head_dim``: 128; Megatron ``qk_head_dim``)."""
    qk_rope_head_dim: int = 0
    """deepseek_v3 only: query/key channels per head that RoPE rotates, the key part shared by
    all heads (HF ``qk_rope_head_dim``: 64; Megatron ``qk_pos_emb_head_dim``), stored in
    DeepSeek's interleaved pair order, which both HF (``rope_interleave``) and Megatron's MLA
    RoPE read (docs/deepseek-v3.md)."""
    v_head_dim: int = 0
    """deepseek_v3 only: value channels per head (HF ``v_head_dim``: 128; Megatron
    ``v_head_dim``)."""
    rope_scaling_factor: float = 1.0
    """deepseek_v3 only: YaRN context-extension factor (arXiv 2309.00071; HF ``rope_scaling``
    type yarn ``factor``: 40 in DeepSeek-V3; Megatron ``rotary_scaling_factor``). 1: plain RoPE."""
    rope_scaling_original_max_position_embeddings: int = 0
    """deepseek_v3 with YaRN: the pre-training context (HF ``original_max_position_embeddings``:
    4096 in DeepSeek-V3; Megatron ``original_max_position_embeddings``)."""
    yarn_beta_fast: float = 32.0
    """deepseek_v3 with YaRN: the fast boundary of the frequency ramp (HF ``beta_fast``: 32)."""
    yarn_beta_slow: float = 1.0
    """deepseek_v3 with YaRN: the slow boundary of the frequency ramp (HF ``beta_slow``: 1)."""
    yarn_mscale: float = 1.0
    """deepseek_v3 with YaRN: HF ``rope_scaling.mscale`` (1.0 in DeepSeek-V3); with
    ``yarn_mscale_all_dim`` it sets the cos/sin factor ``m(mscale) / m(mscale_all_dim)``, where
    ``m(x) = 0.1 x ln(factor) + 1``."""
    yarn_mscale_all_dim: float = 0.0
    """deepseek_v3 with YaRN: HF ``rope_scaling.mscale_all_dim`` (1.0 in DeepSeek-V3): the
    softmax scale is ``m(mscale_all_dim)^2 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``
    (Megatron ``mscale_all_dim``). 0: no softmax correction."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + response) the rotary tables cover."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (small dense Qwen3 models)."""
    moe_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient; scaled consistently with the policy loss. 0 disables."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32 (the CPU default, tests) or bfloat16 (GPU, and CPUs
    with native bf16: Megatron's mixed precision, fp32 main parameters and gradient reduction,
    fp32 log-probs; docs/megatron-cpu.md, "bf16 on CPU")."""
    init_std: float = 0.02
    """Standard deviation of the seed initialisation (a model without hf_path or checkpoint)."""
    recompute_activations: bool = False
    """Full activation recomputation of every decoder layer (GPU memory saver)."""

    def __post_init__(self) -> None:
        check_choice(
            "model.architecture",
            self.architecture,
            ARCHITECTURES,
            "the converter and the model builder have a mapping only for these",
        )
        check_choice(
            "model.dtype", self.dtype, ("float32", "bfloat16"), "the trainer runs fp32 or bf16"
        )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_attention_heads",
            "num_query_groups",
            "head_dim",
            "ffn_hidden_size",
        ):
            check_positive(f"model.{name}", getattr(self, name))
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(
                "model.num_query_groups",
                f"{self.num_query_groups} does not divide num_attention_heads="
                f"{self.num_attention_heads}",
                "grouped-query attention shares each key/value head among a whole number of "
                "query heads",
                "choose num_query_groups among the divisors of num_attention_heads",
            )
        if self.is_moe:
            check_positive("model.num_experts", self.num_experts)
            check_positive("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size)
            if not 1 <= self.moe_router_topk <= self.num_experts:
                raise ConfigError(
                    "model.moe_router_topk",
                    f"{self.moe_router_topk} is outside [1, num_experts={self.num_experts}]",
                    "each token is routed to top-k distinct experts",
                    "set 1 <= moe_router_topk <= num_experts",
                )
        if not 0 <= self.first_k_dense_layers <= self.num_layers:
            raise ConfigError(
                "model.first_k_dense_layers",
                f"{self.first_k_dense_layers} is outside [0, num_layers={self.num_layers}]",
                "it counts decoder layers",
                "set it between 0 and num_layers",
            )
        if self.architecture == "qwen2_moe" and self.shared_expert_intermediate_size <= 0:
            raise ConfigError(
                "model.shared_expert_intermediate_size",
                "qwen2_moe needs a shared expert",
                "Qwen2-MoE layers always have a gated shared expert",
                "set shared_expert_intermediate_size > 0 or use architecture=qwen3_moe",
            )
        check_positive("model.moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)
        self._check_glm4_fields()
        self._check_mla_fields()

    def _check_mla_fields(self) -> None:
        """The ranges of the multi-head latent attention and YaRN fields of deepseek_v3 (their
        neutral values elsewhere are checked in ``convert.hf_config``, as for glm4_moe)."""
        if self.architecture != "deepseek_v3":
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.q_lora_rank is not None:
            check_positive("model.q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(
                "model.qk_rope_head_dim",
                f"{self.qk_rope_head_dim} is odd",
                "RoPE rotates pairs of channels",
                "set an even qk_rope_head_dim (DeepSeek-V3: 64)",
            )
        if self.num_query_groups != self.num_attention_heads:
            raise ConfigError(
                "model.num_query_groups",
                f"{self.num_query_groups} != num_attention_heads={self.num_attention_heads}",
                "multi-head latent attention up-projects one key and value per query head from "
                "the shared latent (HF num_key_value_heads = num_attention_heads)",
                "set num_query_groups = num_attention_heads",
            )
        if self.rope_scaling_factor < 1:
            raise ConfigError(
                "model.rope_scaling_factor",
                f"{self.rope_scaling_factor} < 1",
                "YaRN stretches the pre-training context by this factor; 1 is plain RoPE",
                "set rope_scaling_factor >= 1",
            )
        if self.rope_scaling_factor > 1:
            check_positive(
                "model.rope_scaling_original_max_position_embeddings",
                self.rope_scaling_original_max_position_embeddings,
            )

    def _check_glm4_fields(self) -> None:
        """The ranges of the router and RoPE fields of glm4_moe and deepseek_v3. (On another
        architecture they must keep their neutral values; that is checked where the HF class is
        chosen, ``convert.hf_config``, because a config with ``hf_path`` learns its architecture
        there.)"""
        if self.architecture not in SIGMOID_ROUTER_ARCHITECTURES:
            return
        check_positive("model.moe_router_num_groups", self.moe_router_num_groups)
        check_positive("model.moe_router_group_topk", self.moe_router_group_topk)
        check_positive("model.moe_router_topk_scaling_factor", self.moe_router_topk_scaling_factor)
        check_positive(
            "model.moe_router_bias_update_rate", self.moe_router_bias_update_rate, allow_zero=True
        )
        groups, chosen = self.moe_router_num_groups, self.moe_router_group_topk
        if self.num_experts % groups:
            raise ConfigError(
                "model.moe_router_num_groups",
                f"{groups} does not divide num_experts={self.num_experts}",
                "group-limited routing splits the experts into equal groups",
                "choose moe_router_num_groups among the divisors of num_experts",
            )
        if chosen > groups:
            raise ConfigError(
                "model.moe_router_group_topk",
                f"{chosen} > moe_router_num_groups={groups}",
                "a token picks that many groups out of moe_router_num_groups",
                "set moe_router_group_topk <= moe_router_num_groups",
            )
        if self.moe_router_topk > chosen * (self.num_experts // groups):
            raise ConfigError(
                "model.moe_router_topk",
                f"top-{self.moe_router_topk} from {chosen} groups of "
                f"{self.num_experts // groups} experts",
                "the chosen groups must hold at least top-k experts",
                "raise moe_router_group_topk or lower moe_router_topk",
            )
        if groups > 1 and self.moe_router_topk // chosen != 2:
            raise ConfigError(
                "model.moe_router_group_topk",
                f"top-{self.moe_router_topk} over {chosen} groups ranks each group by the sum of "
                f"its top-{self.moe_router_topk // chosen} scores",
                "Megatron ranks groups by their top-(topk / group_topk) scores, GLM-4.5's HF "
                "router by their top-2: they agree only when topk / group_topk = 2",
                "set moe_router_group_topk = moe_router_topk / 2, or moe_router_num_groups=1",
            )
        if not self.moe_renormalize_topk or self.moe_router_topk < 2:
            raise ConfigError(
                "model.moe_renormalize_topk",
                f"norm_topk_prob={self.moe_renormalize_topk} with top-{self.moe_router_topk}",
                "Megatron's sigmoid router renormalises the top-k weights exactly when k > 1, "
                "the HF GLM-4.5 router when norm_topk_prob is true",
                "set moe_renormalize_topk=true and moe_router_topk >= 2",
            )
        if not 0 < self.rotary_percent <= 1:
            raise ConfigError(
                "model.rotary_percent",
                f"{self.rotary_percent} is outside (0, 1]",
                "it is the fraction of head channels that RoPE rotates",
                "set 0 < rotary_percent <= 1 (GLM-4.5: 0.5)",
            )
        rotary_dim = self.head_dim * self.rotary_percent
        if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2:
            raise ConfigError(
                "model.rotary_percent",
                f"head_dim={self.head_dim} x {self.rotary_percent} = {rotary_dim} channels",
                "RoPE rotates pairs of whole channels",
                "choose rotary_percent so that head_dim * rotary_percent is an even integer",
            )

    @property
    def is_moe(self) -> bool:
        return self.architecture != "qwen3"

    @property
    def moe_layer_indices(self) -> list[int]:
        """Indices of the decoder layers that route to experts."""
        if not self.is_moe:
            return []
        return list(range(self.first_k_dense_layers, self.num_layers))


# --------------------------------------------------------------------------------------------
# Parallelism
# --------------------------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    """Megatron-Core layout. Data parallel size is what is left: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor parallel size (sequence parallel is switched on whenever tp > 1)."""
    pp: int = 1
    """Pipeline parallel size."""
    vpp: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None or 1 disables."""
    ep: int = 1
    """Expert parallel size (divides the data-parallel x context-parallel ranks)."""
    etp: int = 1
    """Expert tensor parallel size."""
    cp: int = 1
    """Context parallel size (sequences split in a zig-zag over cp ranks)."""
    micro_batch_tokens: int = 4096
    """Token budget of one packed micro-batch per rank (samples are packed, never padded to the
    longest); a sample longer than this gets a micro-batch of its own."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data parallel (Megatron's distributed optimizer)."""
    moe_token_dispatcher: str = "auto"
    """Megatron MoE token dispatcher: alltoall, allgather, or auto. auto is Megatron's allgather
    dispatcher on CPU when the model is not split at all (tp = ep = etp = pp = cp = 1): there both
    dispatchers permute the tokens to the experts and back with the same operations, bit for bit,
    and allgather's path skips the all-to-all's metadata, its autograd nodes over a group of
    one and the chunk sort (~1 ms per micro-batch of the vs-TRL tiny job); alltoall everywhere
    else (Megatron's choice for expert parallel)."""
    collective_timeout_minutes: float = 30.0
    """How long a collective may wait for a peer before the run fails (a frozen node otherwise
    hangs every other rank). Must exceed the longest rollout, evaluation or checkpoint on the
    driver, during which the other ranks wait in a broadcast."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "cp", "micro_batch_tokens"):
            check_positive(f"parallel.{name}", getattr(self, name))
        if self.vpp is not None and self.vpp < 1:
            raise ConfigError(
                "parallel.vpp",
                f"{self.vpp} < 1",
                "it counts model chunks per pipeline rank",
                "set parallel.vpp=null or an integer >= 1",
            )
        if self.vpp is not None and self.vpp > 1 and self.pp < 2:
            raise ConfigError(
                "parallel.vpp",
                f"virtual pipeline ({self.vpp}) needs pipeline parallel, but pp={self.pp}",
                "virtual stages interleave chunks between pipeline ranks",
                "set parallel.pp >= 2 or parallel.vpp=null",
            )
        check_positive("parallel.collective_timeout_minutes", self.collective_timeout_minutes)
        check_choice(
            "parallel.moe_token_dispatcher",
            self.moe_token_dispatcher,
            ("auto", "alltoall", "allgather"),
            "these are the Megatron-Core dispatchers that run without DeepEP (auto: chosen "
            "by layout)",
        )

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def data_parallel_size(self, world_size: int) -> int:
        """Number of data-parallel replicas at this world size (validated by :meth:`check_world`)."""
        return world_size // self.model_parallel_size

    def check_world(self, world_size: int) -> None:
        """Fail with a clear message if the layout does not fit ``world_size`` processes."""
        if world_size % self.model_parallel_size:
            raise ConfigError(
                "parallel",
                f"world size {world_size} is not divisible by tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size}",
                "every rank belongs to exactly one tensor x pipeline x context group",
                "change torchrun --nproc_per_node/--nnodes or the parallel sizes",
            )
        dp = self.data_parallel_size(world_size)
        expert_ranks = dp * self.cp * self.tp
        if expert_ranks % (self.ep * self.etp):
            raise ConfigError(
                "parallel.ep",
                f"ep*etp = {self.ep}*{self.etp} does not divide dp*cp*tp = {expert_ranks}",
                "expert parallel groups are carved out of the data x context x tensor ranks",
                "choose ep*etp among the divisors of world_size/pp",
            )
