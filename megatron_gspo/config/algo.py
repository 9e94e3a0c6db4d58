"""The configuration of the algorithm (``algo.*``: advantages, the policy loss, KL, rollout
corrections, routing replay); part of the one configuration tree, :mod:`megatron_gspo.config`,
whose rules hold here: every default lives here once, with its source.

The name lists and the rules that the algorithm core's settings obey are written once, in
:mod:`megatron_gspo.config.loss_rules`; this module checks its keys with them (a broken rule
becomes a :class:`ConfigError` at the key) and says which settings values its keys make
(:meth:`AlgoConfig.policy_loss_fields`, :meth:`AlgoConfig.advantage_fields`,
:meth:`RolloutCorrectionConfig.fields`). :mod:`megatron_gspo.algo.settings` builds the settings
from those values: the configuration never imports the algorithm core (nor torch).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_gspo.config import loss_rules
from megatron_gspo.config.distillation import DistillationConfig
from megatron_gspo.config.loss_rules import (
    SettingsError,
    check_advantages,
    check_correction,
    check_policy_loss,
)
from megatron_gspo.config.schema import ConfigError, check_choice, check_positive, warn_config

# --------------------------------------------------------------------------------------------
# Algorithm
# --------------------------------------------------------------------------------------------

OLD_LOG_PROB_SOURCES = ("recompute", "rollout", "detach")
ROUTING_REPLAY_MODES = ("none", "r2", "r3")
ROUTING_REPLAY_WEIGHTS = ("recompute", "replayed")
ADVANTAGE_LEVELS = ("sequence", "turn")

CORRECTION_LEVELS = ("none", *loss_rules.CORRECTION_LEVELS)
"""``algo.rollout_correction.level``: none (off) or a level of the algorithm core."""
CORRECTION_MODES = loss_rules.CORRECTION_MODES
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

ALGO_KEYS = {
    "dual_clip": "dual_clip_loss",
    "kl_coef": "kl_loss_coef",
    "norm_length": "response_length",
    "cispo_weight_bounds": "cispo.weight_low/high",
    "gmpo_log_clip": "gmpo.log_clip",
    "rollout_correction": "rollout_correction.level",
    "estimator": "adv_estimator",
    "per_turn": "advantage_level",
    "token_level_kl": "add_token_level_kl",
}
"""The ``algo.*`` key of each subject of the loss rules whose key is not ``algo.<subject>``."""


def algo_key(subject: str) -> str:
    """The configuration key of a loss rule's subject (:mod:`~megatron_gspo.config.loss_rules`)."""
    return "algo." + ALGO_KEYS.get(subject, subject)


def correction_key(subject: str) -> str:
    """The configuration key of a correction rule's subject."""
    return "algo.rollout_correction." + ("low/high" if subject == "bounds" else subject)


@contextmanager
def reported_at_config_keys() -> Iterator[None]:
    """Re-raise a broken loss rule as the configuration's error, at the same key."""
    try:
        yield
    except SettingsError as error:
        raise ConfigError(error.key, error.what, error.why, error.fix) from None


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
        check_choice(f"{key}.level", self.level, CORRECTION_LEVELS, "none, token or sequence")
        check_choice(f"{key}.mode", self.mode, CORRECTION_MODES, "truncate or mask")
        fields = self.fields()
        if fields is not None:
            with reported_at_config_keys():
                check_correction(**fields, name=correction_key)

    @property
    def enabled(self) -> bool:
        return self.level != "none"

    @property
    def bounds(self) -> tuple[Optional[float], float]:
        """``(low, high)`` with the defaults of :data:`CORRECTION_BOUNDS` filled in."""
        default_low, default_high = CORRECTION_BOUNDS[(self.level, self.mode)]
        low = self.low if self.low is not None else default_low
        return low, (self.high if self.high is not None else default_high)

    def fields(self) -> Optional[dict[str, Any]]:
        """The fields of the algorithm core's ``RolloutCorrection`` that this section makes
        (its bounds filled in), or None when the correction is off."""
        if not self.enabled:
            return None
        low, high = self.bounds
        return {"level": self.level, "mode": self.mode, "low": low, "high": high}


@dataclass
class CispoConfig:
    """CISPO's knobs (``algo.surrogate=cispo``; MiniMax-M1, arXiv 2506.13585)."""

    weight_low: float = 0.0
    """CISPO's weight is clip(r, weight_low, weight_high); 0 is MiniMax-M1's choice of no lower
    bound (they tune the upper one only, section 3.1)."""
    weight_high: float = 5.0
    """Upper bound of CISPO's weight: ScaleRL's eps_max (arXiv 2510.13786), the value TRL
    recommends for its loss_type=cispo."""


@dataclass
class GmpoConfig:
    """GMPO's knobs (``algo.surrogate=gmpo``; arXiv 2507.20673)."""

    log_clip: float = 0.4
    """GMPO clips token log ratios at +-log_clip (on the side that binds for the advantage's
    sign): the paper's range (e^-0.4, e^0.4), its scripts' CLIPRANGE=0.4."""


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
    routing_replay_weights: str = "recompute"
    """What a replayed route keeps of the recorded routing: recompute (replay the expert ids and
    take their weights from the router being trained, so the router keeps its gradient:
    Megatron's RouterReplay, verl and slime) or replayed (replay the ids and the combine weights
    recorded with them, constants: the MoE layers compute exactly what the recorded forward
    computed where the rest of the model agrees, and the router gets no gradient from the
    policy loss). With r2 the weights are those the old-log-prob forward recorded; with r3 those
    the rollout engine's routers gave (the engine's routing exactly, in the old-log-prob and
    training forwards): only rollout.engine=embedded reports them (SGLang's
    return_routed_experts returns expert ids only). Logged as routing_replay_weights_replayed
    (1 or 0) on every replayed step."""
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
    cispo: CispoConfig = field(default_factory=CispoConfig)
    """The bounds of CISPO's weight (surrogate=cispo)."""
    gmpo: GmpoConfig = field(default_factory=GmpoConfig)
    """GMPO's log-ratio clip (surrogate=gmpo)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights between the old policy and the rollout engine's log-probs
    (level none|token|sequence, mode truncate|mask, low, high)."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a teacher model (mode off|pure|added, kl_coef, teacher;
    docs/distillation.md)."""

    def __post_init__(self) -> None:
        # The rules of the algorithm core's settings first, on the values these keys make.
        with reported_at_config_keys():
            check_policy_loss(
                **self.policy_loss_fields(),
                correction_level=self.rollout_correction.level
                if self.rollout_correction.enabled
                else None,
                name=algo_key,
            )
            check_advantages(**self.advantage_fields(), name=algo_key)
        # Then what only the configuration knows: its other keys, and rules across the loss,
        # the advantages and the rest of the run.
        check_choice(
            "algo.old_log_prob_source",
            self.old_log_prob_source,
            OLD_LOG_PROB_SOURCES,
            "old log-probs are recomputed, taken from the rollout, or the current ones detached",
        )
        check_choice(
            "algo.routing_replay",
            self.routing_replay,
            ROUTING_REPLAY_MODES,
            "none, r2 (training-engine routes) or r3 (rollout-engine routes)",
        )
        check_choice(
            "algo.routing_replay_weights",
            self.routing_replay_weights,
            ROUTING_REPLAY_WEIGHTS,
            "a replayed route's weights are recomputed from the current router or replayed",
        )
        if self.routing_replay_weights == "replayed" and self.routing_replay == "none":
            raise ConfigError(
                "algo.routing_replay_weights",
                "replayed with routing_replay='none'",
                "weights are replayed with replayed routes: R2's (recorded by the training "
                "engine's old-log-prob forward) or R3's (reported by the embedded engine)",
                "set algo.routing_replay=r2 or r3, or algo.routing_replay_weights=recompute",
            )
        check_choice(
            "algo.advantage_level",
            self.advantage_level,
            ADVANTAGE_LEVELS,
            "advantages are per sample or per model turn",
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
            check_positive(f"algo.{name}", getattr(self, name))
        # Checked also while their feature is off, which the settings values above leave out.
        for name in ("kl_loss_coef", "token_level_kl_coef"):
            check_positive(f"algo.{name}", getattr(self, name), allow_zero=True)
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
        if self.advantage_level == "turn" and self.importance_sampling == "seq":
            raise ConfigError(
                "algo.advantage_level",
                "per-turn advantages with GSPO's sequence ratio (importance_sampling=seq)",
                "GSPO's loss weighs every token of a sequence by one ratio, so per-token "
                "advantages average out to their mean; GSPO-token keeps them apart (GSPO "
                "paper, eq. 13-14)",
                "set algo.importance_sampling=seq_token (GSPO-token) or token",
            )
        if self.dynamic_sampling and self.num_return_sequences_in_group < 2:
            raise ConfigError(
                "algo.dynamic_sampling",
                "dynamic sampling with one response per prompt",
                "a group of one has advantage 0 whatever its reward, so every group would be "
                "dropped",
                "set algo.num_return_sequences_in_group >= 2 or algo.dynamic_sampling=false",
            )
        self._check_distillation()
        if self.surrogate == "gmpo" and self.add_token_level_kl:
            raise ConfigError(
                "algo.add_token_level_kl",
                "KL-in-reward (per-token advantages) with surrogate='gmpo'",
                "GMPO multiplies one sequence ratio by one sequence advantage",
                "set algo.add_token_level_kl=false, or use surrogate=clip",
            )
        correction = self.rollout_correction
        if correction.enabled and self.old_log_prob_source == "rollout":
            raise ConfigError(
                "algo.rollout_correction.level",
                f"a {correction.level}-level correction with old_log_prob_source=rollout",
                "the correction weighs pi_old / mu, and with rollout log-probs as the old "
                "policy pi_old = mu: every weight would be 1",
                "use algo.old_log_prob_source=recompute (or detach), or "
                "algo.rollout_correction.level=none",
            )
        self._warn_gspo_settings()

    def _check_distillation(self) -> None:
        distillation = self.distillation
        if not distillation.enabled:
            return
        if self.old_log_prob_source == "detach":
            raise ConfigError(
                "algo.distillation.mode",
                f"distillation ({distillation.mode}) with old_log_prob_source='detach'",
                "the reverse KL log pi_student - log pi_teacher needs the student's log-probs of "
                "the sampled tokens before the update, which 'detach' does not compute",
                "use algo.old_log_prob_source=recompute or rollout",
            )
        if self.surrogate == "gmpo":
            raise ConfigError(
                "algo.distillation.mode",
                "distillation with surrogate='gmpo'",
                "GMPO multiplies one sequence ratio by one sequence advantage; the teacher's "
                "signal is per token",
                "use surrogate=clip (with importance_sampling=seq_token or token)",
            )

    def _warn_gspo_settings(self) -> None:
        if self.importance_sampling == "token":
            return
        if max(self.clip_low, self.clip_high) > 0.05:
            warn_config(
                "algo.clip_low/clip_high",
                f"GSPO with a token-sized clip range ({self.clip_low}, {self.clip_high}): the "
                "sequence ratio is a geometric mean of token ratios and stays close to 1, so a "
                "range above 0.05 almost never clips and the trust region is lost. The GSPO paper "
                "uses 3e-4 / 4e-4 (section 5.1).",
            )
        if self.loss_agg_mode in ("token-mean", "seq-mean-token-sum"):
            warn_config(
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

    # The values of the algorithm core's settings that these keys make, written once: checked
    # above by the loss rules, built into the settings by megatron_gspo.algo.settings.

    def policy_loss_fields(self) -> dict[str, Any]:
        """The fields of ``PolicyLossSettings`` (all but its rollout correction, which is
        :meth:`RolloutCorrectionConfig.fields`) for this configuration; switched-off features
        get the settings' "off" values."""
        return {
            "importance_sampling": self.importance_sampling,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "loss_agg_mode": self.loss_agg_mode,
            "dual_clip_constant": self.dual_clip_constant if self.dual_clip_loss else None,
            "kl_coef": self.kl_loss_coef if self.use_kl_loss else 0.0,
            "kl_estimator": self.kl_estimator,
            "kl_clamp": self.kl_clamp,
            "entropy_coef": self.entropy_coef,
            "norm_length": self.response_length,
            "log_ratio_clamp": self.log_ratio_clamp,
            "surrogate": self.surrogate,
            "cispo_weight_bounds": (self.cispo.weight_low, self.cispo.weight_high)
            if self.surrogate == "cispo"
            else None,
            "gmpo_log_clip": self.gmpo.log_clip if self.surrogate == "gmpo" else None,
        }

    def advantage_fields(self) -> dict[str, Any]:
        """The fields of ``AdvantageSettings`` for this configuration."""
        return {
            "estimator": self.adv_estimator,
            "reward_norm": self.reward_norm,
            "reward_shift": self.reward_shift,
            "reward_scale": self.reward_scale,
            "reward_clip": self.reward_clip,
            "std_unbiased": self.std_unbiased,
            "std_eps": self.std_eps,
            "reinforce_baseline": self.reinforce_baseline,
            "per_turn": self.advantage_level == "turn",
            "token_level_kl_coef": self.token_level_kl_coef if self.add_token_level_kl else None,
            "token_level_kl_estimator": self.token_level_kl_estimator,
            "kl_clamp": self.kl_clamp,
            "whiten": self.whiten_advantages,
            "advantage_clip": self.advantage_clip,
        }
