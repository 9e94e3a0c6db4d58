"""The float32 twin that chooses a lower-precision embedded engine's experts
(``rollout.embedded_route_source=float32_twin``).

The twin is a float32 copy of the engine's model: built from the same weights, loaded by every
weight sync of the engine, run first at every forward of the engine (the prefill and each decode
step, with a KV cache of its own) on the same inputs. Its routers' top-k expert ids are what the
engine's routers are then forced to (:class:`~megatron_gspo.rollout.route_forcing.RouteForcer`).
A float32 transformers forward agrees with the fp32 trainer to float rounding (the fp32 engine's
trainer-vs-engine k3 KL is ~1e-14), so these are the trainer's routes: a bfloat16 engine with
them keeps its precision's mismatch without the routing flips (docs/compare_grpo_gspo.md,
"Mismatch attribution"; Routing Replay R3 does the reverse, the engine's routes in the trainer).

Only the decoder runs (the routes are all it gives); the output layer is skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch

from megatron_gspo.config import ModelConfig
from megatron_gspo.rollout.hf_model import RouteRecorder, build_hf_model
from megatron_gspo.rollout.weight_loader import HFWeightLayout, StagedWeights


class Float32RouteTwin:
    """A float32 copy of the policy whose forwards give routes.

    Args:
        model_config: the engine's architecture.
        seed: initialises the random weights, as :func:`build_hf_model` does for the engine
            (whose reduced-precision weights are then these, cast).
        weights: on-disk HF tensors to start from instead (the engine's, when it was given a
            model), cast to float32.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        seed: int = 0,
        weights: Optional[Iterable[tuple[str, torch.Tensor]]] = None,
    ):
        self.hf_model = build_hf_model(model_config, dtype=torch.float32, seed=seed)
        self.layout = HFWeightLayout(self.hf_model)
        if weights is not None:
            self.layout.load(weights)
        self._recorder = RouteRecorder(self.hf_model).__enter__()

    def new_cache(self) -> Any:
        """An empty KV cache for one batch's generation."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf_model.config)

    def routes(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        cache: Any = None,
    ) -> list[torch.Tensor]:
        """Per MoE layer the ``[B, S, K]`` expert ids of one forward of ``input_ids`` ``[B, S]``
        (with ``cache``: a generation step that extends it; without: a whole-sequence forward).
        Callers hold the engine's model lock and inference mode."""
        batch_size, seq_len = input_ids.shape
        self.hf_model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=cache is not None,
        )
        return self._recorder.pop(batch_size, seq_len)

    def tap(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], kept: list, *, borrow: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass a weight stream through, keeping each tensor in ``kept`` for :meth:`stage`: a
        float32 copy (the producer may reuse its tensor once yielded), or, with ``borrow`` (a
        stable stream), the tensor itself. The stream is read once, for the engine and the
        twin."""
        for name, tensor in named_tensors:
            kept.append((name, tensor if borrow else tensor.detach().to(torch.float32, copy=True)))
            yield name, tensor

    def stage(self, kept: list) -> StagedWeights:
        """The tensors :meth:`tap` kept, checked and staged (by reference: they are the twin's
        own copies or a stable stream's) for :meth:`commit`."""
        staged, _, _ = self.layout.stage(kept, borrow=True)
        return staged

    def commit(self, staged: StagedWeights) -> None:
        """Load staged weights (under the engine's model lock, with the engine's own commit)."""
        self.layout.commit(staged)
