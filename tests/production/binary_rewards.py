"""Reward functions of the production tests, loaded by import path (also in worker processes)."""

from megatron_gspo.reward import RewardInput


def first_digit_is_even(sample: RewardInput) -> float:
    """1 when the response starts with an even digit: about half of an untrained model's
    responses on the synthetic task, so groups of two are all-equal half of the time."""
    ids = list(sample.response_ids)
    return float(bool(ids) and ids[0] <= 9 and ids[0] % 2 == 0)


def constant(sample: RewardInput) -> float:
    return 0.5
