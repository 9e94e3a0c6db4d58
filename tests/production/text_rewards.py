"""Reward functions of the agent reward tests, loaded by import path: simple counts of the
response's text, so that a test can recompute them on its own."""

from megatron_gspo.reward import RewardInput


def characters(sample: RewardInput) -> float:
    return len(sample.response) / 100


def digits(sample: RewardInput) -> float:
    return float(sum(character.isdigit() for character in sample.response))


def always_fails(sample: RewardInput) -> float:
    raise RuntimeError("stand-in reward failure")
