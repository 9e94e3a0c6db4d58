"""The environment rollout (``production/episodes.py``) with the embedded engine: token in / token out,
masks, log-probs, routes per turn, limits, failures, and equality with one completion per
sample."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_gspo.engine.batches import validate_samples
from megatron_gspo.envs.single_turn import SingleTurnEnvironment
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.single_turn import SingleTurnProducer
from megatron_gspo.production.task import Task
from megatron_gspo.reward import RewardRunner

from .conftest import EOS, OBS, RecordingEngine, environment_producer, prompts, train_config
from .scripted import ScriptedEnvironment


def produce(engine, tokenizer, cfg, factory=ScriptedEnvironment, batch=None, step=0):
    task = Task(tokenizer, None, [], EOS)
    rewards = RewardRunner(cfg.reward) if cfg.reward.functions else None
    try:
        producer = environment_producer(engine, task, rewards, cfg, factory)
        return producer.produce(batch or prompts(), step)
    finally:
        if rewards is not None:
            rewards.close()


def turn_calls(recording: RecordingEngine, sample_tokens: list[int]):
    """The (request, result) pairs of one trajectory, turn by turn: the calls whose input is a
    prefix of the trajectory."""
    found = []
    for call in recording.calls:
        for request, result in call:
            ids = list(request.input_ids)
            if sample_tokens[: len(ids)] == ids and (
                sample_tokens[len(ids) : len(ids) + len(result.output_ids)]
                == list(result.output_ids)
            ):
                found.append((request, result))
                break
    return found


@pytest.fixture(scope="module")
def three_turns(embedded, tokenizer):
    """Three-turn episodes (observation ``<obs> ab``, turn rewards 0.1 k), turns ending at
    ``c`` or ``<eos>``; R3 routes."""
    recording = RecordingEngine(embedded)
    cfg = train_config(
        env={"options": {"observation": [OBS, 10], "stop_token_ids": [2], "turn_reward": 0.1}},
        algo={"response_length": 40},
    )
    return recording, produce(recording, tokenizer, cfg)


def test_the_trajectory_is_exactly_what_the_engine_saw_and_made(three_turns, tokenizer):
    recording, scored = three_turns
    round_trips_differ = False
    for sample in scored.samples:
        tokens = sample.tokens.tolist()
        calls = turn_calls(recording, tokens)
        assert len(calls) == 3, sample  # one engine call per turn
        for (request, result), (following, _) in zip(calls, calls[1:]):
            # The next turn's input is this turn's input, its output and the observation, as ids.
            assert list(following.input_ids) == [
                *request.input_ids,
                *result.output_ids,
                OBS,
                10,
            ]
        last_request, last_result = calls[-1]
        assert tokens == [*last_request.input_ids, *last_result.output_ids]
        for _, result in calls:
            text = tokenizer.decode(result.output_ids)
            round_trips_differ |= tokenizer.encode(text, add_special_tokens=False) != list(
                result.output_ids
            )
    # Decoding and encoding again would have changed some turn: the test would catch it.
    assert round_trips_differ


def test_loss_mask_log_probs_turns_and_rewards(three_turns):
    recording, scored = three_turns
    for sample in scored.samples:
        tokens = sample.tokens.tolist()
        calls = turn_calls(recording, tokens)
        mask = torch.zeros(sample.response_length, dtype=torch.bool)
        log_probs = torch.zeros(sample.response_length)
        turns = torch.full((sample.response_length,), -1, dtype=torch.int16)
        for index, (request, result) in enumerate(calls):
            start = len(request.input_ids) - sample.prompt_length
            end = start + len(result.output_ids)
            mask[start:end] = True
            log_probs[start:end] = torch.from_numpy(result.output_log_probs)
            turns[start:end] = index
        assert torch.equal(sample.loss_mask, mask)  # observations are context
        assert torch.equal(sample.rollout_log_probs, log_probs)
        assert torch.equal(sample.turns, turns)
        # A last turn cut by the response budget never reached the environment: no reward.
        finished = sample.finish_reason == "stop"
        expected = [0.1, 0.2, 0.3 if finished else 0.0]
        assert sample.turn_rewards.tolist() == pytest.approx(expected)
        assert sample.reward == pytest.approx(sum(expected))
    done = [s.finish_reason == "stop" for s in scored.samples]
    assert any(done)
    metrics = scored.metrics
    assert metrics["env/turns_mean"] == 3.0 and metrics["env/done_frac"] == sum(done) / len(done)
    assert metrics["env/truncated_budget_frac"] == 1 - metrics["env/done_frac"]
    assert metrics["env/observation_tokens_mean"] == 4.0  # two observations of two tokens


def test_each_turn_keeps_the_routes_it_was_generated_with(embedded, tokenizer):
    """New weights land between turns (as an asynchronous update would): the rows of turn 0
    are turn 0's routes, not the next turn's prefill of the same tokens (verl issue 6054);
    observation rows (and the row of the token before them) come from the next turn's prefill;
    every row exactly once."""

    def perturb(engine):
        state = {name: tensor.clone() for name, tensor in engine.hf_state()}
        generator = torch.Generator().manual_seed(len(recording.calls))
        for name, tensor in state.items():
            if "gate.weight" in name:  # the routers
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 2.0)
        engine.sync_weights(iter(state.items()), engine.weight_version + 1)

    recording = RecordingEngine(embedded, between_calls=perturb)
    cfg = train_config(env={"options": {"turns": 2, "observation": [OBS, 10, 11]}})
    scored = produce(recording, tokenizer, cfg)
    differs = False
    for sample in scored.samples:
        calls = turn_calls(recording, sample.tokens.tolist())
        assert len(calls) == 2
        (first, first_result), (second, second_result) = calls
        routes = sample.rollout_routes.numpy()
        assert routes.shape[0] == sample.tokens.numel() - 1
        turn_0_rows = len(first.input_ids) + len(first_result.output_ids) - 1
        np.testing.assert_array_equal(routes[:turn_0_rows], first_result.routed_experts)
        np.testing.assert_array_equal(
            routes[turn_0_rows:], second_result.routed_experts[turn_0_rows:]
        )
        differs |= not np.array_equal(
            first_result.routed_experts, second_result.routed_experts[:turn_0_rows]
        )
        assert sample.weight_version == first_result.weight_version  # the oldest turn's
        assert second_result.weight_version > first_result.weight_version
    assert differs, "the next turn's prefill routed the same: the test shows nothing"


def test_the_turn_limit_truncates(embedded, tokenizer):
    cfg = train_config(
        env={"max_turns": 2, "options": {"turns": 5, "stop_token_ids": [2, 3]}},
        algo={"response_length": 80},
    )
    scored = produce(embedded, tokenizer, cfg)
    for sample in scored.samples:
        assert sample.finish_reason == "length"
        assert int(sample.turns.max()) == 1
        # The observation after the last turn is not appended: the trajectory ends with a turn.
        assert sample.loss_mask[-1]
    assert scored.metrics["env/truncated_max_turns_frac"] == 1.0
    assert scored.metrics["env/truncated_frac"] == 1.0


def test_the_per_turn_token_limit_truncates(embedded, tokenizer):
    cfg = train_config(env={"max_tokens_per_turn": 2, "options": {"turns": 3}})
    scored = produce(embedded, tokenizer, cfg)
    cut = [s for s in scored.samples if s.finish_reason == "length"]
    assert cut, "every turn stopped before 2 tokens: the test shows nothing"
    for sample in cut:
        last_turn = sample.turns == sample.turns.max()
        assert int(last_turn.sum()) == 2
    assert scored.metrics["env/truncated_turn_tokens_frac"] == len(cut) / len(scored.samples)


def test_the_response_budget_truncates_and_drops_what_does_not_fit(embedded, tokenizer):
    cfg = train_config(
        # Turns end at almost any token; six-token observations; 20 tokens in all.
        env={"options": {"turns": 9, "observation": [OBS] * 6, "stop_token_ids": list(range(12))}},
        algo={"response_length": 20},
    )
    scored = produce(embedded, tokenizer, cfg)
    for sample in scored.samples:
        assert sample.response_length <= 20
        assert sample.finish_reason == "length"
        assert sample.loss_mask[-1]  # ends with a model turn, never a cut observation
    assert scored.metrics["env/truncated_budget_frac"] == 1.0


def test_a_failing_environment_aborts_its_trajectory_and_is_counted(embedded, tokenizer):
    cfg = train_config(
        env={"options": {"turns": 3, "fail_at": 1, "stop_token_ids": list(range(12))}}
    )
    scored = produce(embedded, tokenizer, cfg)
    for sample in scored.samples:
        assert sample.finish_reason == "abort"
        assert not sample.loss_mask.any()
        assert sample.group_id < 0  # a group of its own
    assert scored.metrics["env/step_errors"] == len(scored.samples)


def test_a_failed_reset_aborts_its_trajectory_with_a_masked_response(embedded, tokenizer):
    """An environment whose ``reset`` raises never reaches the engine: its sample is the prompt
    and one masked filler token (every trained sample needs a response token), out of the loss,
    and the batch still passes the training engine's checks."""
    cfg = train_config(env={"options": {"fail_at": "reset"}})
    scored = produce(embedded, tokenizer, cfg)
    for sample in scored.samples:
        assert sample.finish_reason == "abort" and sample.group_id < 0
        assert sample.response_length == 1 and not sample.loss_mask.any()
    assert scored.metrics["env/step_errors"] == len(scored.samples)
    validate_samples(scored.samples, need_old=False, need_advantages=False, need_ref=False)


def test_the_single_turn_environment_makes_the_single_turn_samples(embedded, tokenizer):
    """One turn, scored by the reward functions: exactly the samples of one completion per
    sample (same seeds, tokens, log-probs, routes, rewards)."""
    cfg = train_config(
        reward={"functions": ["tests.production.binary_rewards:first_digit_is_even"]}
    )
    batch = prompts(3)
    task = Task(tokenizer, None, [], EOS)
    with RewardRunner(cfg.reward) as rewards:
        single = (
            SingleTurnProducer(embedded, task, rewards, Sampling.training(cfg))
            .produce(batch, 4)
            .samples
        )
        turns = (
            environment_producer(embedded, task, rewards, cfg, SingleTurnEnvironment)
            .produce(batch, 4)
            .samples
        )
    assert len(single) == len(turns) == 6
    for expected, actual in zip(single, turns):
        assert torch.equal(expected.tokens, actual.tokens)
        assert expected.prompt_length == actual.prompt_length
        assert torch.equal(expected.rollout_log_probs, actual.rollout_log_probs)
        assert torch.equal(expected.rollout_routes, actual.rollout_routes)
        assert torch.equal(expected.response_mask(), actual.response_mask())
        assert (expected.reward, expected.group_id, expected.finish_reason) == (
            actual.reward,
            actual.group_id,
            actual.finish_reason,
        )
