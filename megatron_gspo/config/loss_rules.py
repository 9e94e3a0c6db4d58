"""The algorithm core's name lists and validity rules, written once and torch-free.

Two sides use them. The configuration checks ``algo.*`` with them at start and reports a broken
rule as a :class:`~megatron_gspo.config.ConfigError` at the key
(:class:`~megatron_gspo.config.AlgoConfig`); the algorithm core's settings objects
(``PolicyLossSettings``, ``RolloutCorrection``, ``AdvantageSettings`` in
:mod:`megatron_gspo.algo`) check themselves with them when they are built and raise the
:class:`SettingsError` (a ``ValueError``). So a setting the configuration accepts is one the loss
accepts, and the other way round.

The rules speak the settings' vocabulary: their arguments are the settings' fields. Each broken
rule names its *subject*, rendered by the caller's ``name`` function: the configuration names
``algo.dual_clip_loss`` where the settings name ``dual_clip_constant``. The subjects that are not
a field of the settings are in :data:`SETTINGS_NAMES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

IMPORTANCE_SAMPLING = ("seq", "seq_token", "token")
"""Ratio functions: GSPO's sequence ratio, GSPO-token, the token ratio of GRPO/PPO."""
SURROGATES = ("clip", "cispo", "gmpo")
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "dr-grpo",
)
KL_ESTIMATORS = ("k1", "k2", "k3")
CORRECTION_LEVELS = ("token", "sequence")
"""Levels of a rollout correction that is on (the configuration adds ``none``: off)."""
CORRECTION_MODES = ("truncate", "mask")
ADV_ESTIMATORS = ("grpo", "dr_grpo", "reinforce", "rloo")
REWARD_NORM_SCOPES = ("batch", "group", "running")
REINFORCE_BASELINES = ("none", "group", "batch")

SETTINGS_NAMES = {
    "dual_clip": "dual_clip_constant",
    "token_level_kl": "token_level_kl_coef",
    "bounds": "low/high",
}
"""Subjects of rules that are not themselves a field of the settings: a feature being on
(``dual_clip``: dual clip, ``token_level_kl``: KL-in-reward) or a pair of fields (``bounds``)."""

KL_WHY = "the KL estimators are Schulman's k1, k2 and k3"

Names = Callable[[str], str]
"""How a caller names a rule's subject (a settings field, or one of :data:`SETTINGS_NAMES`)."""


def settings_name(subject: str) -> str:
    """The settings' own name of ``subject``: the default ``name`` of the checks."""
    return SETTINGS_NAMES.get(subject, subject)


class SettingsError(ValueError):
    """A broken rule: what is wrong with which setting (``key``), why it matters, how to fix it.
    The configuration re-raises it as a ``ConfigError`` at the same key."""

    def __init__(self, key: str, what: str, why: str, fix: str):
        self.key, self.what, self.why, self.fix = key, what, why, fix
        super().__init__(f"invalid '{key}': {what}\n  why: {why}\n  fix: {fix}")


def _choice(key: str, value: Any, choices: Sequence[Any], why: str) -> None:
    if value not in choices:
        raise SettingsError(
            key,
            f"{value!r} is not one of {list(choices)}",
            why,
            f"set {key} to one of {', '.join(repr(choice) for choice in choices)}",
        )


def _positive(key: str, value: Optional[float], *, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise SettingsError(
            key, f"{value!r} is not {bound}", "it is a size or a weight", f"set {key} {bound}"
        )


# --------------------------------------------------------------------------------------------
# Policy loss
# --------------------------------------------------------------------------------------------


def check_policy_loss(
    *,
    importance_sampling: str,
    clip_low: float,
    clip_high: float,
    loss_agg_mode: str,
    dual_clip_constant: Optional[float],
    kl_coef: float,
    kl_estimator: str,
    kl_clamp: Optional[float],
    entropy_coef: float,
    norm_length: Optional[float],
    log_ratio_clamp: float,
    surrogate: str,
    cispo_weight_bounds: Optional[tuple[float, float]],
    gmpo_log_clip: Optional[float],
    correction_level: Optional[str],
    name: Names = settings_name,
) -> None:
    """Raise :class:`SettingsError` unless the fields of a ``PolicyLossSettings`` go together
    (``correction_level``: the level of its rollout correction, None when off)."""
    _choice(
        name("importance_sampling"),
        importance_sampling,
        IMPORTANCE_SAMPLING,
        "seq is GSPO, seq_token GSPO-token, token GRPO/PPO",
    )
    _choice(
        name("loss_agg_mode"),
        loss_agg_mode,
        LOSS_AGG_MODES,
        "these are ROLL's four modes (with ROLL's meanings) and TRL's dr_grpo",
    )
    _choice(name("kl_estimator"), kl_estimator, KL_ESTIMATORS, KL_WHY)
    _choice(name("surrogate"), surrogate, SURROGATES, "clip (PPO / GRPO / GSPO), cispo or gmpo")
    for subject, value in (("clip_low", clip_low), ("clip_high", clip_high)):
        if not 0 < value < 1:
            raise SettingsError(
                name(subject),
                f"{value!r} is outside (0, 1)",
                "the ratio is clipped to [1 - clip_low, 1 + clip_high]; 0 freezes it and "
                ">= 1 allows a zero ratio",
                "use 3e-4 / 4e-4 for GSPO (paper section 5.1) or 0.2 / 0.27 for GRPO",
            )
    if dual_clip_constant is not None and dual_clip_constant <= 1 + clip_high:
        raise SettingsError(
            name("dual_clip_constant"),
            f"{dual_clip_constant} <= 1 + clip_high = {1 + clip_high}",
            "the dual clip caps the loss of negative-advantage tokens at -c*A; with "
            "c <= 1 + clip_high it overrides the ordinary clip",
            f"set {name('dual_clip_constant')} > 1 + clip_high (3.0 is the usual value)",
        )
    _positive(name("kl_coef"), kl_coef, allow_zero=True)
    _positive(name("entropy_coef"), entropy_coef, allow_zero=True)
    _positive(name("log_ratio_clamp"), log_ratio_clamp)
    if kl_clamp is not None:
        _positive(name("kl_clamp"), kl_clamp)
    if norm_length is not None:
        _positive(name("norm_length"), norm_length)
    _check_surrogate(
        importance_sampling=importance_sampling,
        loss_agg_mode=loss_agg_mode,
        dual_clip_constant=dual_clip_constant,
        surrogate=surrogate,
        cispo_weight_bounds=cispo_weight_bounds,
        gmpo_log_clip=gmpo_log_clip,
        correction_level=correction_level,
        name=name,
    )


def _check_surrogate(
    *,
    importance_sampling: str,
    loss_agg_mode: str,
    dual_clip_constant: Optional[float],
    surrogate: str,
    cispo_weight_bounds: Optional[tuple[float, float]],
    gmpo_log_clip: Optional[float],
    correction_level: Optional[str],
    name: Names,
) -> None:
    if surrogate != "clip":
        if importance_sampling != "token":
            raise SettingsError(
                name("importance_sampling"),
                f"importance_sampling={importance_sampling!r} with surrogate={surrogate!r}",
                f"{surrogate} is built on token ratios (GMPO takes their geometric mean "
                "itself); the sequence ratios of GSPO are for the clipped surrogate",
                f"set {name('importance_sampling')}=token",
            )
        if dual_clip_constant is not None:
            raise SettingsError(
                name("dual_clip"),
                f"dual clip with surrogate={surrogate!r}",
                "dual clip bounds PPO's clipped surrogate for negative advantages; "
                f"{surrogate} has its own clipping",
                f"switch dual clip off ({name('dual_clip')})",
            )
    if surrogate == "cispo":
        if cispo_weight_bounds is None:
            raise SettingsError(
                name("cispo_weight_bounds"),
                "surrogate='cispo' without the bounds of its weight",
                "CISPO's detached weight is clip(r, w_low, w_high)",
                f"set {name('cispo_weight_bounds')}",
            )
        low, high = cispo_weight_bounds
        if not 0 <= low <= 1 <= high:
            raise SettingsError(
                name("cispo_weight_bounds"),
                f"[{low}, {high}] does not contain 1",
                "CISPO clips the importance weight; an on-policy token (ratio 1) must keep "
                "weight 1",
                f"set 0 <= low <= 1 <= high ({name('cispo_weight_bounds')}; default 0 and 5)",
            )
    if surrogate == "gmpo":
        if gmpo_log_clip is None:
            raise SettingsError(
                name("gmpo_log_clip"),
                "surrogate='gmpo' without its log-ratio clip",
                "GMPO clips the token log ratios at +-eps",
                f"set {name('gmpo_log_clip')} (the paper uses 0.4)",
            )
        _positive(name("gmpo_log_clip"), gmpo_log_clip)
        if loss_agg_mode != "seq-mean-token-mean":
            raise SettingsError(
                name("loss_agg_mode"),
                f"loss_agg_mode={loss_agg_mode!r} with surrogate='gmpo'",
                "GMPO's objective is one term per sequence averaged over sequences",
                f"set {name('loss_agg_mode')}=seq-mean-token-mean",
            )
        if correction_level == "token":
            raise SettingsError(
                name("rollout_correction"),
                "a token-level correction with surrogate='gmpo'",
                "GMPO's loss has one term per sequence, which a per-token weight cannot scale",
                f"use a sequence-level correction ({name('rollout_correction')})",
            )


# --------------------------------------------------------------------------------------------
# Rollout correction
# --------------------------------------------------------------------------------------------


def check_correction(
    *,
    level: str,
    mode: str,
    low: Optional[float],
    high: float,
    name: Names = settings_name,
) -> None:
    """Raise :class:`SettingsError` unless the fields of a ``RolloutCorrection`` (a correction
    that is on, its bounds filled in) go together."""
    _choice(name("level"), level, CORRECTION_LEVELS, "a correction weighs tokens or sequences")
    _choice(name("mode"), mode, CORRECTION_MODES, "truncate or mask")
    if mode == "truncate":
        if low is not None:
            raise SettingsError(
                name("low"),
                f"low={low} with mode=truncate",
                "truncation caps the weight from above only (TIS: min(ratio, high))",
                f"remove {name('low')}, or use mode=mask to drop tokens below it",
            )
        if not high >= 1:
            raise SettingsError(
                name("high"),
                f"high={high} < 1 with mode=truncate",
                "a cap below 1 shrinks every on-policy token's weight",
                "set high >= 1 (TIS uses 2)",
            )
    elif low is None or not 0 <= low < 1 < high:
        raise SettingsError(
            name("bounds"),
            f"[low, high] = [{low}, {high}] does not contain 1 strictly inside",
            "a token whose engine and trainer agree (ratio 1) must be kept",
            "set 0 <= low < 1 < high (IcePop uses [0.5, 5], verl's Geo-RS [0.999, 1.001])",
        )


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def check_advantages(
    *,
    estimator: str,
    reward_norm: Optional[str],
    reward_shift: bool,
    reward_scale: bool,
    reward_clip: Optional[float],
    std_unbiased: bool,
    std_eps: float,
    reinforce_baseline: str,
    per_turn: bool,
    token_level_kl_coef: Optional[float],
    token_level_kl_estimator: str,
    kl_clamp: Optional[float],
    whiten: bool,
    advantage_clip: Optional[float],
    name: Names = settings_name,
) -> None:
    """Raise :class:`SettingsError` unless the fields of an ``AdvantageSettings`` go together.
    (``std_unbiased`` and ``whiten`` take any value; they are arguments so that every field of
    the settings comes through here.)"""
    _choice(name("estimator"), estimator, ADV_ESTIMATORS, "these are the estimators")
    _choice(
        name("reward_norm"),
        reward_norm,
        (None, *REWARD_NORM_SCOPES),
        "reward statistics come from the batch, the group, or a running estimate",
    )
    _choice(
        name("reinforce_baseline"),
        reinforce_baseline,
        REINFORCE_BASELINES,
        "REINFORCE subtracts no baseline, the group mean or the batch mean",
    )
    _choice(name("token_level_kl_estimator"), token_level_kl_estimator, KL_ESTIMATORS, KL_WHY)
    for subject, value in (("advantage_clip", advantage_clip), ("reward_clip", reward_clip)):
        if value is not None and value <= 0:
            raise SettingsError(
                name(subject),
                f"{value!r} is not > 0",
                "it is a symmetric clamp bound",
                f"switch {name(subject)} off (null) or give it a positive bound",
            )
    if reward_shift and reward_scale:
        raise SettingsError(
            name("reward_shift"),
            "reward_shift and reward_scale are both true",
            "reward_shift means subtract the mean only, reward_scale divide by the std only",
            "set one of them, or neither for full (r - mean) / std normalisation",
        )
    if (reward_shift or reward_scale) and reward_norm is None:
        raise SettingsError(
            name("reward_norm"),
            "reward_shift/reward_scale is set but reward_norm is null",
            "shift and scale choose how rewards are normalised, reward_norm the statistics",
            f"set {name('reward_norm')} to batch, group or running",
        )
    _positive(name("std_eps"), std_eps, allow_zero=True)
    if token_level_kl_coef is not None:
        _positive(name("token_level_kl_coef"), token_level_kl_coef, allow_zero=True)
    if kl_clamp is not None:
        _positive(name("kl_clamp"), kl_clamp)
    if per_turn:
        for subject, value in (("reward_norm", reward_norm), ("reward_clip", reward_clip)):
            if value is not None:
                raise SettingsError(
                    name(subject),
                    f"{subject} with per-turn advantages",
                    "reward normalisation and clipping act on one reward per sample; "
                    "per-turn advantages start from the turns' rewards",
                    f"switch {name(subject)} off (null), or use per-sequence advantages "
                    f"({name('per_turn')})",
                )
        if token_level_kl_coef is not None:
            raise SettingsError(
                name("token_level_kl"),
                "KL-in-reward with per-turn advantages",
                "both make per-token advantages, in different ways; combining them is not "
                "defined here",
                f"switch off one of {name('token_level_kl')} and {name('per_turn')}",
            )
