"""The sample that travels from rollout to the training engine (torch only, no Megatron).

Shapes: ``L`` = prompt + response tokens of one sample, ``R`` = response tokens, ``K`` = experts
per token (top-k), ``M`` = MoE layers. Log-probs follow the next-token convention: entry ``j`` of a
response tensor is the log-prob of response token ``j`` (the model's prediction at position
``prompt_length + j - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class TrainSample:
    """One prompt + response, with everything the policy update needs."""

    tokens: torch.Tensor
    """``[L]`` int64 prompt followed by response token ids."""
    prompt_length: int
    """Number of prompt tokens at the start of ``tokens``."""
    group_id: int = 0
    """Index of the sample's prompt in the rollout batch (its GRPO group)."""
    advantages: Optional[torch.Tensor] = None
    """``[]`` (one per sequence) or ``[R]`` (per token) float32."""
    loss_mask: Optional[torch.Tensor] = None
    """``[R]`` bool; None means every response token counts."""
    old_log_probs: Optional[torch.Tensor] = None
    """``[R]`` float32 log-probs under the sampling (old) policy at the rollout temperature."""
    rollout_log_probs: Optional[torch.Tensor] = None
    """``[R]`` float32 log-probs reported by the rollout engine: the behaviour policy ``mu`` that
    sampled each token (with partial rollouts, tokens of one sample come from several weight
    versions; each log-prob is the one of the version that sampled its token)."""
    rollout_weight_versions: Optional[torch.Tensor] = None
    """``[R]`` int64 weight version that sampled each response token (None when the engine does
    not report it); ``weight_version`` is the oldest."""
    ref_log_probs: Optional[torch.Tensor] = None
    """``[R]`` float32 log-probs under the frozen reference policy."""
    teacher_log_probs: Optional[torch.Tensor] = None
    """``[R]`` float32 log-probs of the response tokens under the distillation teacher
    (teacher-forced through its engine, at the rollout temperature; ``algo.distillation``)."""
    rollout_routes: Optional[torch.Tensor] = None
    """``[L - 1, M, K]`` uint8/int16 expert ids per token and MoE layer from the rollout engine
    (its last token never ran forward, so there are L - 1 rows; format: :mod:`megatron_gspo.
    routes`). R3 replays them."""
    rollout_route_weights: Optional[torch.Tensor] = None
    """``[L - 1, M, K]`` float32: the combine weights the rollout engine's routers gave
    ``rollout_routes`` (after renormalisation and scaling, what multiplied each expert's output),
    in the same order; the embedded engine reports them when asked (R3 with
    ``algo.routing_replay_weights=replayed``, which replays them as constants)."""
    old_routes: Optional[torch.Tensor] = None
    """``[L - 1, M, K]`` the old policy's native routes, recorded by the training engine's
    old-log-prob forward (``forward_log_probs(record_routes=True)``). R2 replays them; they are
    the reference of ``routing_change_frac``."""
    old_route_weights: Optional[torch.Tensor] = None
    """``[L - 1, M, K]`` float32: the combine weights the old-log-prob forward gave
    ``old_routes`` (renormalised and scaled, what multiplies each expert's output), recorded with
    them when ``algo.routing_replay_weights=replayed``; R2 then replays them as constants."""
    turns: Optional[torch.Tensor] = None
    """``[R]`` int16: the model turn (0, 1, ...) of each response token, -1 for an environment's
    observation tokens (context, never trained on: their loss mask is False). None for a single
    completion (every response token belongs to turn 0)."""
    turn_rewards: Optional[torch.Tensor] = None
    """``[K]`` float64: the environment's reward part of each of the K model turns (0 for a turn
    it never answered). ``reward`` minus their sum is the outcome part (reward functions, length
    shaping), which per-turn advantages count at the last turn. None for a single completion."""
    reward: float = 0.0
    finish_reason: str = "stop"
    weight_version: int = 0
    """The oldest weight version that sampled a token of the response."""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def response_length(self) -> int:
        return int(self.tokens.numel()) - self.prompt_length

    def response_mask(self) -> torch.Tensor:
        """``[R]`` bool mask of the tokens that enter the loss."""
        if self.loss_mask is not None:
            return self.loss_mask.bool()
        return torch.ones(self.response_length, dtype=torch.bool)
