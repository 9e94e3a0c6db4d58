"""The extra models' sections (``models.<role>``) and distillation's (``algo.distillation``):
loaded from overrides and presets, and refused with what / why / fix when they cannot work."""

from __future__ import annotations

import pytest
import yaml

from megatron_gspo.config import (
    ConfigError,
    ExtraModelConfig,
    StartupErrors,
    TrainConfig,
    from_dict,
    to_dict,
)
from megatron_gspo.config.loader import load_config

TEACHER = ["models.teacher.hf_path=/models/teacher"]
DISTILL = [*TEACHER, "algo.distillation.mode=pure", "algo.importance_sampling=seq_token"]


def from_overrides(overrides: list[str]) -> TrainConfig:
    """The configuration of ``key=value`` overrides built without Hydra (a few ms instead of
    Hydra's composition; test_models_load_from_overrides_as_sections covers Hydra's path)."""
    data: dict = {}
    for override in overrides:
        key, value = override.split("=", 1)
        *sections, name = key.split(".")
        node = data
        for section in sections:
            node = node.setdefault(section, {})
        node[name] = yaml.safe_load(value)
    return from_dict(TrainConfig, data)


def test_models_load_from_overrides_as_sections():
    cfg = load_config(
        None,
        [
            *DISTILL,
            "models.judge.hf_path=/models/judge",
            "models.judge.engine=sglang",
            "models.judge.dtype=bfloat16",
            "models.judge.sglang.urls=[http://127.0.0.1:30001]",
        ],
    )
    assert sorted(cfg.models) == ["judge", "teacher"]
    assert all(isinstance(model, ExtraModelConfig) for model in cfg.models.values())
    assert cfg.models["judge"].sglang.urls == ["http://127.0.0.1:30001"]
    assert cfg.models["judge"].dtype == "bfloat16"
    assert cfg.algo.distillation.mode == "pure"
    # The plain data of the config (logs, checkpoints) round-trips.
    assert to_dict(cfg)["models"]["teacher"]["hf_path"] == "/models/teacher"
    assert load_config(None, ["algo.distillation.mode=off"]).algo.distillation.enabled is False


def test_the_distillation_preset_composes():
    cfg = load_config("cpu_demo_distill", [])
    assert cfg.algo.distillation.mode == "pure"
    assert cfg.algo.importance_sampling == "seq_token"
    assert cfg.models["teacher"].engine == "embedded"


@pytest.mark.parametrize(
    ("overrides", "key", "text"),
    [
        (["algo.distillation.mode=pure"], "models.teacher", "which models does not hold"),
        ([*DISTILL, "algo.old_log_prob_source=detach"], "algo.distillation.mode", "detach"),
        ([*TEACHER, "algo.distillation.mode=added", "algo.surrogate=gmpo"], None, "gmpo"),
        ([*DISTILL, "rollout.replay_dir=/runs/old"], "algo.distillation.mode", "replay"),
        (
            [
                *DISTILL,
                "models.teacher.engine=sglang",
                "models.teacher.sglang.urls=[http://127.0.0.1:1]",
                "rollout.temperature=0.7",
            ],
            "models.teacher.engine",
            "temperature 1 only",
        ),
        (["algo.distillation.mode=reverse"], "algo.distillation.mode", "reverse"),
        (["algo.distillation.kl_coef=0"], "algo.distillation.kl_coef", "kl_coef"),
        (["models.judge.engine=sglang", "models.judge.hf_path=/x"], "models.judge.sglang.urls", ""),
        (["models.teacher.engine=vllm"], "models.<role>.engine", "vllm"),
        (["models.teacher.sglang.release_memory=true", *TEACHER], None, "release_memory"),
        (["models.policy.hf_path=/x"], "models.policy", "policy"),
        (["models.teacher.dtype=float32"], "models.teacher.hf_path", "no Hugging Face directory"),
    ],
)
def test_impossible_settings_fail_at_start(overrides, key, text):
    with pytest.raises(ConfigError) as error:
        from_overrides(overrides)
    if key is not None:
        assert error.value.key == key, str(error.value)
    assert text in str(error.value)
    assert "fix:" in str(error.value)


def test_every_model_problem_is_reported_at_once():
    with pytest.raises(StartupErrors) as error:
        from_overrides(["models.a-b.engine=sglang", "models.judge.dtype=float16"])
    keys = [problem.key for problem in error.value.errors]
    assert keys == [
        "models.a-b",
        "models.a-b.hf_path",
        "models.a-b.sglang.urls",
        "models.judge.hf_path",
    ]
