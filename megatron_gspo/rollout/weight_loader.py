"""Loading on-disk Hugging Face tensors into a transformers 5 model, strictly and atomically.

Weights travel under their ON-DISK HF names (what ``save_pretrained`` writes and what SGLang's
loaders accept): ``...mlp.experts.{e}.gate_proj.weight`` etc., and for Mixtral
``...block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and ``...block_sparse_moe.gate.weight``.
transformers 5 packs the experts in memory (``conversion_mapping.py`` of transformers 5.23,
entries ``qwen2_moe`` — shared by ``qwen3_moe`` — and ``mixtral``)::

    mlp.experts.gate_up_proj [E, 2F, H]:  [e, :F] = gate_e (w1),  [e, F:] = up_e (w3)
    mlp.experts.down_proj    [E, H, F]:   [e]     = down_e (w2)
    Mixtral: ".block_sparse_moe." -> ".mlp."

GLM-4.5 (``glm4_moe``) packs its routed experts the same way; its routers' score-correction
bias (``mlp.gate.e_score_correction_bias``) is a buffer, not a parameter, and is loaded like
one: it decides which experts a token selects (``docs/glm4-moe.md``).

A load is staged: every tensor is checked (known name, not seen before, exact shape) and copied
into a staging buffer; the model's parameters change only after the whole set has arrived, so a
bad stream (an unknown, repeated, mis-shaped or missing tensor, or a producer that raises midway)
leaves the model untouched. Staging costs one model's worth of memory; a producer whose tensors
stay valid and unchanged until the load ends (views of another live model that nothing updates
meanwhile, the trainer's weight stream) may be staged by reference instead (``borrow=True``):
the same checks, the same all-or-nothing commit, no staging copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class _Target:
    """Where one on-disk tensor lives in memory: ``param[expert, rows]`` (or the whole param)."""

    param_name: str
    expert: int | None = None
    rows: slice | None = None


def _expert_names(layer_prefix: str, expert: int, mixtral: bool) -> tuple[str, str, str]:
    """On-disk (gate, up, down) names of one expert of the MoE block at ``layer_prefix``."""
    if mixtral:
        base = f"{layer_prefix}.block_sparse_moe.experts.{expert}"
        return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"
    base = f"{layer_prefix}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


@dataclass
class StagedWeights:
    """A checked, complete weight set waiting for :meth:`HFWeightLayout.commit`."""

    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Copies, one buffer per parameter (``borrow=False``)."""
    borrowed: list[tuple[_Target, torch.Tensor]] = field(default_factory=list)
    """The producer's own tensors and where each goes (``borrow=True``)."""


class HFWeightLayout:
    """The map from on-disk HF names to the in-memory parameters of one transformers model."""

    def __init__(self, hf_model: Any):
        self.parameters: dict[str, torch.Tensor] = dict(hf_model.named_parameters())
        self.parameters.update(
            (name, buffer)
            for name, buffer in hf_model.named_buffers()
            if name.endswith(".mlp.gate.e_score_correction_bias")
        )
        mixtral = hf_model.config.model_type == "mixtral"
        self.targets: dict[str, _Target] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, param in self.parameters.items():
            if name.endswith(".mlp.experts.down_proj"):
                continue  # mapped together with gate_up_proj below
            if name.endswith(".mlp.experts.gate_up_proj"):
                self._add_packed_experts(name, mixtral)
                continue
            disk_name = name
            if mixtral and ".mlp." in name:
                disk_name = name.replace(".mlp.", ".block_sparse_moe.")
            self.targets[disk_name] = _Target(name)
            self.shapes[disk_name] = tuple(param.shape)

    def _add_packed_experts(self, gate_up_name: str, mixtral: bool) -> None:
        down_name = gate_up_name.replace("gate_up_proj", "down_proj")
        gate_up, down = self.parameters[gate_up_name], self.parameters[down_name]
        num_experts, two_ffn, hidden = gate_up.shape
        ffn = two_ffn // 2
        if tuple(down.shape) != (num_experts, hidden, ffn) or two_ffn != 2 * ffn:
            raise RuntimeError(
                f"unexpected packed expert layout {gate_up_name} {tuple(gate_up.shape)} / "
                f"{down_name} {tuple(down.shape)}; this loader knows transformers 5.x's "
                "[E, 2F, H] / [E, H, F]"
            )
        layer_prefix = gate_up_name[: -len(".mlp.experts.gate_up_proj")]
        for expert in range(num_experts):
            gate, up, down_disk = _expert_names(layer_prefix, expert, mixtral)
            self.targets[gate] = _Target(gate_up_name, expert, slice(0, ffn))
            self.targets[up] = _Target(gate_up_name, expert, slice(ffn, two_ffn))
            self.targets[down_disk] = _Target(down_name, expert)
            self.shapes[gate] = self.shapes[up] = (ffn, hidden)
            self.shapes[down_disk] = (hidden, ffn)

    @property
    def disk_names(self) -> list[str]:
        return sorted(self.targets)

    def view(self, tensor: torch.Tensor, target: _Target) -> torch.Tensor:
        """The part of ``tensor`` (a parameter or its staging copy) that ``target`` names."""
        if target.expert is None:
            return tensor
        if target.rows is None:
            return tensor[target.expert]
        return tensor[target.expert, target.rows]

    def disk_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors under their on-disk names (views, no copies), sorted by name."""
        for disk_name in self.disk_names:
            target = self.targets[disk_name]
            yield disk_name, self.view(self.parameters[target.param_name], target)

    def load(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, borrow: bool = False
    ) -> tuple[int, int]:
        """Stage then commit a complete set of on-disk tensors; ``(num_tensors, num_bytes)``."""
        staged, num_tensors, num_bytes = self.stage(named_tensors, borrow=borrow)
        self.commit(staged)
        return num_tensors, num_bytes

    def stage(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, borrow: bool = False
    ) -> tuple[StagedWeights, int, int]:
        """Check a complete set of on-disk tensors and stage it for :meth:`commit` (model untouched).

        Returns ``(staged weights, num_tensors, num_bytes)``. Raises ``ValueError`` naming the
        tensor for an unknown, repeated or mis-shaped name, and listing the missing names at the
        end; an exception of the producer propagates. Either way nothing was written to the
        model. Tensors are cast to the parameter dtype (exact for equal dtypes).

        ``borrow=False`` copies each tensor on arrival into a staging buffer the shape of its
        parameter (one model's worth of memory until :meth:`commit`), so the producer may reuse
        or change its tensors as soon as it has yielded them. ``borrow=True`` keeps references
        instead (no staging memory): every tensor must stay valid and unchanged until
        :meth:`commit` has returned, which a :class:`StableTensorStream` promises.
        """
        staged = StagedWeights()
        seen: set[str] = set()
        num_bytes = 0
        for disk_name, tensor in named_tensors:
            target = self.targets.get(disk_name)
            if target is None:
                raise ValueError(
                    f"weight sync: unknown tensor {disk_name!r}. {self._hint(disk_name)}"
                )
            if disk_name in seen:
                raise ValueError(f"weight sync: tensor {disk_name!r} arrived twice")
            if tuple(tensor.shape) != self.shapes[disk_name]:
                raise ValueError(
                    f"weight sync: tensor {disk_name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {self.shapes[disk_name]} (check the model config against the sender)"
                )
            seen.add(disk_name)
            if borrow:
                staged.borrowed.append((target, tensor.detach()))
            else:
                buffers = staged.buffers
                if target.param_name not in buffers:
                    buffers[target.param_name] = torch.empty_like(
                        self.parameters[target.param_name]
                    )
                with torch.no_grad():
                    self.view(buffers[target.param_name], target).copy_(tensor.detach())
            num_bytes += tensor.numel() * tensor.element_size()
        missing = sorted(set(self.targets) - seen)
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise ValueError(
                f"weight sync: {len(missing)} of {len(self.targets)} tensors missing: {shown}; "
                "a sync must carry every parameter (the embedded engine loads full state only)"
            )
        return staged, len(seen), num_bytes

    def commit(self, staged: StagedWeights) -> None:
        """Copy the staged weights into the parameters (in place: views of them stay valid).

        :meth:`stage` accepted the set only if every on-disk name arrived, so gate+up halves and
        all experts of a packed parameter are covered and each buffer is fully written.
        """
        with torch.no_grad():
            for param_name, buffer in staged.buffers.items():
                self.parameters[param_name].copy_(buffer)
            for target, tensor in staged.borrowed:
                self.view(self.parameters[target.param_name], target).copy_(tensor)

    def _hint(self, disk_name: str) -> str:
        if disk_name == "lm_head.weight" and "lm_head.weight" not in self.parameters:
            return "The model ties its embeddings: send model.embed_tokens.weight only."
        if ".experts." in disk_name and not any(
            part.isdigit() for part in disk_name.split(".")[-3:]
        ):
            return "Expert weights must use the per-expert on-disk names (experts.N.gate_proj...)."
        return "Names must be on-disk Hugging Face names of this architecture."


def iter_safetensors_directory(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors of every ``*.safetensors`` file of an HF checkpoint directory.

    Files listed in ``model.safetensors.index.json`` when it exists, else all ``*.safetensors``
    files in sorted order. Raises ``FileNotFoundError`` naming the directory when there are none.
    """
    from safetensors.torch import safe_open

    if not os.path.isdir(path):
        raise FileNotFoundError(f"weight directory {path!r} does not exist")
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as index_file:
            files = sorted(set(json.load(index_file)["weight_map"].values()))
    else:
        files = sorted(name for name in os.listdir(path) if name.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    for file_name in files:
        with safe_open(os.path.join(path, file_name), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield key, handle.get_tensor(key)
