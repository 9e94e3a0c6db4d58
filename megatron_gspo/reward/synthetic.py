"""Reward of the built-in synthetic digit tasks (definition in :mod:`megatron_gspo.data.synthetic`)."""

from __future__ import annotations

from megatron_gspo.data.synthetic import response_ids_from_text, score_digit_response
from megatron_gspo.reward.functions import RewardInput


def synthetic_reward(sample: RewardInput) -> float:
    """Mean over the answer's 8 positions of 1 (right digit), 0.1 (wrong digit) or 0 (no digit),
    on the response token ids (on the response text when the engine gave no ids)."""
    if sample.answer is None:
        raise ValueError("the synthetic reward needs the answer digits (sample.answer is None)")
    if sample.response_ids:
        response_ids = list(sample.response_ids)
    else:
        response_ids = response_ids_from_text(sample.response)
    return score_digit_response(response_ids, sample.answer)
