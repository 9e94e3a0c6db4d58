"""The one typed configuration tree of megatron_gspo.

Every default lives here, once; where a default comes from a paper or a peer framework the
comment says which. Hydra composes presets (``examples/moe/*.yaml``) and command-line overrides
against this schema (see :mod:`megatron_gspo.config_loader`); the dataclasses below decide what is
valid. Each sub-config validates its own fields in ``__post_init__``; :class:`TrainConfig`
validates the fields that depend on each other.

Every error is a :class:`ConfigError` that says what is wrong, why, and how to fix it.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from megatron_gspo.algo import AdvantageSettings, PolicyLossSettings, RolloutCorrection

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """An invalid configuration, reported before any work starts."""

    def __init__(self, key: str, what: str, why: str, fix: str):
        self.key = key
        super().__init__(f"config error at '{key}': {what}\n  why: {why}\n  fix: {fix}")


class ConfigWarning(UserWarning):
    """A configuration that is valid but probably not what the user wants."""


def _warn(key: str, message: str) -> None:
    # A warning, not a log line: callers can filter or catch it, and the command line prints it
    # once as a log line (megatron_gspo.console).
    warnings.warn(f"config warning at '{key}': {message}", ConfigWarning, stacklevel=3)


def _check_choice(key: str, value: Any, choices: tuple, why: str) -> None:
    if value not in choices:
        raise ConfigError(
            key,
            f"{value!r} is not one of {list(choices)}",
            why,
            f"set {key} to one of {', '.join(repr(c) for c in choices)}",
        )


def _is_loopback(host: str) -> bool:
    # Imported here: the rollout package is not needed to read a configuration.
    from megatron_gspo.rollout.auth import is_loopback_host

    return is_loopback_host(host)


def _check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            key,
            f"{value!r} is not {bound}",
            "a count or size must be positive",
            f"set {key} {bound}",
        )


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

ARCHITECTURES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3")


@dataclass
class ModelConfig:
    """Architecture of the policy. The defaults are the tiny CPU demo MoE (Qwen3-MoE shaped)."""

    architecture: str = "qwen3_moe"
    """One of qwen3_moe, mixtral, qwen2_moe (MoE with a gated shared expert) or qwen3 (dense)."""
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
    Qwen2-MoE uses False)."""
    shared_expert_intermediate_size: int = 0
    """Size of the gated shared expert (Qwen2-MoE); 0 means none."""
    first_k_dense_layers: int = 0
    """The first k decoder layers use a dense MLP instead of experts."""
    qk_layernorm: bool = True
    """Per-head RMSNorm on queries and keys (Qwen3); False for Mixtral and Qwen2-MoE."""
    add_qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2-MoE)."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary position embedding (Qwen3: 1e6)."""
    max_position_embeddings: int = 4096
    """Longest sequence (prompt + response) the rotary tables cover."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer (small dense Qwen3 models)."""
    moe_aux_loss_coef: float = 0.0
    """Load-balancing loss coefficient; scaled consistently with the policy loss. 0 disables."""
    dtype: str = "float32"
    """Parameter and compute dtype: float32 (CPU, tests) or bfloat16 (GPU)."""
    init_std: float = 0.02
    """Standard deviation of the seed initialisation (a model without hf_path or checkpoint)."""
    recompute_activations: bool = False
    """Full activation recomputation of every decoder layer (GPU memory saver)."""

    def __post_init__(self) -> None:
        _check_choice(
            "model.architecture",
            self.architecture,
            ARCHITECTURES,
            "the converter and the model builder have a mapping only for these",
        )
        _check_choice(
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
            _check_positive(f"model.{name}", getattr(self, name))
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
            _check_positive("model.num_experts", self.num_experts)
            _check_positive("model.moe_ffn_hidden_size", self.moe_ffn_hidden_size)
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
        _check_positive("model.moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)

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
    moe_token_dispatcher: str = "alltoall"
    """Megatron MoE token dispatcher: alltoall or allgather."""
    collective_timeout_minutes: float = 30.0
    """How long a collective may wait for a peer before the run fails (a frozen node otherwise
    hangs every other rank). Must exceed the longest rollout, evaluation or checkpoint on the
    driver, during which the other ranks wait in a broadcast."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "etp", "cp", "micro_batch_tokens"):
            _check_positive(f"parallel.{name}", getattr(self, name))
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
        _check_positive("parallel.collective_timeout_minutes", self.collective_timeout_minutes)
        _check_choice(
            "parallel.moe_token_dispatcher",
            self.moe_token_dispatcher,
            ("alltoall", "allgather"),
            "these are the Megatron-Core dispatchers that run without DeepEP",
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


# --------------------------------------------------------------------------------------------
# Algorithm
# --------------------------------------------------------------------------------------------

IMPORTANCE_SAMPLING = ("seq", "seq_token", "token")
ADV_ESTIMATORS = ("grpo", "dr_grpo", "reinforce", "rloo")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "dr-grpo",
)
KL_ESTIMATORS = ("k1", "k2", "k3")
OLD_LOG_PROB_SOURCES = ("recompute", "rollout", "detach")
ROUTING_REPLAY_MODES = ("none", "r2", "r3")


SURROGATES = ("clip", "cispo", "gmpo")
CORRECTION_LEVELS = ("none", "token", "sequence")
CORRECTION_MODES = ("truncate", "mask")
CORRECTION_BOUNDS = {
    # (level, mode): (low, high) used when algo.rollout_correction.low / high are null.
    ("token", "truncate"): (None, 2.0),
    # TIS: C = 2, Yao et al. 2025 ("Your Efficient RL Framework Secretly Brings You Off-Policy
    # RL Training"), slime --tis-clip 2.0, verl rollout_is_threshold 2.0.
    ("token", "mask"): (0.5, 5.0),
    # IcePop's [alpha, beta] = [0.5, 5] (Ling team 2025; verl's IcePop example "0.5_5.0").
    ("sequence", "truncate"): (None, 2.0),
    # slime mis.py (level geometric, mode truncate) keeps the token cap, C = 2.
    ("sequence", "mask"): (0.999, 1.001),
    # verl's geometric rejection (Geo-RS) default "0.999_1.001"; NeMo-RL's seq-mask-tis examples
    # use [0.999, 1.002]. A geometric mean per token stays close to 1, hence the tight band.
}


@dataclass
class RolloutCorrectionConfig:
    """Importance-sampling correction between the trainer's old policy and the rollout engine's
    behaviour policy (the engine's per-token log-probs): what fixes the training-inference
    mismatch of a bf16 engine (``rollout.dtype``) or of SGLang. Formulas and sources:
    docs/algorithms.md, "Rollout corrections"; the implementation is
    :mod:`megatron_gspo.algo.corrections`."""

    level: str = "none"
    """none (off), token (one weight per token: TIS / MIS) or sequence (the geometric mean
    ``exp(mean_t log(pi_old / mu))``, one weight per sequence -- never the product)."""
    mode: str = "truncate"
    """truncate: the weight is ``min(ratio, high)`` (TIS); mask: tokens (or whole sequences) whose
    ratio lies outside ``[low, high]`` get weight 0 and keep their place in the loss denominators
    (MIS; IcePop's two-sided mask)."""
    low: Optional[float] = None
    """Lower bound of mask (must stay null for truncate, which caps from above only); null: 0.5
    for token (IcePop), 0.999 for sequence (verl Geo-RS)."""
    high: Optional[float] = None
    """The cap of truncate, the upper bound of mask; null: 2 for truncate (TIS, Yao et al. 2025;
    slime, verl), 5 for token mask (IcePop), 1.001 for sequence mask (verl Geo-RS)."""

    def __post_init__(self) -> None:
        key = "algo.rollout_correction"
        _check_choice(f"{key}.level", self.level, CORRECTION_LEVELS, "none, token or sequence")
        _check_choice(f"{key}.mode", self.mode, CORRECTION_MODES, "truncate or mask")
        if self.level == "none":
            return
        low, high = self.bounds
        if self.mode == "truncate":
            if self.low is not None:
                raise ConfigError(
                    f"{key}.low",
                    f"low={self.low} with mode=truncate",
                    "truncation caps the weight from above only (TIS: min(ratio, high))",
                    f"remove {key}.low, or use mode=mask to drop tokens below it",
                )
            if not high >= 1:
                raise ConfigError(
                    f"{key}.high",
                    f"high={high} < 1 with mode=truncate",
                    "a cap below 1 shrinks every on-policy token's weight",
                    "set high >= 1 (TIS uses 2)",
                )
        elif not 0 <= low < 1 < high:
            raise ConfigError(
                f"{key}.low/high",
                f"[low, high] = [{low}, {high}] does not contain 1 strictly inside",
                "a token whose engine and trainer agree (ratio 1) must be kept",
                "set 0 <= low < 1 < high (IcePop uses [0.5, 5], verl's Geo-RS [0.999, 1.001])",
            )

    @property
    def enabled(self) -> bool:
        return self.level != "none"

    @property
    def bounds(self) -> tuple[Optional[float], float]:
        """``(low, high)`` with the defaults of :data:`CORRECTION_BOUNDS` filled in."""
        default_low, default_high = CORRECTION_BOUNDS[(self.level, self.mode)]
        low = self.low if self.low is not None else default_low
        return low, (self.high if self.high is not None else default_high)

    def correction(self) -> Optional[RolloutCorrection]:
        """The algorithm core's :class:`~megatron_gspo.algo.RolloutCorrection`, or None (off)."""
        if not self.enabled:
            return None
        from megatron_gspo.algo import RolloutCorrection

        low, high = self.bounds
        return RolloutCorrection(level=self.level, mode=self.mode, low=low, high=high)


@dataclass
class AlgoConfig:
    """GSPO / GRPO settings. Key names and meanings follow ROLL's documentation (docs of
    alibaba/ROLL, "GSPO"), except where a docstring says otherwise.

    ``importance_sampling`` selects the policy loss: ``seq`` is GSPO (sequence ratio), ``seq_token``
    is GSPO-token, ``token`` is GRPO/PPO (token ratio). It is the only switch between them.
    """

    importance_sampling: str = "seq"
    """seq (GSPO), seq_token (GSPO-token) or token (GRPO/PPO): the ratio of the policy loss."""
    adv_estimator: str = "grpo"
    """grpo: (r - group mean) / (group std + eps); dr_grpo: r - group mean (Dr.GRPO, Liu et al.
    2025); reinforce: r - baseline (``reinforce_baseline``; ROLL uses none and relies on
    whitening); rloo: r - mean of the other samples of the group."""
    rollout_batch_size: int = 32
    """Prompts per step (ROLL meaning). Samples per step = rollout_batch_size x group size."""
    num_return_sequences_in_group: int = 8
    """Responses sampled per prompt (the group)."""
    prompt_length: int = 64
    """Longest prompt in tokens; longer prompts are filtered out and counted, never truncated."""
    response_length: int = 10
    """Most tokens generated per response; also the constant T_norm of the seq-mean-token-sum-norm
    and dr-grpo aggregations."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    num_mini_batches: int = 4
    """Optimizer steps per epoch: the rollout batch is cut into this many mini-batches. The GSPO
    paper splits each rollout batch into 4 (arXiv 2507.18071 v2, section 5.1)."""
    clip_low: float = 3e-4
    """Lower clip range eps_low: ratio >= 1 - clip_low. GSPO paper: 3e-4 (section 5.1); the paper's
    GRPO baseline uses 0.2."""
    clip_high: float = 4e-4
    """Upper clip range eps_high: ratio <= 1 + clip_high. GSPO paper: 4e-4; GRPO baseline 0.27."""
    dual_clip_loss: bool = False
    """Dual clip for negative advantages (Ye et al. 2020): the per-token loss is capped at
    -dual_clip_constant * A. Unlike ROLL, the constant is its own parameter."""
    dual_clip_constant: float = 3.0
    """c of dual clip (Ye et al. 2020 use 3); must exceed 1 + clip_high."""
    loss_agg_mode: str = "seq-mean-token-mean"
    """token-mean (sum / tokens), seq-mean-token-sum (sum / sequences), seq-mean-token-mean (mean
    over sequences of each one's token mean), seq-mean-token-sum-norm (sum / response_length, as
    ROLL and verl; no division by the sequences) or dr-grpo (sum / (sequences x response_length),
    TRL's dr_grpo). GSPO's objective is seq-mean-token-mean."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(policy || reference) to the loss (builds a frozen reference model).
    The GSPO authors run without it."""
    kl_loss_coef: float = 0.001
    """ROLL's default."""
    kl_estimator: str = "k3"
    """Estimator of the KL loss: k1 = lp - ref, k2 = (lp - ref)^2 / 2, k3 = exp(ref - lp) - (ref -
    lp) - 1 (Schulman 2020). ROLL hard-wires k3."""
    kl_clamp: Optional[float] = 10.0
    """Cap of the k3 estimate per token, clamp(k3, -kl_clamp, kl_clamp), in the KL loss and the
    KL-in-reward term: verl's and slime's low_var_kl and ROLL's k3 clamp at 10. Beyond the cap a
    token adds no KL gradient (without it, up to e^20 x the coefficient). null: no cap. k1 and k2
    are never capped."""
    add_token_level_kl: bool = False
    """Subtract token_level_kl_coef x KL(old || ref) from the reward at every token (ROLL
    meaning); advantages become per token, so GSPO-token is the GSPO variant that uses them."""
    token_level_kl_coef: float = 0.2
    """Coefficient of the KL-in-reward term (ROLL's init_kl_coef default)."""
    token_level_kl_estimator: str = "k1"
    """Estimator of the KL-in-reward term (ROLL's kl_penalty default, k1)."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef x entropy (same aggregation as the policy loss)."""
    whiten_advantages: bool = False
    """Token-weighted whitening of the advantages over the rollout batch (masked mean, unbiased
    variance, 1/sqrt(var + 1e-8)), as ROLL does."""
    advantage_clip: Optional[float] = None
    """Clamp advantages to +-advantage_clip after whitening; null disables."""
    reward_clip: Optional[float] = None
    """Clamp the (normalised) sequence reward to +-reward_clip; null disables."""
    reward_norm: Optional[str] = None
    """Scope of reward normalisation before the estimator: batch, group, running, or null.
    ROLL documents this key but silently ignores it; here it works."""
    reward_shift: bool = False
    """With reward_norm: only subtract the mean (no division by the std)."""
    reward_scale: bool = False
    """With reward_norm: only divide by the std (no mean subtraction)."""
    std_unbiased: bool = True
    """Group/batch std with Bessel's correction (torch.std default; ROLL, verl, TRL) or the
    population std (Megatron-RL)."""
    std_eps: float = 1e-6
    """Added to the std before dividing (ROLL, verl, slime use 1e-6; TRL 1e-4)."""
    reinforce_baseline: str = "none"
    """Baseline of adv_estimator=reinforce: none (ROLL), group mean, or batch mean."""
    old_log_prob_source: str = "recompute"
    """Old-policy log-probs: recompute (a training-engine forward before the update), rollout (the
    inference engine's log-probs, which the GSPO paper argues GSPO tolerates), detach (old =
    current, detached; only exact when each rollout batch gives one optimizer step)."""
    routing_replay: str = "none"
    """MoE Routing Replay: none, r2 (replay the routes recorded in the old-log-prob forward),
    r3 (replay the rollout engine's routes in the old-log-prob and training forwards)."""
    log_routing_change: bool = True
    """MoE: measure expert volatility on every mini-batch, ``routing_change_frac`` (share of
    (loss token, MoE layer) pairs whose top-k set under the weights being trained differs from
    the old policy's, also per layer) and ``routing_change_frac_vs_rollout`` (against the rollout
    engine's routes, when samples carry them). Costs one top-k per MoE layer in the training
    forward; the old policy's routes are recorded in the recompute forward (M x K bytes per token
    on CPU, gathered on every rank). Without that forward (old_log_prob_source rollout or detach)
    only the comparison with the rollout's routes is available."""
    log_ratio_clamp: float = 10.0
    """|log ratio| is clamped to this before exp (sequence and token ratios), as verl does."""
    advantage_level: str = "sequence"
    """sequence: one advantage per sample from its reward; turn: per-token advantages from an
    environment's turn rewards (each model turn gets the group-relative advantage of its
    reward-to-go, docs/algorithms.md), which GSPO-token (importance_sampling=seq_token) or the
    token ratio weigh per token. Needs an environment (env.name)."""
    mask_truncated: bool = False
    """Keep responses cut by a length limit (finish reason ``length``; a trajectory cut by an
    environment limit) out of the loss: DAPO's over-long filtering (arXiv 2503.14476, section
    3.4). Their rewards still count in their group's baseline. Counted in
    ``truncated_masked_frac``."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (arXiv 2503.14476, section 3.2; verl's
    ``algorithm.filter_groups``): drop groups whose rewards are all equal (advantage 0: no
    signal) and generate for more prompts until the batch holds rollout_batch_size informative
    groups. Prompts of dropped groups count as consumed. Metrics: ``dynamic_sampling/...``."""
    dynamic_sampling_max_rounds: int = 10
    """Most generation rounds per step with dynamic_sampling (verl's
    ``filter_groups.max_num_gen_batches``: 10); a batch still short after them is filled with
    dropped groups (counted in ``dynamic_sampling/filled_groups``, warned)."""
    surrogate: str = "clip"
    """The per-token objective: clip (PPO's clipped ratio, with importance_sampling's ratio: GSPO,
    GSPO-token, GRPO), cispo (CISPO, MiniMax-M1 arXiv 2506.13585: the clipped token ratio as a
    detached weight on the log-likelihood gradient, so no token's gradient is dropped) or gmpo
    (GMPO, arXiv 2507.20673: the geometric mean of the token ratios, clipped in log space). cispo
    and gmpo use token ratios (importance_sampling=token); gmpo needs sequence advantages and
    seq-mean-token-mean. Formulas: docs/algorithms.md."""
    cispo_weight_low: float = 0.0
    """CISPO's weight is clip(r, cispo_weight_low, cispo_weight_high); 0 is MiniMax-M1's choice
    of no lower bound (they tune the upper one only, section 3.1)."""
    cispo_weight_high: float = 5.0
    """Upper bound of CISPO's weight: ScaleRL's eps_max (arXiv 2510.13786), the value TRL
    recommends for its loss_type=cispo."""
    gmpo_log_clip: float = 0.4
    """GMPO clips token log ratios at +-gmpo_log_clip (on the side that binds for the advantage's
    sign): the paper's range (e^-0.4, e^0.4), its scripts' CLIPRANGE=0.4."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights between the old policy and the rollout engine's log-probs
    (level none|token|sequence, mode truncate|mask, low, high)."""

    def __post_init__(self) -> None:
        _check_choice(
            "algo.importance_sampling",
            self.importance_sampling,
            IMPORTANCE_SAMPLING,
            "seq is GSPO, seq_token GSPO-token, token GRPO/PPO",
        )
        _check_choice(
            "algo.adv_estimator", self.adv_estimator, ADV_ESTIMATORS, "these are the estimators"
        )
        _check_choice(
            "algo.loss_agg_mode",
            self.loss_agg_mode,
            LOSS_AGG_MODES,
            "these are ROLL's four modes (with ROLL's meanings) and TRL's dr_grpo",
        )
        _check_choice("algo.kl_estimator", self.kl_estimator, KL_ESTIMATORS, "Schulman's k1/k2/k3")
        _check_choice(
            "algo.token_level_kl_estimator",
            self.token_level_kl_estimator,
            KL_ESTIMATORS,
            "Schulman's k1/k2/k3",
        )
        _check_choice(
            "algo.reward_norm",
            self.reward_norm,
            (None, "batch", "group", "running"),
            "reward statistics come from the batch, the group, or a running estimate",
        )
        _check_choice(
            "algo.reinforce_baseline",
            self.reinforce_baseline,
            ("none", "group", "batch"),
            "REINFORCE subtracts no baseline, the group mean or the batch mean",
        )
        _check_choice(
            "algo.old_log_prob_source",
            self.old_log_prob_source,
            OLD_LOG_PROB_SOURCES,
            "old log-probs are recomputed, taken from the rollout, or the current ones detached",
        )
        _check_choice(
            "algo.routing_replay",
            self.routing_replay,
            ROUTING_REPLAY_MODES,
            "none, r2 (training-engine routes) or r3 (rollout-engine routes)",
        )
        for name in (
            "rollout_batch_size",
            "num_return_sequences_in_group",
            "prompt_length",
            "response_length",
            "ppo_epochs",
            "num_mini_batches",
            "dynamic_sampling_max_rounds",
        ):
            _check_positive(f"algo.{name}", getattr(self, name))
        for name in ("clip_low", "clip_high"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ConfigError(
                    f"algo.{name}",
                    f"{value!r} is outside (0, 1)",
                    "the ratio is clipped to [1 - clip_low, 1 + clip_high]; 0 freezes it and "
                    ">= 1 allows a zero ratio",
                    "use 3e-4 / 4e-4 for GSPO (paper section 5.1) or 0.2 / 0.27 for GRPO",
                )
        if self.dual_clip_loss and self.dual_clip_constant <= 1 + self.clip_high:
            raise ConfigError(
                "algo.dual_clip_constant",
                f"{self.dual_clip_constant} <= 1 + clip_high = {1 + self.clip_high}",
                "the dual clip caps the loss of negative-advantage tokens at -c*A; with "
                "c <= 1 + clip_high it overrides the ordinary clip",
                "set dual_clip_constant > 1 + clip_high (3.0 is the usual value)",
            )
        for name in ("advantage_clip", "reward_clip"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(
                    f"algo.{name}",
                    f"{value!r} is not > 0",
                    "it is a symmetric clamp bound",
                    f"set algo.{name}=null to disable it or a positive bound",
                )
        if self.reward_shift and self.reward_scale:
            raise ConfigError(
                "algo.reward_shift",
                "reward_shift and reward_scale are both true",
                "reward_shift means subtract the mean only, reward_scale divide by the std only",
                "set one of them, or neither for full (r - mean) / std normalisation",
            )
        if (self.reward_shift or self.reward_scale) and self.reward_norm is None:
            raise ConfigError(
                "algo.reward_norm",
                "reward_shift/reward_scale is set but reward_norm is null",
                "shift and scale choose how rewards are normalised, reward_norm the statistics",
                "set algo.reward_norm to batch, group or running",
            )
        for name in ("kl_loss_coef", "token_level_kl_coef", "entropy_coef", "std_eps"):
            _check_positive(f"algo.{name}", getattr(self, name), allow_zero=True)
        _check_positive("algo.log_ratio_clamp", self.log_ratio_clamp)
        if self.kl_clamp is not None:
            _check_positive("algo.kl_clamp", self.kl_clamp)
        if self.routing_replay == "r2" and self.old_log_prob_source != "recompute":
            raise ConfigError(
                "algo.routing_replay",
                f"r2 needs old_log_prob_source=recompute, got {self.old_log_prob_source!r}",
                "R2 records the routes in the old-log-prob forward of the training engine; with "
                f"{self.old_log_prob_source!r} that forward does not exist",
                "use algo.old_log_prob_source=recompute, or algo.routing_replay=r3",
            )
        if self.add_token_level_kl and self.old_log_prob_source == "detach":
            raise ConfigError(
                "algo.add_token_level_kl",
                "KL-in-reward needs old log-probs before the update, but old_log_prob_source is "
                "'detach'",
                "the reward term is KL(old || ref) per token, computed before any update",
                "use algo.old_log_prob_source=recompute or rollout",
            )
        _check_choice(
            "algo.advantage_level",
            self.advantage_level,
            ("sequence", "turn"),
            "advantages are per sample or per model turn",
        )
        if self.advantage_level == "turn":
            if self.importance_sampling == "seq":
                raise ConfigError(
                    "algo.advantage_level",
                    "per-turn advantages with GSPO's sequence ratio (importance_sampling=seq)",
                    "GSPO's loss weighs every token of a sequence by one ratio, so per-token "
                    "advantages average out to their mean; GSPO-token keeps them apart (GSPO "
                    "paper, eq. 13-14)",
                    "set algo.importance_sampling=seq_token (GSPO-token) or token",
                )
            for name in ("reward_norm", "reward_clip"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"algo.{name}",
                        f"{name} with per-turn advantages",
                        "reward normalisation and clipping act on one reward per sample; "
                        "per-turn advantages start from the turns' rewards",
                        f"set algo.{name}=null, or algo.advantage_level=sequence",
                    )
            if self.add_token_level_kl:
                raise ConfigError(
                    "algo.add_token_level_kl",
                    "KL-in-reward with per-turn advantages",
                    "both make per-token advantages, in different ways; combining them is not "
                    "defined here",
                    "set one of algo.add_token_level_kl=false or algo.advantage_level=sequence",
                )
        if self.dynamic_sampling and self.num_return_sequences_in_group < 2:
            raise ConfigError(
                "algo.dynamic_sampling",
                "dynamic sampling with one response per prompt",
                "a group of one has advantage 0 whatever its reward, so every group would be "
                "dropped",
                "set algo.num_return_sequences_in_group >= 2 or algo.dynamic_sampling=false",
            )
        self._check_surrogate_and_correction()
        self._warn_gspo_settings()

    def _check_surrogate_and_correction(self) -> None:
        _check_choice(
            "algo.surrogate", self.surrogate, SURROGATES, "clip (PPO / GRPO / GSPO), cispo or gmpo"
        )
        if self.surrogate != "clip":
            if self.importance_sampling != "token":
                raise ConfigError(
                    "algo.importance_sampling",
                    f"importance_sampling={self.importance_sampling!r} with "
                    f"surrogate={self.surrogate!r}",
                    f"{self.surrogate} is built on token ratios (GMPO takes their geometric mean "
                    "itself); the sequence ratios of GSPO are for the clipped surrogate",
                    "set algo.importance_sampling=token",
                )
            if self.dual_clip_loss:
                raise ConfigError(
                    "algo.dual_clip_loss",
                    f"dual clip with surrogate={self.surrogate!r}",
                    "dual clip bounds PPO's clipped surrogate for negative advantages; "
                    f"{self.surrogate} has its own clipping",
                    "set algo.dual_clip_loss=false",
                )
        if self.surrogate == "cispo" and not (
            0 <= self.cispo_weight_low <= 1 <= self.cispo_weight_high
        ):
            raise ConfigError(
                "algo.cispo_weight_low/high",
                f"[{self.cispo_weight_low}, {self.cispo_weight_high}] does not contain 1",
                "CISPO clips the importance weight; an on-policy token (ratio 1) must keep "
                "weight 1",
                "set 0 <= cispo_weight_low <= 1 <= cispo_weight_high (default 0 and 5)",
            )
        if self.surrogate == "gmpo":
            _check_positive("algo.gmpo_log_clip", self.gmpo_log_clip)
            if self.loss_agg_mode != "seq-mean-token-mean":
                raise ConfigError(
                    "algo.loss_agg_mode",
                    f"loss_agg_mode={self.loss_agg_mode!r} with surrogate='gmpo'",
                    "GMPO's objective is one term per sequence averaged over sequences",
                    "set algo.loss_agg_mode=seq-mean-token-mean",
                )
            if self.add_token_level_kl:
                raise ConfigError(
                    "algo.add_token_level_kl",
                    "KL-in-reward (per-token advantages) with surrogate='gmpo'",
                    "GMPO multiplies one sequence ratio by one sequence advantage",
                    "set algo.add_token_level_kl=false, or use surrogate=clip",
                )
        correction = self.rollout_correction
        if not correction.enabled:
            return
        if self.old_log_prob_source == "rollout":
            raise ConfigError(
                "algo.rollout_correction.level",
                f"a {correction.level}-level correction with old_log_prob_source=rollout",
                "the correction weighs pi_old / mu, and with rollout log-probs as the old "
                "policy pi_old = mu: every weight would be 1",
                "use algo.old_log_prob_source=recompute (or detach), or "
                "algo.rollout_correction.level=none",
            )
        if self.surrogate == "gmpo" and correction.level == "token":
            raise ConfigError(
                "algo.rollout_correction.level",
                "a token-level correction with surrogate='gmpo'",
                "GMPO's loss has one term per sequence, which a per-token weight cannot scale",
                "use algo.rollout_correction.level=sequence",
            )

    def _warn_gspo_settings(self) -> None:
        if self.importance_sampling == "token":
            return
        if max(self.clip_low, self.clip_high) > 0.05:
            _warn(
                "algo.clip_low/clip_high",
                f"GSPO with a token-sized clip range ({self.clip_low}, {self.clip_high}): the "
                "sequence ratio is a geometric mean of token ratios and stays close to 1, so a "
                "range above 0.05 almost never clips and the trust region is lost. The GSPO paper "
                "uses 3e-4 / 4e-4 (section 5.1).",
            )
        if self.loss_agg_mode in ("token-mean", "seq-mean-token-sum"):
            _warn(
                "algo.loss_agg_mode",
                f"GSPO with loss_agg_mode={self.loss_agg_mode!r} weights each sequence by its "
                "length (ROLL#165, TRL#3823); GSPO's objective is seq-mean-token-mean.",
            )

    @property
    def samples_per_step(self) -> int:
        return self.rollout_batch_size * self.num_return_sequences_in_group

    @property
    def needs_reference_model(self) -> bool:
        return self.use_kl_loss or self.add_token_level_kl

    # The translation from these keys to the algorithm core's settings, written once.

    def policy_loss_settings(self) -> PolicyLossSettings:
        """The settings of :func:`megatron_gspo.algo.policy_loss` for this configuration."""
        from megatron_gspo.algo import PolicyLossSettings

        return PolicyLossSettings(
            importance_sampling=self.importance_sampling,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            loss_agg_mode=self.loss_agg_mode,
            dual_clip_constant=self.dual_clip_constant if self.dual_clip_loss else None,
            kl_coef=self.kl_loss_coef if self.use_kl_loss else 0.0,
            kl_estimator=self.kl_estimator,
            kl_clamp=self.kl_clamp,
            entropy_coef=self.entropy_coef,
            norm_length=self.response_length,
            log_ratio_clamp=self.log_ratio_clamp,
            surrogate=self.surrogate,
            cispo_weight_bounds=(self.cispo_weight_low, self.cispo_weight_high)
            if self.surrogate == "cispo"
            else None,
            gmpo_log_clip=self.gmpo_log_clip if self.surrogate == "gmpo" else None,
            rollout_correction=self.rollout_correction.correction(),
        )

    def advantage_settings(self) -> AdvantageSettings:
        """The settings of :func:`megatron_gspo.algo.compute_advantages` for this configuration."""
        from megatron_gspo.algo import AdvantageSettings

        return AdvantageSettings(
            estimator=self.adv_estimator,
            reward_norm=self.reward_norm,
            reward_shift=self.reward_shift,
            reward_scale=self.reward_scale,
            reward_clip=self.reward_clip,
            std_unbiased=self.std_unbiased,
            std_eps=self.std_eps,
            reinforce_baseline=self.reinforce_baseline,
            per_turn=self.advantage_level == "turn",
            token_level_kl_coef=self.token_level_kl_coef if self.add_token_level_kl else None,
            token_level_kl_estimator=self.token_level_kl_estimator,
            kl_clamp=self.kl_clamp,
            whiten=self.whiten_advantages,
            advantage_clip=self.advantage_clip,
        )


# --------------------------------------------------------------------------------------------
# Optimizer
# --------------------------------------------------------------------------------------------


@dataclass
class OptimConfig:
    """AdamW through Megatron's optimizer, with linear warm-up then constant or cosine decay."""

    lr: float = 3e-3
    """Peak learning rate. 3e-3 suits the tiny CPU demo; the GPU presets use 1e-6."""
    min_lr: float = 0.0
    """Learning rate at the end of a linear or cosine decay."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0."""
    lr_decay_style: str = "constant"
    """constant, linear or cosine decay to min_lr over the run's optimizer steps."""
    max_consecutive_skips: int = 3
    """A step whose loss or grad norm is not finite is skipped (weights and optimizer state
    untouched); this many skips in a row stop the run."""
    max_collapsed_steps: int = 3
    """RL steps in a row whose every optimizer step had a gradient norm of exactly 0 while the
    advantages were not 0 (a collapsed policy: saturated or dead activations, e.g. after a far too
    large lr) that stop the run; 0 never stops (megatron_gspo.health.CollapseGuard)."""

    def __post_init__(self) -> None:
        _check_positive("optim.lr", self.lr)
        _check_positive("optim.min_lr", self.min_lr, allow_zero=True)
        _check_positive("optim.clip_grad", self.clip_grad, allow_zero=True)
        _check_positive("optim.lr_warmup_steps", self.lr_warmup_steps, allow_zero=True)
        _check_positive("optim.max_consecutive_skips", self.max_consecutive_skips)
        _check_positive("optim.max_collapsed_steps", self.max_collapsed_steps, allow_zero=True)
        _check_choice(
            "optim.lr_decay_style",
            self.lr_decay_style,
            ("constant", "linear", "cosine"),
            "these are the supported schedules",
        )
        if self.min_lr > self.lr:
            raise ConfigError(
                "optim.min_lr",
                f"min_lr={self.min_lr} > lr={self.lr}",
                "the schedule decays from lr to min_lr",
                "set min_lr <= lr",
            )


# --------------------------------------------------------------------------------------------
# Rollout
# --------------------------------------------------------------------------------------------


ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class RolloutConfig:
    """Where samples come from."""

    engine: str = "embedded"
    """embedded (the policy as a transformers model in the trainer process, the default and the
    CPU path), embedded_http (the same engine behind a loopback HTTP server, driven through the
    SGLang client) or sglang (SGLang servers)."""
    dtype: str = "float32"
    """Parameter and compute dtype of the embedded engines (``embedded``, ``embedded_http``):
    float32 (the default: an exact twin of the fp32 trainer, train/rollout k3 KL about 1e-13),
    bfloat16 or float16. Weights are cast when they are synced, and the whole forward, MoE router
    included, runs in that dtype, as SGLang's does, so the engine's log-probs and routes really
    differ from the trainer's (the training-inference mismatch of real runs; see
    docs/algorithms.md). Logits come out of the output layer in this dtype and the log-softmax is
    taken in float32, as SGLang's logits processor and sampler do. SGLang picks its own dtype
    (its ``--dtype``, in ``sglang_extra_args``), so this must stay float32 with engine=sglang."""
    temperature: float = 1.0
    """Sampling temperature; training log-probs are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 samples from the whole distribution (below 1 warns)."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 disables (above 0 warns)."""
    min_new_tokens: int = 0
    """Stop tokens (the tokenizer's EOS included) cannot be sampled before a response has this
    many tokens (SGLang's ``min_new_tokens``); at ``>= algo.response_length`` every response is
    exactly ``response_length`` tokens long (fixed-length benchmarks, ``benchmarks/vs_trl.py``).
    The embedded engine masks them for sampling only and still reports the log-probs of the
    unmasked distribution, which is what the trainer computes (so ``old_log_prob_source=rollout``
    stays consistent)."""
    seed: Optional[int] = None
    """Sampling seed; null derives it from the run seed and step."""
    sglang_urls: list[str] = field(default_factory=list)
    """Existing SGLang servers (http://host:port); empty means launch them."""
    sglang_launch: bool = False
    """Launch SGLang servers with ``python -m sglang.launch_server``."""
    sglang_host: str = "127.0.0.1"
    """Address launched SGLang servers listen on. They require the run's API key, but plain HTTP
    carries it (and the weights) unencrypted: any other address than loopback warns at start."""
    sglang_port: int = 30000
    """Port of the first launched server; server i listens on sglang_port + i."""
    sglang_tp: int = 1
    """Tensor parallel size of each launched server (its --tp-size); server i uses the GPUs from i *
    sglang_tp."""
    sglang_ep: int = 1
    """Expert parallel size of each launched server (its --ep-size); divides sglang_tp."""
    sglang_mem_fraction: float = 0.7
    """SGLang's --mem-fraction-static: the share of each GPU's memory that SGLang takes for its
    weights and KV cache. Colocated with the trainer, it must leave room for the trainer's
    resident weights, gradients and optimizer state."""
    sglang_extra_args: list[str] = field(default_factory=list)
    """More arguments for launched servers (SGLang ServerArgs flags); flags set from the keys above
    may not be repeated here."""
    sglang_release_memory: bool = False
    """Colocated layout (SGLang on the trainer's GPUs): release SGLang's GPU memory (weights, KV
    cache, CUDA graphs) with /release_memory_occupation after each rollout, so that log-probs and
    the update can use it, and resume it before the next weight sync (slime's --offload-rollout).
    The servers must run with --enable-memory-saver (examples/moe/sglang_server.sh adds it)."""
    weight_transport: str = "tensor"
    """How weights reach SGLang: tensor (colocated, update_weights_from_tensor), distributed
    (NCCL broadcast, update_weights_from_distributed) or disk (safetensors +
    update_weights_from_disk)."""
    weight_bucket_mb: int = 512
    """Upper bound of one weight-sync bucket."""
    request_timeout_s: float = 600.0
    """Time limit of one /generate call to an SGLang server."""
    max_retries: int = 3
    """Retries of a request that failed in transport (connection refused or reset), with doubling
    backoff."""
    max_concurrency: int = 256
    """Most /generate calls in flight over all servers."""

    def __post_init__(self) -> None:
        _check_choice(
            "rollout.engine",
            self.engine,
            ("embedded", "embedded_http", "sglang"),
            "these are the rollout engines",
        )
        _check_choice(
            "rollout.dtype",
            self.dtype,
            ROLLOUT_DTYPES,
            "the embedded engine runs in float32, bfloat16 or float16",
        )
        if self.engine == "sglang" and self.dtype != "float32":
            raise ConfigError(
                "rollout.dtype",
                f"rollout.dtype={self.dtype!r} with rollout.engine='sglang'",
                "rollout.dtype sets the embedded engine's precision; SGLang servers choose their "
                "own (bfloat16 for bf16 checkpoints by default)",
                "leave rollout.dtype=float32 and pass '--dtype' through rollout.sglang_extra_args",
            )
        _check_choice(
            "rollout.weight_transport",
            self.weight_transport,
            ("tensor", "distributed", "disk"),
            "SGLang takes weights from tensors, a broadcast group or disk",
        )
        _check_positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(
                "rollout.top_p",
                f"{self.top_p} is outside (0, 1]",
                "top-p is a probability mass",
                "set 0 < top_p <= 1",
            )
        if self.top_p < 1 or self.top_k > 0:
            _warn(
                "rollout.top_p/top_k",
                "top-p/top-k sampling: rollout log-probs are computed before truncation (SGLang "
                "semantics) but samples come from the truncated distribution, which biases the "
                "importance ratio",
            )
        _check_positive("rollout.min_new_tokens", self.min_new_tokens, allow_zero=True)
        _check_positive("rollout.weight_bucket_mb", self.weight_bucket_mb)
        _check_positive("rollout.request_timeout_s", self.request_timeout_s)
        _check_positive("rollout.max_retries", self.max_retries, allow_zero=True)
        if not 0 < self.sglang_mem_fraction < 1:
            raise ConfigError(
                "rollout.sglang_mem_fraction",
                f"{self.sglang_mem_fraction} is outside (0, 1)",
                "it is the share of each GPU's memory that SGLang reserves",
                "set 0 < sglang_mem_fraction < 1 (0.7 on dedicated GPUs, lower when colocated)",
            )
        if self.engine == "sglang" and self.sglang_launch and not _is_loopback(self.sglang_host):
            _warn(
                "rollout.sglang_host",
                f"{self.sglang_host!r} is not a loopback address: the SGLang servers this run "
                "launches are reachable from other machines. They refuse calls without the "
                "run's API key, but HTTP carries that key and the weights unencrypted; keep "
                "sglang_host=127.0.0.1 unless other nodes must reach the servers, and then "
                "only on a private cluster network",
            )
        if self.sglang_release_memory and self.engine != "sglang":
            raise ConfigError(
                "rollout.sglang_release_memory",
                f"sglang_release_memory=true with rollout.engine={self.engine!r}",
                "only SGLang servers hold GPU memory of their own to release; the embedded "
                "engines live in the trainer's process",
                "set rollout.sglang_release_memory=false, or rollout.engine=sglang",
            )


# --------------------------------------------------------------------------------------------
# Reward, data, evaluation, checkpoints, logging
# --------------------------------------------------------------------------------------------


@dataclass
class RewardConfig:
    """Reward functions by name (see megatron_gspo.reward) or by import path ``pkg.mod:fn``."""

    functions: list[str] = field(default_factory=lambda: ["synthetic"])
    """Built-in names (math, exact_match, format, code, synthetic) or import paths
    package.module:function; the reward is their weighted sum. The default is the CPU demo's digit
    reward, meaningful only for the synthetic tasks. A function's signature: README, "Custom reward
    functions"."""
    weights: list[float] = field(default_factory=list)
    """One weight per function; empty means all 1."""
    timeout_s: float = 10.0
    """A reward call that takes longer is counted as a time-out and scores failure_reward."""
    failure_reward: float = 0.0
    """Score of a sample whose reward raised or timed out (counted and logged, never silent)."""
    num_workers: int = 2
    """Reward calls running at the same time (worker processes or threads)."""
    executor: str = "process"
    """process: each worker is a child process, and a call that times out is stopped by killing
    its worker (which is then replaced); thread: workers are threads of the trainer (no start-up
    cost, breakpoint() works), but a timed-out call cannot be stopped and runs on in the
    background."""
    max_failed_steps: int = 3
    """A reward function that fails (raises, times out, returns no finite number) on every sample
    of this many batches in a row (training steps or evaluations) stops the run: its scores
    would all be failure_reward, which carries no signal. 0 never stops."""
    overlong_buffer: int = 0
    """DAPO's soft over-long punishment (arXiv 2503.14476, eq. 13; verl's
    ``reward_model.overlong_buffer``): a response longer than algo.response_length -
    overlong_buffer tokens loses overlong_penalty_factor x (excess / overlong_buffer) of reward,
    the full factor at the limit. 0 disables it (DAPO uses a 4096-token buffer under a 20480-token
    limit). Formula: docs/algorithms.md."""
    overlong_penalty_factor: float = 1.0
    """Largest over-long penalty (at the length limit); DAPO and verl use 1."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Keyword options per function, keyed like ``functions``, e.g.
    ``{format: {pattern: '^<answer>.*</answer>$'}, code: {timeout_s: 5}}``; the options each
    built-in accepts are the keyword arguments of its function in megatron_gspo.reward."""

    def __post_init__(self) -> None:
        _check_choice(
            "reward.executor",
            self.executor,
            ("process", "thread"),
            "reward calls run in child processes or in threads",
        )
        for name, options in self.options.items():
            if name not in self.functions:
                raise ConfigError(
                    f"reward.options.{name}",
                    f"options for {name!r}, which is not in reward.functions {self.functions}",
                    "options apply to a function that is used",
                    f"add {name!r} to reward.functions or remove its options",
                )
            if not isinstance(options, dict):
                raise ConfigError(
                    f"reward.options.{name}",
                    f"expected a mapping of option names to values, got {options!r}",
                    "options are passed to the function as keyword arguments",
                    f"write reward.options.{name} as key: value pairs",
                )
        if self.weights and len(self.weights) != len(self.functions):
            raise ConfigError(
                "reward.weights",
                f"{len(self.weights)} weights for {len(self.functions)} functions",
                "each function's score is multiplied by its weight",
                "give one weight per function, or none",
            )
        _check_positive("reward.timeout_s", self.timeout_s)
        _check_positive("reward.max_failed_steps", self.max_failed_steps, allow_zero=True)
        _check_positive("reward.num_workers", self.num_workers)
        _check_positive("reward.overlong_buffer", self.overlong_buffer, allow_zero=True)
        _check_positive("reward.overlong_penalty_factor", self.overlong_penalty_factor)


@dataclass
class DataConfig:
    """Prompt data."""

    task: str = "digit_copy"
    """Built-in synthetic task (digit_copy, digit_reversal, digit_sort) used when train_path is
    null."""
    train_path: Optional[str] = None
    """JSONL or Parquet with a prompt column (and answers/metadata)."""
    eval_path: Optional[str] = None
    """Held-out prompt file for evaluation (the format of train_path). Null: no evaluation set with
    a prompt file; the synthetic task uses its own held-out prompts."""
    prompt_key: str = "prompt"
    """Key (column) of the prompt in the prompt files: a string or chat messages. A dotted path
    reaches into nested objects and Parquet struct columns (``extra_info.question``)."""
    answer_key: str = "answer"
    """Key (column) of the reference answer (optional per row); rewards receive it as ``answer``.
    A dotted path reaches into nested objects: ``reward_model.ground_truth`` reads the layout of
    verl's preprocessed math sets (GSM8K, MATH: chat-message prompts, the answer in the
    ``reward_model`` struct)."""
    tokenizer_path: Optional[str] = None
    """HF tokenizer directory (defaults to model.hf_path); the synthetic tasks bring their own."""
    apply_chat_template: bool = True
    """Render file prompts with the tokenizer's chat template (add_generation_prompt=True); false
    encodes string prompts as they are. The synthetic tasks have a fixed format and ignore it."""
    shuffle: bool = True
    """Shuffle file prompts each epoch (seeded by seed and epoch; resumable)."""
    num_eval_prompts: int = 32
    """Held-out prompts of the synthetic task used for evaluation."""

    def __post_init__(self) -> None:
        _check_positive("data.num_eval_prompts", self.num_eval_prompts)
        for name in ("prompt_key", "answer_key"):
            value = getattr(self, name)
            if not value or any(not part for part in value.split(".")):
                raise ConfigError(
                    f"data.{name}",
                    f"{value!r} is not a key or a dotted key path",
                    "it names a column, or a path of keys into nested objects",
                    f"set data.{name} to a column name, e.g. 'prompt' or "
                    "'reward_model.ground_truth'",
                )


@dataclass
class EnvConfig:
    """Multi-turn rollouts in an environment (docs/agentic.md): the model's turns alternate with
    the environment's observations (tool outputs), token in and token out."""

    name: Optional[str] = None
    """Built-in environment (single_turn, python_tool, multiply_tool) or an import path
    package.module:Class; null: no environment (one completion per sample)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment (the built-ins': their classes in
    megatron_gspo/envs/), e.g. {tool_timeout_s: 5}."""
    max_turns: int = 4
    """Most model turns of a trajectory; one that has not ended after them is truncated (verl's
    multi_turn.max_assistant_turns, slime's retool max_turns)."""
    max_tokens_per_turn: Optional[int] = None
    """Most tokens of one model turn (a turn cut there truncates its trajectory); null: what is
    left of the response budget. The budget of a whole trajectory, model and observation tokens
    after the prompt, is algo.response_length."""
    num_workers: int = 4
    """Environment steps (tool calls) running at the same time, in threads of the driver."""

    def __post_init__(self) -> None:
        _check_positive("env.max_turns", self.max_turns)
        _check_positive("env.num_workers", self.num_workers)
        if self.max_tokens_per_turn is not None:
            _check_positive("env.max_tokens_per_turn", self.max_tokens_per_turn)
        if self.options and self.name is None:
            raise ConfigError(
                "env.options",
                "options given without an environment",
                "options are keyword arguments of the environment named in env.name",
                "set env.name, or remove env.options",
            )


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts: greedy accuracy, mean reward and pass@k."""

    interval: int = 0
    """Evaluate every k steps on held-out prompts; 0 disables."""
    num_samples: int = 4
    """Samples per prompt for pass@k (k <= num_samples)."""
    temperature: float = 1.0
    """Sampling temperature of the pass@k samples (greedy accuracy uses 0)."""
    correct_reward: float = 1.0
    """A held-out response counts as correct (greedy accuracy, pass@k) when its reward reaches
    this value (1.0 is a full score for the built-in tasks and the math reward)."""

    def __post_init__(self) -> None:
        _check_positive("eval.interval", self.interval, allow_zero=True)
        _check_positive("eval.num_samples", self.num_samples)


@dataclass
class CheckpointConfig:
    """Megatron distributed checkpoints in output_dir/checkpoints (atomic, resumable at any
    layout)."""

    interval: int = 0
    """Save a Megatron distributed checkpoint every k steps (and at the end); 0 disables."""
    keep_last: int = 2
    """Checkpoints kept in output_dir/checkpoints; older ones are deleted after a save."""
    load_path: Optional[str] = None
    """Initialise from this Megatron checkpoint (weights only) instead of model.hf_path/seed."""

    def __post_init__(self) -> None:
        _check_positive("checkpoint.interval", self.interval, allow_zero=True)
        _check_positive("checkpoint.keep_last", self.keep_last)


@dataclass
class LoggingConfig:
    """Where metrics and messages go. metrics.jsonl is always written (driver only)."""

    tensorboard: bool = True
    """Write TensorBoard events to output_dir/tensorboard."""
    wandb: bool = False
    """Log to Weights & Biases as well (pip install wandb)."""
    wandb_project: str = "megatron_gspo"
    """W&B project of the run."""
    progress_bar: bool = True
    """A progress bar with reward, clip fraction, KL and step time (driver only)."""
    log_level: str = "INFO"
    """Python logging level of the driver (other ranks log warnings only). DEBUG also shows
    Megatron-Core's own INFO messages and its notices about missing kernel libraries."""


@dataclass
class TrainConfig:
    """Root of the tree: ``python -m megatron_gspo.train`` with no arguments runs these defaults,
    the CPU demo (a tiny MoE that learns to repeat 8 random digits: a 20-step supervised cold
    start, then GSPO)."""

    output_dir: str = "outputs/cpu_demo"
    """Where metrics.jsonl, tensorboard/, checkpoints/ and rollout files go (created if missing)."""
    steps: int = 40
    """RL steps (rollout + updates) to run."""
    seed: int = 1234
    """Seeds the initial weights, the prompt order, the mini-batch splits and (unless rollout.seed
    is set) sampling: the same seed and configuration give the same run."""
    resume: bool = False
    """Continue from the latest complete checkpoint in output_dir/checkpoints."""
    overwrite_output_dir: bool = False
    """A fresh run (resume=false) refuses an output_dir that holds another run's metrics or
    checkpoints; true deletes them (metrics.jsonl, tensorboard/, checkpoints/) before starting."""
    sft_warmup_steps: int = 20
    """Supervised cold start before RL: this many optimizer steps of maximum likelihood on the
    data's reference answers (rollout_batch_size prompts each). The GSPO paper also starts RL from
    a cold-start fine-tuned model (section 5.1). Needs answers in the data. The default is the CPU
    demo's (20 steps take the tiny model from reward 0.1 to about 0.3, GSPO does the rest); set 0
    for a model that is already fine-tuned."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def requests_rollout_routes(self) -> bool:
        """Whether rollouts return the engine's routes: for R3, which replays them, and for the
        trainer-vs-engine routing metrics (``routing_change_frac_vs_rollout``,
        ``routing_mismatch_vs_rollout``) with ``algo.log_routing_change`` on an embedded engine
        (SGLang servers return routes only when started with --enable-return-routed-experts,
        which R3 asks for)."""
        if not self.model.is_moe:
            return False
        if self.algo.routing_replay == "r3":
            return True
        return self.algo.log_routing_change and self.rollout.engine != "sglang"

    def __post_init__(self) -> None:
        _check_positive("steps", self.steps)
        _check_positive("sft_warmup_steps", self.sft_warmup_steps, allow_zero=True)
        algo, parallel, model = self.algo, self.parallel, self.model
        if algo.samples_per_step % algo.num_mini_batches:
            raise ConfigError(
                "algo.num_mini_batches",
                f"{algo.samples_per_step} samples per step (rollout_batch_size x "
                f"num_return_sequences_in_group) do not split into {algo.num_mini_batches} "
                "equal mini-batches",
                "every optimizer step must see the same number of samples",
                "choose num_mini_batches among the divisors of the samples per step",
            )
        if algo.old_log_prob_source == "detach" and algo.num_mini_batches * algo.ppo_epochs > 1:
            _warn(
                "algo.old_log_prob_source",
                "detach uses the current policy as the old one, so after the first optimizer step "
                "of a rollout batch the ratio is no longer against the sampling policy; use "
                "recompute or rollout with several mini-batches or epochs",
            )
        if model.is_moe:
            if model.num_experts % parallel.ep:
                raise ConfigError(
                    "parallel.ep",
                    f"ep={parallel.ep} does not divide num_experts={model.num_experts}",
                    "each expert-parallel rank holds num_experts/ep whole experts",
                    "choose ep among the divisors of model.num_experts",
                )
        elif parallel.ep > 1:
            raise ConfigError(
                "parallel.ep",
                f"ep={parallel.ep} with the dense architecture {model.architecture!r}",
                "a dense model has no experts to distribute",
                "set parallel.ep=1",
            )
        if model.num_query_groups % parallel.tp:
            raise ConfigError(
                "parallel.tp",
                f"tp={parallel.tp} does not divide num_query_groups={model.num_query_groups}",
                "tensor parallel splits key/value heads into whole groups per rank",
                "choose tp among the divisors of model.num_query_groups",
            )
        layers_per_chunk = parallel.pp * (parallel.vpp or 1)
        if model.num_layers % layers_per_chunk:
            raise ConfigError(
                "parallel.pp",
                f"num_layers={model.num_layers} is not divisible by pp*vpp={layers_per_chunk}",
                "every pipeline chunk holds the same number of layers",
                "change parallel.pp / parallel.vpp or model.num_layers",
            )
        if not self.reward.functions and self.env.name is None:
            raise ConfigError(
                "reward.functions",
                "no reward function",
                "every sample needs a score (only an environment can give it without one)",
                "set reward.functions, e.g. [math] or [my_pkg.rewards:score]",
            )
        if algo.advantage_level == "turn" and self.env.name is None:
            raise ConfigError(
                "algo.advantage_level",
                "per-turn advantages without an environment",
                "turns and their rewards come from an environment's episodes",
                "set env.name, or algo.advantage_level=sequence",
            )
        if self.reward.overlong_buffer > algo.response_length:
            raise ConfigError(
                "reward.overlong_buffer",
                f"{self.reward.overlong_buffer} > algo.response_length={algo.response_length}",
                "the penalty grows over the last overlong_buffer tokens before the length limit",
                "set reward.overlong_buffer <= algo.response_length (0 disables it)",
            )
        if algo.routing_replay != "none" and not model.is_moe:
            raise ConfigError(
                "algo.routing_replay",
                f"routing replay {algo.routing_replay!r} on the dense {model.architecture!r}",
                "routing replay fixes the expert choice of MoE layers",
                "set algo.routing_replay=none",
            )
        if self.data.train_path is not None and "synthetic" in self.reward.functions:
            _warn(
                "reward.functions",
                f"the synthetic digit reward (the CPU demo's) scores your prompt file "
                f"{self.data.train_path}: it compares response tokens with answer digits, which "
                "means nothing for other data; set reward.functions to a reward for your task, "
                "e.g. [math], [exact_match] or [my_package.rewards:score]",
            )
        if algo.routing_replay == "r3" and self.rollout.engine == "sglang":
            _warn(
                "algo.routing_replay",
                "r3 with SGLang needs servers started with --enable-return-routed-experts and no "
                "router that drops return_routed_experts (sglang-router 0.3.2 does)",
            )


# --------------------------------------------------------------------------------------------
# Building the tree from plain data
# --------------------------------------------------------------------------------------------


def _suggest(name: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from nested plain data, rejecting unknown keys with a suggestion.

    Values are validated by each dataclass's ``__post_init__``.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>",
            f"expected a mapping, got {type(data).__name__}",
            f"'{prefix}' is a section of the config",
            f"write '{prefix}' as key: value pairs",
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full_key = f"{prefix}{key}"
        if key not in fields:
            valid = sorted(fields)
            raise ConfigError(
                full_key,
                f"unknown key '{key}' in {cls.__name__}",
                f"{cls.__name__} has no such field, and unknown keys are never ignored",
                f"{_suggest(key, valid)}valid keys are: {', '.join(valid)}",
            )
        field_type = fields[key].type
        sub_cls = _dataclass_of(field_type)
        if sub_cls is not None:
            kwargs[key] = from_dict(sub_cls, value, prefix=f"{full_key}.")
        else:
            kwargs[key] = _checked_value(full_key, value, hints[key])
    return cls(**kwargs)


def _checked_value(key: str, value: Any, annotation: Any) -> Any:
    """``value`` if it has the declared type (ints are accepted for floats), else a ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _checked_value(key, value, annotation)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _type_error(key, value, annotation)
        return [_checked_value(f"{key}[{i}]", item, args[0]) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _type_error(key, value, annotation)
        return {
            _checked_value(f"{key}.<key>", name, args[0]): _checked_value(
                f"{key}.{name}", item, args[1]
            )
            for name, item in value.items()
        }
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is Any or (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        return value
    _type_error(key, value, annotation)


def _type_error(key: str, value: Any, annotation: Any) -> None:
    name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(
        key,
        f"{value!r} ({type(value).__name__}) is not a {name}",
        "the schema declares the type of every field",
        f"give {key} a {name} value",
    )


def _dataclass_of(type_name: Any) -> Optional[type]:
    """The dataclass a field holds, resolving the string annotations of this module."""
    if isinstance(type_name, str):
        type_name = globals().get(type_name)
    return type_name if dataclasses.is_dataclass(type_name) else None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested data of a config (for logging, checkpoints and subprocess overrides)."""
    return dataclasses.asdict(config)
