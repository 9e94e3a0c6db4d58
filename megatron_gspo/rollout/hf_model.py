"""The policy as a ``transformers`` model, and the recorder of its routers' choices.

transformers 5 MoE routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
GLM-4.5's ``Glm4MoeTopkRouter``, DeepSeek-V3's ``DeepseekV3TopkRouter``) return ``(router_logits, top_k_weights, top_k_indices)``
(GLM-4.5: the indices selected by sigmoid scores plus the correction bias, within the chosen
groups; the weights renormalised and scaled); a forward hook on each MoE layer's
``mlp.gate`` reads the indices, which are logical expert ids (no expert-parallel remap exists in
a single-process HF model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.convert.hf_config import hf_config_from_model_config


def build_hf_model(
    model_config: ModelConfig, *, dtype: torch.dtype = torch.float32, seed: Optional[int] = None
) -> Any:
    """A randomly initialised ``transformers`` causal LM with the architecture of ``model_config``.

    SDPA attention, eval mode, gradients off. ``seed`` fixes the initialisation; weights
    normally arrive later by ``sync_weights``.
    """
    import transformers

    config = hf_config_from_model_config(model_config)
    # SDPA rather than eager: one fused kernel instead of repeat_kv + two matmuls + softmax per
    # layer (eager decoding was ~10% slower than transformers' generate on the vs-TRL job), and
    # no [B, heads, q, kv] mask is built when nothing is padded. Reproducibility holds: its CPU
    # kernel is deterministic for a given batch (tests/rollout/test_embedded.py: same seeds give
    # the same tokens, log-probs and routes bit for bit), and it agrees with the trainer to fp32
    # rounding (log-probs within 1e-5 of a float64 eager forward; tests/engine routing replay:
    # R3 rollout log-probs within 2e-5 of Megatron's, 5e-6 measured vs 4e-6 with eager).
    config._attn_implementation = "sdpa"
    model_class = getattr(transformers, config.architectures[0])
    if seed is None:
        model = model_class(config)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config)
    model = model.to(dtype=dtype).eval()
    for name, buffer in model.named_buffers():
        # GLM-4.5's and DeepSeek-V3's correction bias stays float32 in every dtype, as from_pretrained keeps it
        # (_keep_in_fp32_modules_strict) and as the trainer keeps Megatron's expert_bias.
        if name.endswith(".mlp.gate.e_score_correction_bias"):
            buffer.data = buffer.data.float()
    model.requires_grad_(False)
    return model


def decoder_layers(hf_model: Any) -> list[Any]:
    """The decoder layers of a ``*ForCausalLM`` model."""
    return list(hf_model.model.layers)


def moe_layer_indices(hf_model: Any) -> list[int]:
    """Indices of the decoder layers whose MLP routes to experts (dense layers skipped)."""
    return [
        index
        for index, layer in enumerate(decoder_layers(hf_model))
        if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")
    ]


class RouteRecorder:
    """Records the top-k expert ids chosen by every MoE router during forwards.

    Usage::

        with RouteRecorder(model) as recorder:
            model(...)
            routes = recorder.pop()   # list over MoE layers of [B, S, K] int64

    Each forward appends one ``[num_tokens, K]`` tensor per MoE layer; :meth:`pop` returns them
    reshaped to the forward's ``[B, S]`` and clears the buffer. The hooks see every forward of
    the model, so callers that share a model serialise forward + pop (the embedded engine does
    under its model lock) and switch :attr:`enabled` off when they need no routes.
    """

    def __init__(self, hf_model: Any, enabled: bool = True):
        self.hf_model = hf_model
        self.enabled = enabled
        self.record_weights = False
        """Also record each router's top-k weights (:meth:`pop_weights`): the second output of
        the supported routers, what their MoE block multiplies the experts' outputs by."""
        self.layer_indices = moe_layer_indices(hf_model)
        self._records: list[list[torch.Tensor]] = [[] for _ in self.layer_indices]
        self._weight_records: list[list[torch.Tensor]] = [[] for _ in self.layer_indices]
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        layers = decoder_layers(self.hf_model)
        for slot, layer_index in enumerate(self.layer_indices):
            gate = layers[layer_index].mlp.gate
            self._handles.append(gate.register_forward_hook(self._hook(slot)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, slot: int):
        def record(module: Any, inputs: Any, output: Any) -> None:
            if not self.enabled:
                return
            if not isinstance(output, tuple) or len(output) != 3:
                raise RuntimeError(
                    f"router {type(module).__name__} returned {type(output).__name__}; expected "
                    "(router_logits, top_k_weights, top_k_indices) as in transformers 5"
                )
            self._records[slot].append(output[2].detach())
            if self.record_weights:
                # A bf16 / fp16 router's weights convert to float32 exactly.
                self._weight_records[slot].append(output[1].detach().float())

        return record

    def pop(self, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """Per MoE layer ``[batch_size, seq_len, K]`` ids of the last forward, then clear."""
        return self._take(self._records, batch_size, seq_len, "router calls")

    def pop_weights(self, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """Per MoE layer ``[batch_size, seq_len, K]`` float32 top-k weights of the last forward
        (recorded with :attr:`record_weights`), in the order of the ids :meth:`pop` returns,
        then clear."""
        return self._take(
            self._weight_records,
            batch_size,
            seq_len,
            "router weights",
            " (record_weights on for the forward)",
        )

    def _take(
        self,
        per_layer: list[list[torch.Tensor]],
        batch_size: int,
        seq_len: int,
        what: str,
        hint: str = "",
    ) -> list[torch.Tensor]:
        """The one record of each MoE layer as ``[batch_size, seq_len, K]``, then clear."""
        taken = []
        for slot, records in enumerate(per_layer):
            if len(records) != 1:
                raise RuntimeError(
                    f"MoE layer {self.layer_indices[slot]} recorded {len(records)} {what} "
                    f"in one forward; expected exactly 1{hint}"
                )
            taken.append(records[0].reshape(batch_size, seq_len, -1))
            records.clear()
        return taken


def forward_with_routes(hf_model: Any, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced forward of ``tokens`` (length S): float32 logits ``[S, V]`` and the
    routers' top-k ids ``[S, moe_layers, K]``, the reference that engines' log-probs and R3
    routes are checked against (SGLang's R3 layout for prompt + response tokens is this forward
    over all tokens but the last)."""
    with RouteRecorder(hf_model) as recorder, torch.no_grad():
        logits = hf_model(torch.tensor([list(tokens)])).logits[0].float()
        routes = torch.stack(recorder.pop(1, len(tokens)), dim=2)[0]
    return logits, routes
