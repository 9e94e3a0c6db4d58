"""The config tree: presets load, unknown keys and bad values fail with actionable errors."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatron_gspo.config import (
    AlgoConfig,
    ConfigError,
    ConfigWarning,
    ParallelConfig,
    TrainConfig,
    from_dict,
)
from megatron_gspo.config.loader import EXAMPLES_DIR, load_config

PRESETS = sorted(EXAMPLES_DIR.glob("*.yaml"))


def write_preset(tmp_path, body: str):
    path = tmp_path / "preset.yaml"
    path.write_text("defaults:\n  - megatron_gspo\n  - _self_\n\n" + body)
    return str(path)


def load_quietly(preset=None, overrides=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        return load_config(preset, overrides)


def test_presets_exist():
    assert PRESETS, f"no presets in {EXAMPLES_DIR}"


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_preset_loads(path):
    by_name = load_quietly(path.stem)
    by_path = load_quietly(str(path))
    assert isinstance(by_name, TrainConfig)
    assert by_name == by_path


def test_no_preset_is_the_dataclass_defaults():
    assert load_quietly() == TrainConfig()


def test_overrides_apply_on_top_of_a_preset():
    config = load_quietly(
        PRESETS[0].stem,
        ["algo.clip_low=3e-4", "parallel.tp=2", "reward.functions=[math,format]", "steps=3"],
    )
    assert config.algo.clip_low == 3e-4
    assert config.parallel.tp == 2
    assert config.reward.functions == ["math", "format"]
    assert config.steps == 3


def assert_config_error(error: ConfigError, key: str, *fragments: str):
    message = str(error)
    assert error.key == key, message
    assert f"'{key}'" in message and "why:" in message and "fix:" in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"


@pytest.mark.parametrize(
    "overrides,key,suggestion",
    [
        (["stpes=3"], "stpes", "'steps'"),
        (["+stpes=3"], "stpes", "'steps'"),
        (["algo.clip_lowx=0.1"], "algo.clip_lowx", "'clip_low'"),
        (["+algo.clip_hihg=0.1"], "algo.clip_hihg", "'clip_high'"),
        (["algox.clip_low=0.1"], "algox", "'algo'"),
        (["parallel.tensor_parallel=2"], "parallel.tensor_parallel", "valid keys"),
    ],
)
def test_unknown_key_in_override(overrides, key, suggestion):
    with pytest.raises(ConfigError) as error:
        load_quietly(None, overrides)
    assert_config_error(error.value, key, suggestion)


@pytest.mark.parametrize(
    "body,key,suggestion",
    [
        ("stpes: 3\n", "stpes", "'steps'"),
        ("algo:\n  clip_hihg: 0.1\n", "algo.clip_hihg", "'clip_high'"),
        ("model:\n  num_expert: 4\n", "model.num_expert", "'num_experts'"),
    ],
)
def test_unknown_key_in_yaml_preset(tmp_path, body, key, suggestion):
    with pytest.raises(ConfigError) as error:
        load_quietly(write_preset(tmp_path, body))
    assert_config_error(error.value, key, suggestion)


def test_unknown_key_in_plain_data():
    with pytest.raises(ConfigError) as error:
        from_dict(TrainConfig, {"algo": {"clip_lowx": 0.1}})
    assert_config_error(error.value, "algo.clip_lowx", "'clip_low'")


def test_unknown_preset_name():
    with pytest.raises(ConfigError) as error:
        load_quietly(PRESETS[0].stem + "x")
    assert_config_error(error.value, "preset", repr(PRESETS[0].stem))


@pytest.mark.parametrize(
    "overrides,key",
    [
        # wrong type
        (["algo.clip_low=abc"], "algo.clip_low"),
        (["algo.ppo_epochs=1.5"], "algo.ppo_epochs"),
        (["algo.use_kl_loss=maybe"], "algo.use_kl_loss"),
        (["reward.functions=5"], "reward.functions"),
        # out of range
        (["algo.ppo_epochs=0"], "algo.ppo_epochs"),
        (["algo.clip_high=0"], "algo.clip_high"),
        (["rollout.top_p=1.5"], "rollout.top_p"),
        (["optim.lr=-1e-3"], "optim.lr"),
        (["algo.advantage_clip=0"], "algo.advantage_clip"),
        (["algo.kl_clamp=0"], "algo.kl_clamp"),
        (["parallel.vpp=0"], "parallel.vpp"),
        # bad choice
        (["algo.loss_agg_mode=token_mean"], "algo.loss_agg_mode"),
        (["algo.importance_sampling=sequence"], "algo.importance_sampling"),
        (["algo.kl_estimator=k4"], "algo.kl_estimator"),
        (["model.architecture=llama"], "model.architecture"),
        # clip_low must stay below 1
        (["algo.clip_low=1.0"], "algo.clip_low"),
        (["algo.clip_low=1.5"], "algo.clip_low"),
        # dual clip constant must exceed 1 + clip_high
        (["algo.dual_clip_loss=true", "algo.dual_clip_constant=1.0004"], "algo.dual_clip_constant"),
        (["algo.dual_clip_loss=true", "algo.dual_clip_constant=0.5"], "algo.dual_clip_constant"),
        # reward shaping
        (["algo.reward_norm=group", "algo.reward_shift=true", "algo.reward_scale=true"],
         "algo.reward_shift"),
        (["algo.reward_shift=true"], "algo.reward_norm"),
        # r2 records routes in the recompute forward
        (["algo.routing_replay=r2", "algo.old_log_prob_source=rollout"], "algo.routing_replay"),
        (["algo.routing_replay=r2", "algo.old_log_prob_source=detach"], "algo.routing_replay"),
        # weights are replayed with replayed routes; R3's come from the embedded engine only
        # (SGLang's return_routed_experts reports ids; the protocol carries no weights)
        (["algo.routing_replay=r3", "algo.routing_replay_weights=replayed",
          "rollout.engine=sglang"], "algo.routing_replay_weights"),
        (["algo.routing_replay=r3", "algo.routing_replay_weights=replayed",
          "rollout.engine=embedded_http"], "algo.routing_replay_weights"),
        (["algo.routing_replay_weights=replayed"], "algo.routing_replay_weights"),
        (["algo.routing_replay_weights=engine"], "algo.routing_replay_weights"),
        # GLM-4.5: Megatron ranks groups by top-(k / group_topk), HF by top-2
        (["model.architecture=glm4_moe", "model.shared_expert_intermediate_size=48",
          "model.moe_router_num_groups=2", "model.moe_router_group_topk=2"],
         "model.moe_router_group_topk"),
        # layout against the model
        (["parallel.ep=3"], "parallel.ep"),
        (["model.architecture=qwen3", "parallel.ep=2"], "parallel.ep"),
        (["parallel.tp=4"], "parallel.tp"),
        (["parallel.pp=3"], "parallel.pp"),
        (["parallel.pp=2", "parallel.vpp=2"], "parallel.pp"),
        (["parallel.vpp=2"], "parallel.vpp"),
        (["model.num_query_groups=3"], "model.num_query_groups"),
        # mini-batches must split the samples of a step (8 x 8 = 64)
        (["algo.num_mini_batches=3"], "algo.num_mini_batches"),
        # SGLang cannot honour min_new_tokens the way the trainer recomputes (tests/real_sglang)
        (["rollout.engine=sglang", "rollout.min_new_tokens=4"], "rollout.min_new_tokens"),
        (["rollout.weight_sync_port=70000"], "rollout.weight_sync_port"),
        # producer processes: only ahead of training, only with an engine reachable over HTTP
        (["rollout.producer_processes=2"], "rollout.producer_processes"),
        (["rollout.max_staleness=1", "rollout.producer_processes=2"],
         "rollout.producer_processes"),
        (["rollout.producer_processes=-1"], "rollout.producer_processes"),
        # detach would train stale samples as if fresh
        (["rollout.max_staleness=1", "algo.old_log_prob_source=detach"],
         "algo.old_log_prob_source"),
        (["rollout.max_staleness=-1"], "rollout.max_staleness"),
    ],
)  # fmt: skip
def test_bad_value(overrides, key):
    with pytest.raises(ConfigError) as error:
        load_quietly(None, overrides)
    assert_config_error(error.value, key)


def test_bad_value_in_yaml_preset(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_quietly(write_preset(tmp_path, "algo:\n  ppo_epochs: many\n"))
    assert_config_error(error.value, "algo.ppo_epochs")


def test_boundaries_that_are_valid():
    """The edges of the ranges above are accepted."""
    config = load_quietly(
        None,
        [
            "algo.dual_clip_loss=true",
            "algo.dual_clip_constant=1.0005",
            "algo.num_mini_batches=64",
            "parallel.pp=2",
            "parallel.ep=8",
            "parallel.tp=2",
            "algo.reward_norm=running",
            "algo.reward_scale=true",
        ],
    )
    assert config.algo.dual_clip_constant == 1.0005


def test_asynchronous_episodes_and_dynamic_sampling_are_accepted():
    """Environments, DAPO's dynamic sampling and producer processes with max_staleness >= 1
    (docs/async.md)."""
    config = load_quietly(
        None,
        [
            "rollout.max_staleness=1",
            "algo.dynamic_sampling=true",
            "data.task=multiply",
            "model.vocab_size=24",
            "env.name=multiply_tool",
            "rollout.engine=embedded_http",
            "rollout.producer_processes=2",
        ],
    )
    assert config.rollout.max_staleness == 1 and config.env.name == "multiply_tool"
    assert config.rollout.producer_processes == 2


def caught_config_warnings(**algo):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AlgoConfig(**algo)
    return [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


@pytest.mark.parametrize("importance_sampling", ["seq", "seq_token"])
@pytest.mark.parametrize(
    "settings,fragment",
    [
        ({"clip_low": 0.2, "clip_high": 0.28}, "clip"),
        ({"clip_low": 3e-4, "clip_high": 0.051}, "clip"),
        ({"loss_agg_mode": "token-mean"}, "loss_agg_mode"),
        ({"loss_agg_mode": "seq-mean-token-sum"}, "loss_agg_mode"),
    ],
)
def test_gspo_warnings(importance_sampling, settings, fragment):
    messages = caught_config_warnings(importance_sampling=importance_sampling, **settings)
    assert len(messages) == 1 and fragment in messages[0]


@pytest.mark.parametrize(
    "settings",
    [
        {},  # GSPO defaults: 3e-4 / 4e-4, seq-mean-token-mean
        {"clip_low": 0.05, "clip_high": 0.05},
        {"loss_agg_mode": "seq-mean-token-sum-norm"},
        {"importance_sampling": "token", "clip_low": 0.2, "clip_high": 0.28,
         "loss_agg_mode": "token-mean"},
    ],
)  # fmt: skip
def test_no_warning(settings):
    assert caught_config_warnings(**settings) == []


def test_preset_warning_reaches_the_user():
    """A GSPO preset with a token-sized clip warns through load_config, as ConfigWarning."""
    with pytest.warns(ConfigWarning, match="clip"):
        load_config(None, ["algo.clip_low=0.2", "algo.clip_high=0.2"])


def test_check_world():
    layout = ParallelConfig(tp=2, pp=2)
    layout.check_world(8)
    assert layout.data_parallel_size(8) == 2
    with pytest.raises(ConfigError) as error:
        layout.check_world(6)
    assert_config_error(error.value, "parallel", "6")
    # ep * etp must divide dp * cp * tp: world 4 with pp 2 leaves 2 ranks for ep = 4.
    with pytest.raises(ConfigError) as error:
        ParallelConfig(pp=2, ep=4).check_world(4)
    assert_config_error(error.value, "parallel.ep")
    ParallelConfig(tp=2, ep=4).check_world(8)  # dp 4 x tp 2 = 8 expert ranks
    ParallelConfig(cp=2, ep=2).check_world(2)  # dp 1 x cp 2


def test_algo_settings_translate_the_keys_once():
    """``AlgoConfig`` says once which settings values its keys make; the algorithm core builds its
    settings from them (``megatron_gspo.algo.settings``), with switched-off features as the
    settings' "off" values."""
    from megatron_gspo import algo, config
    from megatron_gspo.algo import (
        AdvantageSettings,
        PolicyLossSettings,
        advantage_settings,
        policy_loss_settings,
    )

    # One list of each kind of name, in config/loss_rules.py (torch-free): the configuration
    # checks its keys against the names the algorithm core accepts.
    assert config.LOSS_AGG_MODES is algo.LOSS_AGG_MODES
    assert config.KL_ESTIMATORS is algo.KL_ESTIMATORS
    assert config.SURROGATES is algo.SURROGATES
    assert tuple(algo.RATIO_FUNCTIONS) == config.IMPORTANCE_SAMPLING
    assert ("none", *algo.CORRECTION_LEVELS) == config.CORRECTION_LEVELS
    assert config.CORRECTION_MODES is algo.CORRECTION_MODES
    plain = load_quietly(None, ["algo.response_length=12"]).algo
    assert policy_loss_settings(plain) == PolicyLossSettings(
        importance_sampling="seq",
        clip_low=3e-4,
        clip_high=4e-4,
        loss_agg_mode="seq-mean-token-mean",
        dual_clip_constant=None,
        kl_coef=0.0,
        kl_estimator="k3",
        kl_clamp=10.0,
        entropy_coef=0.0,
        norm_length=12,
        log_ratio_clamp=10.0,
    )
    assert advantage_settings(plain) == AdvantageSettings(estimator="grpo", kl_clamp=10.0)
    uncapped = load_quietly(None, ["algo.kl_clamp=null", "algo.loss_agg_mode=dr-grpo"]).algo
    assert policy_loss_settings(uncapped).kl_clamp is None
    assert policy_loss_settings(uncapped).loss_agg_mode == "dr-grpo"
    on = AlgoConfig(
        importance_sampling="seq_token",
        dual_clip_loss=True,
        use_kl_loss=True,
        kl_loss_coef=0.02,
        add_token_level_kl=True,
        token_level_kl_coef=0.3,
        whiten_advantages=True,
        advantage_clip=2.0,
    )
    loss = policy_loss_settings(on)
    assert (loss.dual_clip_constant, loss.kl_coef) == (3.0, 0.02)
    advantages = advantage_settings(on)
    assert advantages.per_token and advantages.token_level_kl_coef == 0.3
    assert (advantages.whiten, advantages.advantage_clip) == (True, 2.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.kl_coef = 1.0
    cispo = load_quietly(
        None, ["algo.importance_sampling=token", "algo.surrogate=cispo", "algo.cispo.weight_high=2"]
    ).algo
    assert policy_loss_settings(cispo).cispo_weight_bounds == (0.0, 2.0)
    gmpo = load_quietly(
        None, ["algo.importance_sampling=token", "algo.surrogate=gmpo", "algo.gmpo.log_clip=0.2"]
    ).algo
    assert policy_loss_settings(gmpo).gmpo_log_clip == 0.2


@pytest.mark.parametrize(
    "settings,algo,key",
    [
        # The settings' field and the configuration's key of the same broken rule.
        ({"surrogate": "cispo"}, {"surrogate": "cispo"}, "algo.importance_sampling"),
        (
            {"importance_sampling": "token", "surrogate": "gmpo", "gmpo_log_clip": 0.4,
             "dual_clip_constant": 3.0},
            {"importance_sampling": "token", "surrogate": "gmpo", "dual_clip_loss": True},
            "algo.dual_clip_loss",
        ),
        (
            {"importance_sampling": "token", "surrogate": "cispo",
             "cispo_weight_bounds": (0.0, 0.5)},
            {"importance_sampling": "token", "surrogate": "cispo",
             "cispo": {"weight_high": 0.5}},
            "algo.cispo.weight_low/high",
        ),
        ({"clip_high": 1.5}, {"clip_high": 1.5}, "algo.clip_high"),
    ],
)  # fmt: skip
def test_config_and_settings_break_the_same_rule(settings, algo, key):
    """One rule set (config/loss_rules.py): what the configuration refuses at its key, the
    algorithm core's settings refuse too, with the same explanation."""
    from megatron_gspo.algo import PolicyLossSettings, SettingsError

    fields = dict(
        importance_sampling="seq", clip_low=0.2, clip_high=0.2, loss_agg_mode="token-mean"
    )
    with pytest.raises(SettingsError) as settings_error:
        PolicyLossSettings(**{**fields, **settings})
    with pytest.raises(ConfigError) as config_error:
        from_dict(AlgoConfig, algo, prefix="algo.")
    assert_config_error(config_error.value, key, settings_error.value.why)
    assert isinstance(settings_error.value, ValueError)


def test_renamed_keys_keep_working_with_a_warning_naming_the_new_key(tmp_path):
    """Old flat keys (rollout.sglang_*, algo.cispo_* / gmpo_*) are read as the new nested ones
    for one release, on the command line, in a preset and in plain data, each with a warning
    that names the new key."""
    old = ["rollout.sglang_port=31000", "algo.gmpo_log_clip=0.3"]
    with pytest.warns(ConfigWarning) as caught:
        config = load_config(None, old)
    assert (config.rollout.sglang.port, config.algo.gmpo.log_clip) == (31000, 0.3)
    messages = [str(w.message) for w in caught]
    assert any("'rollout.sglang.port'" in m for m in messages), messages
    assert any("'algo.gmpo.log_clip'" in m for m in messages), messages
    preset = write_preset(
        tmp_path, "rollout:\n  sglang_tp: 2\n  sglang_extra_args: [--x]\n  sglang:\n    ep: 2\n"
    )
    with pytest.warns(ConfigWarning) as caught:
        config = load_config(preset, ["rollout.sglang.port=31001"])
    messages = [str(w.message) for w in caught]
    assert any("'rollout.sglang.tp'" in m for m in messages), messages
    assert any("'rollout.sglang.extra_args'" in m for m in messages), messages
    assert (config.rollout.sglang.tp, config.rollout.sglang.ep) == (2, 2)
    assert (config.rollout.sglang.extra_args, config.rollout.sglang.port) == (["--x"], 31001)
    with pytest.warns(ConfigWarning, match="'algo.cispo.weight_high'"):
        config = from_dict(TrainConfig, {"algo": {"cispo_weight_high": 3.0}})
    assert config.algo.cispo.weight_high == 3.0


def test_new_keys_load_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        config = load_config(None, ["rollout.sglang.port=31000", "algo.cispo.weight_low=0.5"])
    assert (config.rollout.sglang.port, config.algo.cispo.weight_low) == (31000, 0.5)


@pytest.mark.parametrize(
    "where",
    ["overrides", "preset", "plain data"],
)
def test_a_key_given_under_its_old_and_new_name_is_an_error(tmp_path, where):
    with pytest.raises(ConfigError) as error:
        if where == "overrides":
            load_quietly(None, ["rollout.sglang.host=10.0.0.1", "rollout.sglang_host=10.0.0.2"])
        elif where == "preset":
            body = "rollout:\n  sglang_host: 10.0.0.2\n  sglang:\n    host: 10.0.0.1\n"
            load_quietly(write_preset(tmp_path, body))
        else:
            data = {"rollout": {"sglang_host": "10.0.0.2", "sglang": {"host": "10.0.0.1"}}}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConfigWarning)
                from_dict(TrainConfig, data)
    assert_config_error(error.value, "rollout.sglang.host", "'rollout.sglang_host'")


def test_prompt_file_with_the_synthetic_reward_warns(tmp_path):
    """The demo's digit reward on the user's own prompts scores nothing meaningful."""
    with pytest.warns(ConfigWarning, match="synthetic digit reward"):
        load_config(None, [f"data.train_path={tmp_path / 'prompts.jsonl'}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(None, [f"data.train_path={tmp_path / 'p.jsonl'}", "reward.functions=[math]"])
        load_config(None, [])  # the demo: synthetic prompts, synthetic reward


CORRECTION = "algo.rollout_correction"


@pytest.mark.parametrize(
    "overrides,key,fragment",
    [
        ([f"{CORRECTION}.level=geometric"], f"{CORRECTION}.level", "'geometric'"),
        ([f"{CORRECTION}.level=token", f"{CORRECTION}.mode=clip"], f"{CORRECTION}.mode", "clip"),
        (
            [f"{CORRECTION}.level=token", f"{CORRECTION}.low=0.5"],
            f"{CORRECTION}.low",
            "caps the weight from above only",
        ),
        ([f"{CORRECTION}.level=token", f"{CORRECTION}.high=0.9"], f"{CORRECTION}.high", ">= 1"),
        (
            [f"{CORRECTION}.level=sequence", f"{CORRECTION}.mode=mask", f"{CORRECTION}.low=1.01"],
            f"{CORRECTION}.low/high",
            "must be kept",
        ),
        (
            [f"{CORRECTION}.level=token", "algo.old_log_prob_source=rollout"],
            f"{CORRECTION}.level",
            "pi_old = mu",
        ),
        (
            ["algo.importance_sampling=token", "algo.surrogate=gmpo", f"{CORRECTION}.level=token"],
            f"{CORRECTION}.level",
            "one term per sequence",
        ),
        (["algo.surrogate=cispo"], "algo.importance_sampling", "token ratios"),
        (["algo.surrogate=ppo"], "algo.surrogate", "'ppo'"),
        (
            ["algo.importance_sampling=token", "algo.surrogate=cispo", "algo.dual_clip_loss=true"],
            "algo.dual_clip_loss",
            "own clipping",
        ),
        (
            [
                "algo.importance_sampling=token",
                "algo.surrogate=cispo",
                "algo.cispo.weight_high=0.5",
            ],
            "algo.cispo.weight_low/high",
            "contain 1",
        ),
        (
            [
                "algo.importance_sampling=token",
                "algo.surrogate=gmpo",
                "algo.loss_agg_mode=token-mean",
            ],
            "algo.loss_agg_mode",
            "seq-mean-token-mean",
        ),
        (
            [
                "algo.importance_sampling=token",
                "algo.surrogate=gmpo",
                "algo.add_token_level_kl=true",
            ],
            "algo.add_token_level_kl",
            "one sequence advantage",
        ),
        (["rollout.dtype=float8"], "rollout.dtype", "'float8'"),
        (["rollout.engine=sglang", "rollout.dtype=bfloat16"], "rollout.dtype", "--dtype"),
    ],
)
def test_impossible_mismatch_settings(overrides, key, fragment):
    """Rollout corrections, CISPO / GMPO and rollout.dtype: what, why and how to fix, at start."""
    with pytest.raises(ConfigError) as error:
        load_quietly(None, overrides)
    assert_config_error(error.value, key, fragment)


@pytest.mark.parametrize(
    "level,mode,bounds",
    [
        ("token", "truncate", (None, 2.0)),
        ("token", "mask", (0.5, 5.0)),
        ("sequence", "truncate", (None, 2.0)),
        ("sequence", "mask", (0.999, 1.001)),
    ],
)
def test_correction_defaults_reach_the_loss(level, mode, bounds):
    from megatron_gspo.algo import policy_loss_settings

    cfg = load_quietly(None, [f"{CORRECTION}.level={level}", f"{CORRECTION}.mode={mode}"])
    correction = policy_loss_settings(cfg.algo).rollout_correction
    assert (correction.level, correction.mode, correction.low, correction.high) == (
        level,
        mode,
        *bounds,
    )
    off = policy_loss_settings(load_quietly(None, []).algo)
    assert off.rollout_correction is None and off.surrogate == "clip"


def test_sft_warmup_lr_must_be_positive():
    assert load_quietly(None, []).sft_warmup_lr is None  # the cold start uses optim.lr
    assert load_quietly("cpu_tool_use", []).sft_warmup_lr == 3e-3
    with pytest.raises(ConfigError) as error:
        load_quietly(None, ["sft_warmup_lr=0"])
    assert_config_error(error.value, "sft_warmup_lr")


def test_sglang_return_routes_asks_sglang_for_routes_without_r3():
    """Off (the default), SGLang servers return routes only for R3, as before; on, also for the
    routing metrics of every other variant (tools/compare_grpo_gspo.py's SGLang mode)."""
    cfg = load_config(None, ["rollout.engine=sglang", "algo.routing_replay=r2"])
    assert not cfg.requests_rollout_routes
    cfg.rollout.sglang.return_routes = True
    assert cfg.requests_rollout_routes
    cfg.algo.log_routing_change = False
    assert not cfg.requests_rollout_routes


def test_r3_replayed_weights_with_the_embedded_engine_asks_for_the_engine_weights():
    """R3 with replayed weights is accepted with the embedded engine, which then reports its
    routers' combine weights beside the ids; recompute (and R2) asks for ids only."""
    cfg = load_config(None, ["algo.routing_replay=r3", "algo.routing_replay_weights=replayed"])
    assert cfg.requests_rollout_routes and cfg.requests_rollout_route_weights
    cfg.algo.routing_replay_weights = "recompute"
    assert cfg.requests_rollout_routes and not cfg.requests_rollout_route_weights
    cfg = load_config(None, ["algo.routing_replay=r2", "algo.routing_replay_weights=replayed"])
    assert not cfg.requests_rollout_route_weights


def test_r3_replayed_weights_with_sglang_says_what_why_and_fix():
    with pytest.raises(ConfigError) as error:
        load_quietly(
            None,
            [
                "rollout.engine=sglang",
                "algo.routing_replay=r3",
                "algo.routing_replay_weights=replayed",
            ],
        )
    message = str(error.value)
    assert "rollout.engine=sglang" in message and "ids only" in message
    assert "rollout.engine=embedded" in message and "recompute" in message


@pytest.mark.parametrize("launch,warns", [(False, True), (True, False)])
def test_r3_with_sglang_warns_only_about_servers_it_does_not_launch(launch, warns):
    """Listed servers must have been started with --enable-return-routed-experts (a warning);
    servers the run launches get the flag, so nothing to warn about."""
    overrides = [
        "rollout.engine=sglang",
        "algo.routing_replay=r3",
        f"rollout.sglang.launch={launch}",
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(None, overrides)
    messages = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any("--enable-return-routed-experts" in m for m in messages) == warns, messages
