"""The presets of examples/moe/: each one composes and validates, fits the GPU count it is written
for, and describes the real model.

The model sizes are checked against the published Hugging Face config.json of Qwen3-30B-A3B and
Mixtral-8x7B-Instruct-v0.1 (copied below from the model repositories), GLM-4.5-Air and DeepSeek-V3
(copied in tests/convert/tiny_models.py; the DeepSeek-V3-shaped preset differs in its depth
only), read through the same function that reads ``model.hf_path`` at run time.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest

from megatron_gspo.config import ConfigWarning, TrainConfig, to_dict
from megatron_gspo.config.loader import EXAMPLES_DIR, load_config
from megatron_gspo.convert.hf_config import model_config_fields_from_hf, model_config_from_hf
from tests.convert.tiny_models import DEEPSEEK_V3_CONFIG, GLM_4_5_AIR_CONFIG

PRESETS = sorted(path.stem for path in Path(EXAMPLES_DIR).glob("*.yaml"))

# Preset -> the number of trainer processes it is laid out for.
WORLD_SIZES = {
    "cpu_demo": 1,
    "cpu_demo_distill": 1,
    "cpu_tiny_4proc": 4,
    "cpu_tool_use": 1,
    "qwen3_30b_a3b_gspo_1node": 8,
    "qwen3_30b_a3b_gspo_4node": 32,
    "qwen3_30b_a3b_grpo_r3": 32,
    "mixtral_8x7b_gspo": 32,
    "glm45_air_gspo_4node": 32,
    "deepseek_v3_shaped_gspo_4node": 32,
}

QWEN3_30B_A3B_CONFIG = {  # huggingface.co/Qwen/Qwen3-30B-A3B, config.json
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

MIXTRAL_8X7B_CONFIG = {  # huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1, config.json
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

DEEPSEEK_V3_SHAPED_CONFIG = {
    **{key: value for key, value in DEEPSEEK_V3_CONFIG.items() if key != "quantization_config"},
    "num_hidden_layers": 8,
}
"""The DeepSeek-V3-shaped preset's model: the published DeepSeek-V3 config.json (tests/convert/
tiny_models.py) at 8 layers instead of 61, in bf16 (an fp8 ``quantization_config`` is refused);
examples/moe/deepseek_v3_shaped_gspo_4node.yaml and docs/deepseek-v3.md, section 7."""

MODEL_OF_PRESET = {
    "qwen3_30b_a3b_gspo_1node": QWEN3_30B_A3B_CONFIG,
    "qwen3_30b_a3b_gspo_4node": QWEN3_30B_A3B_CONFIG,
    "qwen3_30b_a3b_grpo_r3": QWEN3_30B_A3B_CONFIG,
    "mixtral_8x7b_gspo": MIXTRAL_8X7B_CONFIG,
    "glm45_air_gspo_4node": GLM_4_5_AIR_CONFIG,  # huggingface.co/zai-org/GLM-4.5-Air
    "deepseek_v3_shaped_gspo_4node": DEEPSEEK_V3_SHAPED_CONFIG,
}
GSPO_GPU_PRESETS = (
    "qwen3_30b_a3b_gspo_1node",
    "qwen3_30b_a3b_gspo_4node",
    "mixtral_8x7b_gspo",
    "glm45_air_gspo_4node",
    "deepseek_v3_shaped_gspo_4node",
)


def load(preset: str, overrides: list[str] | None = None) -> TrainConfig:
    return _load(preset, tuple(overrides or ()))


@functools.cache
def _load(preset: str, overrides: tuple[str, ...]) -> TrainConfig:
    """Composition takes ~0.5 s (Hydra); the tests only read the result."""
    with warnings.catch_warnings():
        # ROLL's preset and R3 with SGLang load with documented warnings; nothing else should warn.
        warnings.simplefilter("ignore" if preset in ("roll_gspo",) else "error", ConfigWarning)
        if preset == "qwen3_30b_a3b_grpo_r3":
            warnings.filterwarnings("ignore", "config warning at 'algo.routing_replay'")
        return load_config(preset, list(overrides))


def flatten(tree: dict, prefix: str = "") -> dict:
    """``{"algo.clip_low": 3e-4, ...}`` from nested config data."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key != "options":
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates(preset: str) -> None:
    config = load(preset)
    assert isinstance(config, TrainConfig)


def test_every_new_preset_has_a_world_size() -> None:
    assert set(WORLD_SIZES) <= set(PRESETS), "a preset listed in WORLD_SIZES is gone"
    unlisted = set(PRESETS) - set(WORLD_SIZES) - {"roll_gspo"}  # ROLL's example fits any size
    assert not unlisted, f"add the process count of {sorted(unlisted)} to WORLD_SIZES"


@pytest.mark.parametrize("preset", sorted(WORLD_SIZES))
def test_layout_fits_its_world_size(preset: str) -> None:
    config = load(preset)
    world_size = WORLD_SIZES[preset]
    config.parallel.check_world(world_size)
    data_parallel = config.parallel.data_parallel_size(world_size)
    # Each optimizer step's samples spread evenly over the data-parallel ranks.
    samples_per_mini_batch = config.algo.samples_per_step // config.algo.num_mini_batches
    assert samples_per_mini_batch % data_parallel == 0, (samples_per_mini_batch, data_parallel)


@pytest.mark.parametrize("preset", sorted(MODEL_OF_PRESET))
def test_model_is_the_published_architecture(preset: str) -> None:
    config = load(preset)
    published = MODEL_OF_PRESET[preset]
    expected = model_config_fields_from_hf(published)
    actual = {name: getattr(config.model, name) for name in expected}
    assert actual == expected
    # What happens at run time with model.hf_path: the preset must agree with config.json.
    assert model_config_from_hf(published, config.model) == config.model
    assert config.model.dtype == "bfloat16"
    assert not config.model.tie_word_embeddings


@pytest.mark.parametrize("preset", GSPO_GPU_PRESETS)
def test_gspo_presets_use_the_papers_settings(preset: str) -> None:
    algo = load(preset).algo
    assert algo.importance_sampling == "seq"
    assert (algo.clip_low, algo.clip_high) == (3e-4, 4e-4)
    assert algo.num_mini_batches == 4
    assert not algo.use_kl_loss and not algo.add_token_level_kl
    assert algo.loss_agg_mode == "seq-mean-token-mean"
    assert algo.routing_replay == "none"


def test_grpo_r3_preset_differs_from_gspo_4node_only_in_the_algorithm() -> None:
    """The GRPO + R3 baseline must be comparable with GSPO: same model, layout, data, batch."""
    gspo = flatten(to_dict(load("qwen3_30b_a3b_gspo_4node")))
    grpo = flatten(to_dict(load("qwen3_30b_a3b_grpo_r3")))
    differing = {key for key in gspo if gspo[key] != grpo[key]}
    assert differing == {
        "output_dir",
        "algo.importance_sampling",
        "algo.clip_low",
        "algo.clip_high",
        "algo.routing_replay",
    }
    assert (grpo["algo.importance_sampling"], grpo["algo.routing_replay"]) == ("token", "r3")
    assert (grpo["algo.clip_low"], grpo["algo.clip_high"]) == (0.2, 0.27)


def test_grpo_r3_one_node_overrides_from_its_header_fit_eight_gpus() -> None:
    overrides = [
        "algo.rollout_batch_size=64",
        "algo.num_return_sequences_in_group=8",
        "rollout.sglang.mem_fraction=0.4",
    ]
    text = (Path(EXAMPLES_DIR) / "qwen3_30b_a3b_grpo_r3.yaml").read_text()
    assert " ".join(overrides) in text
    load("qwen3_30b_a3b_grpo_r3", overrides).parallel.check_world(8)


@pytest.mark.parametrize("preset", sorted(MODEL_OF_PRESET))
def test_colocated_presets_release_sglang_memory(preset: str) -> None:
    rollout = load(preset).rollout
    assert rollout.engine == "sglang"
    assert rollout.sglang.release_memory and rollout.weight_transport == "tensor"
    assert rollout.sglang.tp == 8  # one server over each node's 8 GPUs


def test_cpu_demo_is_the_schema_defaults() -> None:
    """cpu_demo.yaml writes out every default; a changed default in config/ must change it too."""
    written = flatten(to_dict(load("cpu_demo")))
    defaults = flatten(to_dict(TrainConfig()))
    changed = sorted(key for key in defaults if written.get(key) != defaults[key])
    assert not changed, (
        f"examples/moe/cpu_demo.yaml differs from config/'s defaults at {changed}: "
        "write the new defaults into it"
    )


def test_cpu_tiny_4proc_also_runs_as_pipeline_parallel() -> None:
    """Its header offers parallel.tp=1 parallel.pp=2 as the pipeline variant."""
    load("cpu_tiny_4proc", ["parallel.tp=1", "parallel.pp=2"]).parallel.check_world(4)
