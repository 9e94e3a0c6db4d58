"""Name and tensor mapping between Megatron-Core ``GPTModel`` parameters and Hugging Face weights.

Pure torch, no Megatron import. Both sides are FULL (unsharded) tensors: the Megatron side is the
one-process model (tp = pp = ep = 1) whose names carry the global layer and expert index, e.g.
``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``; the HF side uses the names
``save_pretrained`` writes to disk (per-expert tensors, Mixtral's ``block_sparse_moe``), not the
packed ``gate_up_proj`` that transformers 5 keeps in memory.

Both Megatron spellings are accepted (see ``docs/hf-mapping.md`` section 2):

============================================  ==============================================
local spec                                    Transformer Engine spec / dist-checkpoint key
============================================  ==============================================
``input_layernorm.weight``                    ``self_attention.linear_qkv.layer_norm_weight``
``pre_mlp_layernorm.weight``                  ``mlp.linear_fc1.layer_norm_weight``
``mlp.experts.local_experts.E.linear_fc1.*``  ``mlp.experts.linear_fc1.weightE``
============================================  ==============================================

Tensor rules (``H`` query heads, ``G`` key/value groups, ``d`` head_dim, ``h`` hidden size,
``F`` FFN width, ``V`` vocabulary, ``V_pad >= V`` Megatron's padded vocabulary):

* q/k/v: Megatron's ``linear_qkv.weight`` ``[(H + 2G) d, h]`` is grouped: for each group g the rows
  are ``[q heads of g (H/G * d), k_g (d), v_g (d)]``. ``view(G, (H/G + 2) d, h)`` and slicing
  splits it; a plain ``cat([q, k, v])`` is wrong whenever ``G > 1``. The bias follows the rows.
* gate/up: ``linear_fc1.weight`` ``[2F, h] = cat([gate_proj, up_proj], 0)`` (Mixtral: ``w1``,
  ``w3``).
* vocabulary: ``embedding.word_embeddings.weight`` / ``output_layer.weight`` ``[V_pad, h]``; export
  keeps the first ``V`` rows, import appends ``V_pad - V`` zero rows.
* tied embeddings: ``output_layer.weight`` (present on the last pipeline stage) is not exported, and
  it is imported from ``model.embed_tokens.weight``.
* GLM-4.5's score-correction bias: Megatron's router buffer ``mlp.router.expert_bias`` ``[E]``
  (float32) is HF's ``mlp.gate.e_score_correction_bias`` buffer; a buffer, not a trained weight,
  converted like one because both checkpoints store it (``docs/glm4-moe.md``).
* DeepSeek-V3's multi-head latent attention: ``q_proj`` / ``q_a_proj``, ``q_a_layernorm``,
  ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` are Megatron's
  ``linear_q_proj`` / ``linear_q_down_proj``, ``q_layernorm``, ``linear_q_up_proj``,
  ``linear_kv_down_proj``, ``kv_layernorm``, ``linear_kv_up_proj``, all copies: the rotary rows
  stay in DeepSeek's interleaved pair order, which Megatron's MLA RoPE reads as HF's does
  (``docs/deepseek-v3.md``).
* everything else is a copy.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.config import ModelConfig


class ConversionError(ValueError):
    """A tensor or name that cannot be converted; the message says what, why and how to fix."""


# ---------------------------------------------------------------------------------------------
# Megatron names -> parameter kinds
# ---------------------------------------------------------------------------------------------

_TOP_LEVEL = {
    "embedding.word_embeddings.weight": "embedding",
    "output_layer.weight": "output",
    "decoder.final_layernorm.weight": "final_norm",
}

_LAYER_PATTERNS: tuple[tuple[re.Pattern, str], ...] = tuple(
    (re.compile(pattern + r"$"), kind)
    for pattern, kind in (
        (r"input_layernorm\.weight", "input_norm"),
        (r"self_attention\.linear_qkv\.layer_norm_weight", "input_norm"),
        (r"self_attention\.linear_qkv\.weight", "qkv_weight"),
        (r"self_attention\.linear_qkv\.bias", "qkv_bias"),
        (r"self_attention\.linear_proj\.weight", "proj"),
        (r"self_attention\.q_layernorm\.weight", "q_norm"),
        (r"self_attention\.k_layernorm\.weight", "k_norm"),
        (r"self_attention\.linear_q_proj\.weight", "mla_q_proj"),
        (r"self_attention\.linear_q_down_proj\.weight", "mla_q_down"),
        (r"self_attention\.linear_q_up_proj\.weight", "mla_q_up"),
        (r"self_attention\.linear_q_up_proj\.layer_norm_weight", "q_norm"),
        (r"self_attention\.linear_kv_down_proj\.weight", "mla_kv_down"),
        (r"self_attention\.linear_kv_up_proj\.weight", "mla_kv_up"),
        (r"self_attention\.linear_kv_up_proj\.layer_norm_weight", "kv_norm"),
        (r"self_attention\.kv_layernorm\.weight", "kv_norm"),
        (r"pre_mlp_layernorm\.weight", "post_attn_norm"),
        (r"mlp\.linear_fc1\.layer_norm_weight", "post_attn_norm"),
        (r"mlp\.linear_fc1\.weight", "dense_fc1"),
        (r"mlp\.linear_fc2\.weight", "dense_fc2"),
        (r"mlp\.router\.weight", "router"),
        (r"mlp\.router\.expert_bias", "router_bias"),
        (r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight", "expert_fc1"),
        (r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight", "expert_fc2"),
        (r"mlp\.experts\.linear_fc1\.weight(?P<expert>\d+)", "expert_fc1"),
        (r"mlp\.experts\.linear_fc2\.weight(?P<expert>\d+)", "expert_fc2"),
        (r"mlp\.shared_experts\.linear_fc1\.weight", "shared_fc1"),
        (r"mlp\.shared_experts\.linear_fc2\.weight", "shared_fc2"),
        (r"mlp\.shared_experts\.gate_weight", "shared_gate"),
    )
)

_LAYER_PREFIX = re.compile(r"^decoder\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")


@dataclass(frozen=True)
class ParamKey:
    """What a Megatron parameter is, independent of the spec that named it."""

    kind: str
    layer: Optional[int] = None
    expert: Optional[int] = None


@functools.lru_cache(maxsize=65536)
def parse_megatron_name(global_name: str) -> ParamKey:
    """Classify a one-process Megatron parameter name (local or TE spelling). A pure function of
    the name, remembered: every weight sync classifies the same names again.

    Raises :class:`ConversionError` for names outside the supported architectures (for example
    the legacy ``GroupedMLP`` ``weight1``/``weight2``, which stack all local experts in one tensor).
    """
    if global_name in _TOP_LEVEL:
        return ParamKey(_TOP_LEVEL[global_name])
    match = _LAYER_PREFIX.match(global_name)
    if match:
        rest = match["rest"]
        for pattern, kind in _LAYER_PATTERNS:
            found = pattern.match(rest)
            if found:
                expert = found.groupdict().get("expert")
                return ParamKey(kind, int(match["layer"]), None if expert is None else int(expert))
    hint = ""
    if re.search(r"mlp\.experts\.weight[12]$", global_name):
        hint = (
            " The legacy GroupedMLP (moe_grouped_gemm without Transformer Engine) stores all local"
            " experts in one tensor; build the model with SequentialMLP or TEGroupedMLP."
        )
    raise ConversionError(
        f"no HF mapping for the Megatron parameter {global_name!r}: it is not a parameter of the "
        f"supported GPT architectures (Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3, GLM-4.5, DeepSeek-V3).{hint}"
    )


def megatron_name(key: ParamKey, *, style: str = "local", mla: bool = False) -> str:
    """The one-process Megatron name of ``key`` in the ``local`` or ``te`` spelling. ``mla``: the
    model has multi-head latent attention, whose query norm (``q_norm``, on the q latent) TE fuses
    into ``linear_q_up_proj``."""
    if style not in ("local", "te"):
        raise ValueError(f"style must be 'local' or 'te', not {style!r}")
    for name, kind in _TOP_LEVEL.items():
        if kind == key.kind:
            return name
    te = style == "te"
    rest = {
        "input_norm": (
            "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
        ),
        "qkv_weight": "self_attention.linear_qkv.weight",
        "qkv_bias": "self_attention.linear_qkv.bias",
        "proj": "self_attention.linear_proj.weight",
        "q_norm": (
            "self_attention.linear_q_up_proj.layer_norm_weight"
            if te and mla
            else "self_attention.q_layernorm.weight"
        ),
        "k_norm": "self_attention.k_layernorm.weight",
        "kv_norm": (
            "self_attention.linear_kv_up_proj.layer_norm_weight"
            if te
            else "self_attention.kv_layernorm.weight"
        ),
        "mla_q_proj": "self_attention.linear_q_proj.weight",
        "mla_q_down": "self_attention.linear_q_down_proj.weight",
        "mla_q_up": "self_attention.linear_q_up_proj.weight",
        "mla_kv_down": "self_attention.linear_kv_down_proj.weight",
        "mla_kv_up": "self_attention.linear_kv_up_proj.weight",
        # TE fuses the pre-MLP norm into fc1 only for dense MLPs; MoE layers keep their own.
        "post_attn_norm": "pre_mlp_layernorm.weight",
        "dense_fc1": "mlp.linear_fc1.weight",
        "dense_fc2": "mlp.linear_fc2.weight",
        "router": "mlp.router.weight",
        "router_bias": "mlp.router.expert_bias",
        "expert_fc1": (
            f"mlp.experts.linear_fc1.weight{key.expert}"
            if te
            else f"mlp.experts.local_experts.{key.expert}.linear_fc1.weight"
        ),
        "expert_fc2": (
            f"mlp.experts.linear_fc2.weight{key.expert}"
            if te
            else f"mlp.experts.local_experts.{key.expert}.linear_fc2.weight"
        ),
        "shared_fc1": "mlp.shared_experts.linear_fc1.weight",
        "shared_fc2": "mlp.shared_experts.linear_fc2.weight",
        "shared_gate": "mlp.shared_experts.gate_weight",
    }[key.kind]
    return f"decoder.layers.{key.layer}.{rest}"


# ---------------------------------------------------------------------------------------------
# Per-architecture HF tables: kind -> HF names (relative to ``model.layers.L.``)
# ---------------------------------------------------------------------------------------------

_ATTENTION = {
    "input_norm": ("input_layernorm.weight",),
    "qkv_weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "proj": ("self_attn.o_proj.weight",),
    "post_attn_norm": ("post_attention_layernorm.weight",),
}
_QK_NORM = {"q_norm": ("self_attn.q_norm.weight",), "k_norm": ("self_attn.k_norm.weight",)}
_DENSE_MLP = {
    "dense_fc1": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "dense_fc2": ("mlp.down_proj.weight",),
}
_QWEN_EXPERTS = {
    "router": ("mlp.gate.weight",),
    "expert_fc1": ("mlp.experts.{expert}.gate_proj.weight", "mlp.experts.{expert}.up_proj.weight"),
    "expert_fc2": ("mlp.experts.{expert}.down_proj.weight",),
}
_MIXTRAL_EXPERTS = {
    "router": ("block_sparse_moe.gate.weight",),
    "expert_fc1": (
        "block_sparse_moe.experts.{expert}.w1.weight",
        "block_sparse_moe.experts.{expert}.w3.weight",
    ),
    "expert_fc2": ("block_sparse_moe.experts.{expert}.w2.weight",),
}
_GLM4_EXPERTS = {
    **_QWEN_EXPERTS,
    "router_bias": ("mlp.gate.e_score_correction_bias",),
    "shared_fc1": ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
    "shared_fc2": ("mlp.shared_experts.down_proj.weight",),
}
_SHARED_EXPERT = {
    "shared_fc1": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    "shared_fc2": ("mlp.shared_expert.down_proj.weight",),
    "shared_gate": ("mlp.shared_expert_gate.weight",),
}

_MLA = {
    "input_norm": ("input_layernorm.weight",),
    "mla_q_proj": ("self_attn.q_proj.weight",),
    "mla_q_down": ("self_attn.q_a_proj.weight",),
    "q_norm": ("self_attn.q_a_layernorm.weight",),
    "mla_q_up": ("self_attn.q_b_proj.weight",),
    "mla_kv_down": ("self_attn.kv_a_proj_with_mqa.weight",),
    "kv_norm": ("self_attn.kv_a_layernorm.weight",),
    "mla_kv_up": ("self_attn.kv_b_proj.weight",),
    "proj": ("self_attn.o_proj.weight",),
    "post_attn_norm": ("post_attention_layernorm.weight",),
}

LAYER_TABLES: dict[str, dict[str, tuple[str, ...]]] = {
    "qwen3_moe": {**_ATTENTION, **_QK_NORM, **_DENSE_MLP, **_QWEN_EXPERTS},
    "mixtral": {**_ATTENTION, **_MIXTRAL_EXPERTS},
    "qwen2_moe": {**_ATTENTION, **_DENSE_MLP, **_QWEN_EXPERTS, **_SHARED_EXPERT},
    "qwen3": {**_ATTENTION, **_QK_NORM, **_DENSE_MLP},
    "glm4_moe": {**_ATTENTION, **_QK_NORM, **_DENSE_MLP, **_GLM4_EXPERTS},
    "deepseek_v3": {**_MLA, **_DENSE_MLP, **_GLM4_EXPERTS},
}
"""HF on-disk names of each decoder-layer parameter kind, per architecture."""

_GLOBAL_HF_NAMES = {
    "embedding": "model.embed_tokens.weight",
    "output": "lm_head.weight",
    "final_norm": "model.norm.weight",
}


def _check_key(key: ParamKey, model: ModelConfig, name: str) -> None:
    """Reject a parameter that ``model`` does not have (wrong layer type, index out of range)."""
    arch = model.architecture
    if key.layer is None:
        return
    if not 0 <= key.layer < model.num_layers:
        raise ConversionError(
            f"{name!r}: layer {key.layer} is outside [0, num_layers={model.num_layers}); pass "
            "the global name (pipeline layer offset applied) and the model's own config"
        )
    if key.kind not in LAYER_TABLES[arch]:
        raise ConversionError(
            f"{name!r} ({key.kind}) has no counterpart in the HF {arch} architecture; the "
            "Megatron model was built with options the HF class cannot express (check "
            "model.qk_layernorm, model.add_qkv_bias, model.shared_expert_intermediate_size)"
        )
    is_moe_layer = key.layer in model.moe_layer_indices
    moe_only = (
        "router",
        "router_bias",
        "expert_fc1",
        "expert_fc2",
        "shared_fc1",
        "shared_fc2",
        "shared_gate",
    )
    if key.kind in moe_only and not is_moe_layer:
        raise ConversionError(
            f"{name!r}: layer {key.layer} is a dense layer in this config "
            f"(first_k_dense_layers={model.first_k_dense_layers}), but the name is an MoE one"
        )
    if key.kind in ("dense_fc1", "dense_fc2") and is_moe_layer:
        raise ConversionError(
            f"{name!r}: layer {key.layer} is an MoE layer in this config "
            f"(first_k_dense_layers={model.first_k_dense_layers}), but the name is a dense MLP one"
        )
    if key.expert is not None and not 0 <= key.expert < model.num_experts:
        raise ConversionError(
            f"{name!r}: expert {key.expert} is outside [0, num_experts={model.num_experts}); "
            "pass the global name (expert-parallel offset applied)"
        )


def hf_names_for(global_name: str, model: ModelConfig) -> list[str]:
    """HF on-disk names whose tensors make up the Megatron parameter ``global_name``.

    Empty for ``output_layer.weight`` of a tied-embedding model on export; on import that
    parameter is built from ``model.embed_tokens.weight`` (see :func:`hf_import_names_for`).
    """
    key = parse_megatron_name(global_name)
    _check_key(key, model, global_name)
    return _hf_names(key, model)


def _hf_names(key: ParamKey, model: ModelConfig) -> list[str]:
    """:func:`hf_names_for` of a parsed and checked ``key``."""
    if key.kind == "output" and model.tie_word_embeddings:
        return []
    if key.layer is None:
        return [_GLOBAL_HF_NAMES[key.kind]]
    templates = LAYER_TABLES[model.architecture][key.kind]
    return [f"model.layers.{key.layer}." + t.format(expert=key.expert) for t in templates]


def hf_import_names_for(global_name: str, model: ModelConfig) -> list[str]:
    """HF names to read to build ``global_name`` (a tied output layer reads the embedding)."""
    key = parse_megatron_name(global_name)
    if key.kind == "output" and model.tie_word_embeddings:
        return [_GLOBAL_HF_NAMES["embedding"]]
    return hf_names_for(global_name, model)


# ---------------------------------------------------------------------------------------------
# Tensor rules
# ---------------------------------------------------------------------------------------------


def interleave_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int, head_dim: int
) -> torch.Tensor:
    """Megatron's grouped q/k/v rows from HF's separate projections.

    ``q`` ``[H d, *rest]``, ``k`` and ``v`` ``[G d, *rest]`` -> ``[(H + 2G) d, *rest]`` laid out as
    ``G`` blocks ``[q heads of the group (H/G d rows), k_g (d), v_g (d)]``. Chunking the result
    along dim 0 into ``tp`` parts gives each tensor-parallel rank whole groups.
    """
    groups, rest = num_query_groups, q.shape[1:]
    q_rows_per_group = q.shape[0] // groups
    grouped = torch.cat(
        [
            q.reshape(groups, q_rows_per_group, *rest),
            k.reshape(groups, head_dim, *rest),
            v.reshape(groups, head_dim, *rest),
        ],
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`interleave_qkv`: ``[(H + 2G) d, *rest]`` -> q ``[H d]``, k, v ``[G d]``."""
    groups, rest = num_query_groups, qkv.shape[1:]
    q_rows_per_group = num_attention_heads // groups * head_dim
    grouped = qkv.reshape(groups, q_rows_per_group + 2 * head_dim, *rest)
    q, k, v = torch.split(grouped, [q_rows_per_group, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _expected_shape(key: ParamKey, model: ModelConfig) -> tuple[int, ...]:
    """Full shape of a Megatron parameter (vocabulary rows unpadded: ``V = model.vocab_size``)."""
    hidden, d = model.hidden_size, model.head_dim
    heads, groups = model.num_attention_heads, model.num_query_groups
    if model.architecture == "deepseek_v3":
        qk_head = model.qk_nope_head_dim + model.qk_rope_head_dim
        mla = {
            "mla_q_proj": (heads * qk_head, hidden),
            "mla_q_down": (model.q_lora_rank, hidden),
            "q_norm": (model.q_lora_rank,),
            "mla_q_up": (heads * qk_head, model.q_lora_rank),
            "mla_kv_down": (model.kv_lora_rank + model.qk_rope_head_dim, hidden),
            "kv_norm": (model.kv_lora_rank,),
            "mla_kv_up": (heads * (model.qk_nope_head_dim + model.v_head_dim), model.kv_lora_rank),
            "proj": (hidden, heads * model.v_head_dim),
        }
        if key.kind in mla:
            return mla[key.kind]
    return {
        "embedding": (model.vocab_size, hidden),
        "output": (model.vocab_size, hidden),
        "final_norm": (hidden,),
        "input_norm": (hidden,),
        "qkv_weight": ((heads + 2 * groups) * d, hidden),
        "qkv_bias": ((heads + 2 * groups) * d,),
        "proj": (hidden, heads * d),
        "q_norm": (d,),
        "k_norm": (d,),
        "post_attn_norm": (hidden,),
        "dense_fc1": (2 * model.ffn_hidden_size, hidden),
        "dense_fc2": (hidden, model.ffn_hidden_size),
        "router": (model.num_experts, hidden),
        "router_bias": (model.num_experts,),
        "expert_fc1": (2 * model.moe_ffn_hidden_size, hidden),
        "expert_fc2": (hidden, model.moe_ffn_hidden_size),
        "shared_fc1": (2 * model.shared_expert_intermediate_size, hidden),
        "shared_fc2": (hidden, model.shared_expert_intermediate_size),
        "shared_gate": (1, hidden),
    }[key.kind]


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...], what: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ConversionError(
            f"{name!r}: {what} has shape {tuple(shape)}, expected {tuple(expected)} for this model "
            "config; pass FULL (gathered, unsharded) tensors and the config of the checkpoint"
        )


def megatron_to_hf(
    global_name: str, full_tensor: torch.Tensor, model: ModelConfig
) -> list[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs of one full Megatron parameter.

    ``full_tensor`` is the one-process tensor (vocabulary rows may be padded to any ``V_pad >= V``;
    the padding is dropped). Returns views where possible (no copy); an empty list for the output
    layer of a tied-embedding model. Works on ``meta`` tensors, so shapes can be planned without
    data.
    """
    key = parse_megatron_name(global_name)
    _check_key(key, model, global_name)
    names = _hf_names(key, model)
    if not names:
        return []
    expected = _expected_shape(key, model)
    if key.kind in ("embedding", "output"):
        if full_tensor.dim() != 2 or full_tensor.shape[0] < model.vocab_size:
            _check_shape(global_name, full_tensor.shape, expected, "the Megatron tensor")
        full_tensor = full_tensor[: model.vocab_size]
    _check_shape(global_name, full_tensor.shape, expected, "the Megatron tensor")
    if key.kind in ("qkv_weight", "qkv_bias"):
        parts = split_qkv(
            full_tensor, model.num_attention_heads, model.num_query_groups, model.head_dim
        )
    elif key.kind in ("dense_fc1", "expert_fc1", "shared_fc1"):
        parts = torch.chunk(full_tensor, 2, dim=0)
    else:
        parts = (full_tensor,)
    return list(zip(names, parts))


def megatron_from_hf(
    global_name: str,
    get_hf_tensor: Callable[[str], torch.Tensor],
    model: ModelConfig,
    full_shape: Optional[tuple[int, ...]] = None,
) -> torch.Tensor:
    """Build one full Megatron parameter from HF tensors fetched by name.

    ``get_hf_tensor(hf_name)`` returns one HF tensor (for instance from a lazy ``safe_open``), so
    a rank reads only the tensors of the parameters it holds. ``full_shape`` is the one-process
    shape of the Megatron parameter; it sets the padded vocabulary ``V_pad`` (extra rows are
    zeros) and is checked for every other parameter.
    """
    key = parse_megatron_name(global_name)
    _check_key(key, model, global_name)
    names = hf_import_names_for(global_name, model)
    tensors = [get_hf_tensor(name) for name in names]
    if key.kind in ("qkv_weight", "qkv_bias"):
        heads, groups, d = model.num_attention_heads, model.num_query_groups, model.head_dim
        rest = tuple(tensors[0].shape[1:])
        for name, tensor, rows in zip(names, tensors, (heads * d, groups * d, groups * d)):
            _check_shape(name, tensor.shape, (rows, *rest), "the HF tensor")
        full = interleave_qkv(*tensors, num_query_groups=groups, head_dim=d)
    elif key.kind in ("dense_fc1", "expert_fc1", "shared_fc1"):
        gate, up = tensors
        half = _expected_shape(key, model)
        half = (half[0] // 2, *half[1:])
        _check_shape(names[0], gate.shape, half, "the HF tensor")
        _check_shape(names[1], up.shape, half, "the HF tensor")
        full = torch.cat([gate, up], dim=0)
    else:
        (full,) = tensors
        _check_shape(names[0], full.shape, _expected_shape(key, model), "the HF tensor")
    _check_shape(global_name, full.shape, _expected_shape(key, model), "the converted tensor")
    if key.kind in ("embedding", "output") and full_shape is not None:
        padding = full_shape[0] - full.shape[0]
        if padding < 0:
            raise ConversionError(
                f"{global_name!r}: the model's vocabulary ({full_shape[0]} rows) is smaller than "
                f"the HF checkpoint's ({full.shape[0]}); set model.vocab_size={full.shape[0]}"
            )
        if padding:
            full = torch.cat([full, full.new_zeros(padding, *full.shape[1:])], dim=0)
    if full_shape is not None:
        _check_shape(global_name, full.shape, tuple(full_shape), "the converted tensor")
    return full


def hf_storage_dtype(hf_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an HF checkpoint stores ``hf_name`` in: ``dtype``, except GLM-4.5's correction
    bias, float32 in every checkpoint (transformers keeps it in float32 whatever the model dtype;
    it shifts scores that differ by ~1e-3, below bf16's resolution near 0.5)."""
    return torch.float32 if hf_name.endswith(".e_score_correction_bias") else dtype


@functools.lru_cache(maxsize=65536)
def parameter_sort_key(global_name: str) -> tuple:
    """Order of a one-process Megatron name: embedding, decoder layers by (layer, expert), final
    norm, output layer. Every rank sorts the same names the same way."""
    if global_name.startswith("embedding."):
        return (0,)
    match = _LAYER_PREFIX.match(global_name)
    if match:
        expert = re.search(r"(?:local_experts\.(\d+)\.|weight(\d+)$)", match["rest"])
        index = -1 if expert is None else int(expert[1] or expert[2])
        return (1, int(match["layer"]), index, match["rest"])
    if global_name.startswith("decoder."):
        return (2, global_name)
    return (3, global_name)


# ---------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------


def megatron_parameter_shapes(
    model: ModelConfig, *, style: str = "local", padded_vocab_size: Optional[int] = None
) -> dict[str, tuple[int, ...]]:
    """Every parameter of the one-process Megatron model, in layer order, with its full shape.

    ``output_layer.weight`` is absent for tied embeddings (one process shares the embedding).
    """
    vocab = padded_vocab_size or model.vocab_size
    keys: list[ParamKey] = [ParamKey("embedding")]
    table = LAYER_TABLES[model.architecture]
    for layer in range(model.num_layers):
        if model.architecture == "deepseek_v3":
            kinds = ["input_norm"]
            if model.q_lora_rank is None:
                kinds += ["mla_q_proj"]
            else:
                kinds += ["mla_q_down", "q_norm", "mla_q_up"]
            kinds += ["mla_kv_down", "kv_norm", "mla_kv_up"]
        else:
            kinds = ["input_norm", "qkv_weight"]
            kinds += ["qkv_bias"] if model.add_qkv_bias else []
            kinds += ["q_norm", "k_norm"] if model.qk_layernorm else []
        kinds += ["proj", "post_attn_norm"]
        if layer not in model.moe_layer_indices:
            kinds += ["dense_fc1", "dense_fc2"]
            keys += [ParamKey(kind, layer) for kind in kinds]
            continue
        keys += [ParamKey(kind, layer) for kind in kinds + ["router"]]
        if "router_bias" in table:
            keys.append(ParamKey("router_bias", layer))
        for expert in range(model.num_experts):
            keys += [ParamKey(kind, layer, expert) for kind in ("expert_fc1", "expert_fc2")]
        if model.shared_expert_intermediate_size:
            shared = ("shared_fc1", "shared_fc2")
            shared += ("shared_gate",) if "shared_gate" in table else ()
            keys += [ParamKey(kind, layer) for kind in shared]
    keys.append(ParamKey("final_norm"))
    if not model.tie_word_embeddings:
        keys.append(ParamKey("output"))
    shapes = {}
    for key in keys:
        if key.layer is not None and key.kind not in table:
            raise ConversionError(
                f"the {model.architecture} HF architecture has no {key.kind} (check "
                "model.qk_layernorm and model.add_qkv_bias)"
            )
        shape = _expected_shape(key, model)
        if key.kind in ("embedding", "output"):
            shape = (vocab, *shape[1:])
        shapes[megatron_name(key, style=style, mla=model.architecture == "deepseek_v3")] = shape
    return shapes


def hf_parameter_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``model`` (on-disk names) with its shape."""
    shapes = {}
    for name, shape in megatron_parameter_shapes(model).items():
        for hf_name, tensor in megatron_to_hf(name, torch.empty(shape, device="meta"), model):
            shapes[hf_name] = tuple(tensor.shape)
    return shapes
