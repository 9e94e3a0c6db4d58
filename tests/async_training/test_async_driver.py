"""The asynchronous driver on a real embedded engine, reward runner and prompt stream, driven the
way the loop drives it (start, sync, rollout, mark_trained, sync, ...) with the weights of other
engines standing in for the trainer's updates.
"""

from __future__ import annotations

import time
from contextlib import ExitStack

import pytest
import torch

from megatron_gspo.async_driver import AsyncRolloutDriver
from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.driver import RolloutDriver
from megatron_gspo.ledger import read_trained_prompts
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.sglang_weights import DiskTransport

BATCH = 2
GROUP = 4


def config(tmp_path, **rollout) -> TrainConfig:
    return from_dict(
        TrainConfig,
        {
            "output_dir": str(tmp_path),
            "sft_warmup_steps": 0,
            "algo": {
                "rollout_batch_size": BATCH,
                "num_return_sequences_in_group": GROUP,
                "num_mini_batches": 1,
                "response_length": 8,
                "old_log_prob_source": "rollout",
            },
            "reward": {"executor": "thread"},
            "logging": {"tensorboard": False, "progress_bar": False},
            "rollout": rollout,
        },
    )


@pytest.fixture(scope="module")
def policies():
    """Weights for versions 0, 1, 2, ...: other random models of the run's architecture (the
    trainer's updates, as far as the driver can tell)."""
    model = TrainConfig().model
    return [list(EmbeddedEngine(model, seed=100 + k).hf_state()) for k in range(4)]


def run_steps(driver, policies, steps: int, training=None) -> list:
    """The loop's calls to the driver for ``steps`` steps; the batches it returned. ``training``
    runs where the trainer would update (before the step's sync)."""
    batches = []
    driver.start(0, None)
    driver.sync_weights(iter(policies[0]), version=0)
    for step in range(steps):
        batches.append(driver.rollout(step))
        if training is not None:
            training(driver)
        driver.mark_trained(step)
        driver.sync_weights(iter(policies[(step + 1) % len(policies)]), version=step + 1)
    return batches


def producing(driver) -> None:
    """Training takes long enough for the engine to start on the next chunk."""
    producer, engine = driver.background, driver.rollout_engine
    wait_until(lambda: engine.num_running > 0 or len(producer.buffer) >= BATCH)


def test_bound_zero_gives_the_synchronous_batches(tmp_path, policies):
    """The producer thread with max_staleness 0 generates each step's batch after the step's
    weight sync, with the step's seeds: the synchronous driver's samples, bit for bit."""
    with ExitStack() as resources:
        synchronous = RolloutDriver(config(tmp_path / "sync"), resources)
        expected = run_steps(synchronous, policies, steps=3)
    with ExitStack() as resources:
        asynchronous = AsyncRolloutDriver(config(tmp_path / "async"), resources)
        batches = run_steps(asynchronous, policies, steps=3)
    for want, got in zip(expected, batches):
        assert len(got.samples) == BATCH * GROUP
        for a, b in zip(want.samples, got.samples):
            assert torch.equal(a.tokens, b.tokens) and a.group_id == b.group_id
            assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            assert torch.equal(a.rollout_weight_versions, b.rollout_weight_versions)
            assert a.reward == b.reward and a.weight_version == b.weight_version
        assert got.metrics["staleness_max"] == 0
        for key in ("reward_mean", "response_len_mean", "reward_synthetic_mean"):
            assert got.metrics[key] == want.metrics[key]
    assert read_trained_prompts(tmp_path / "sync") == read_trained_prompts(tmp_path / "async")


def test_one_step_off_policy_respects_the_bound_and_trains_each_prompt_once(tmp_path, policies):
    with ExitStack() as resources:
        driver = AsyncRolloutDriver(config(tmp_path, max_staleness=1), resources)
        batches = run_steps(driver, policies, steps=4, training=producing)
        state = driver.state_dict()
    for step, batch in enumerate(batches):
        assert all(step - 1 <= s.weight_version <= step for s in batch.samples), step
        assert batch.metrics["staleness_max"] <= 1
    # Step 1's batch was generated while step 0 trained (before its sync): one step old.
    assert batches[1].metrics["staleness_max"] == 1
    trained = [i for line in read_trained_prompts(tmp_path) for i in line["prompt_ids"]]
    assert sorted(trained) == list(range(4 * BATCH))
    # What was generated (or in flight) but not trained is pending in the checkpoint's state.
    served = state["consumed"]
    assert sorted(trained + state["pending_prompt_ids"]) == list(range(served))


def test_stale_groups_are_generated_again_not_trained(tmp_path, policies):
    """The trainer jumps three versions ahead: the groups generated for the next step by the
    old weights exceed the bound and go back to the prompt queue (counted), and the batch it
    gets comes from fresh generation of the same prompts."""
    with ExitStack() as resources:
        driver = AsyncRolloutDriver(config(tmp_path, max_staleness=1), resources)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        first = driver.rollout(0)
        driver.mark_trained(0)
        wait_until(lambda: len(driver.background.buffer) == BATCH)  # step 1's, from version 0
        for version in (1, 2, 3):
            driver.sync_weights(iter(policies[version]), version=version)
        batch = driver.rollout(4)
        driver.mark_trained(4)
        pending = driver.state_dict()["pending_prompt_ids"]
    assert [s.group_id for s in first.samples[::GROUP]] == [0, 1]
    assert batch.metrics["requeued_stale"] >= BATCH
    assert all(s.weight_version >= 3 for s in batch.samples)
    # Prompts 2 and 3 were not trained on their stale samples: they wait to be generated again.
    trained = [i for line in read_trained_prompts(tmp_path) for i in line["prompt_ids"]]
    assert len(set(trained)) == len(trained) and {2, 3} <= set(pending) - set(trained)


def test_partial_rollouts_keep_each_tokens_version(tmp_path, policies):
    """A sync lands while the producer generates: the samples in flight continue with the new
    weights, their tokens carrying the version that sampled them."""
    cfg = config(tmp_path, max_staleness=2)
    cfg.algo.response_length = 120
    cfg.rollout.min_new_tokens = 120  # long responses: the sync lands inside them
    with ExitStack() as resources:
        driver = AsyncRolloutDriver(cfg, resources)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        engine = driver.rollout_engine
        wait_until(lambda: engine.num_running > 0)
        time.sleep(0.05)
        driver.sync_weights(iter(policies[1]), version=1)
        batch = driver.rollout(1)
    versions = [s.rollout_weight_versions for s in batch.samples]
    assert all(v[0] == 0 and v[-1] == 1 for v in versions)
    assert all(bool((v[1:] >= v[:-1]).all()) for v in versions)
    assert batch.metrics["partial_sample_frac"] == 1.0
    assert batch.metrics["segments_per_sample"] == 2.0


def wait_until(condition, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_producer_failure_reaches_the_trainer(tmp_path, policies):
    """An error in the producer thread is raised by the trainer's next rollout, not lost."""
    with ExitStack() as resources:
        driver = AsyncRolloutDriver(config(tmp_path, max_staleness=1), resources)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        driver.background.fail(RuntimeError("reward workers are gone"))
        with pytest.raises(RuntimeError, match="reward workers are gone"):
            driver.rollout(0)


class TransportWithoutACopy(DiskTransport):
    """The disk transport without its copy of the newest weights: what the tensor and
    distributed transports keep (nothing), on the loopback server, which takes disk updates
    only."""

    name = "disk without a copy"

    def resend(self, client):
        return None

    @property
    def latest_version(self):
        return None


def teacher_forced_log_probs(model, sample) -> torch.Tensor:
    """Log-probs of ``sample``'s response tokens under ``model`` (temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=sample.tokens.unsqueeze(0)).logits[0].float()
    log_probs = torch.log_softmax(logits[sample.prompt_length - 1 : -1], dim=-1)
    return log_probs.gather(1, sample.tokens[sample.prompt_length :].unsqueeze(1)).squeeze(1)


def test_restarted_server_gets_the_trainers_weights_when_the_transport_keeps_none(
    tmp_path, policies
):
    """SIGKILL the loopback server process while it generates and the trainer waits for its
    batch, with a weight transport that keeps no copy of the newest weights (as tensor and
    distributed): the producer keeps off the restarted server until the trainer's thread has
    sent it the current weights (the driver's ``weights``), and the run goes on. Every sample
    after the restart was sampled by the trainer's version, with that version's log-probs (a
    server left with its initial weights would report version 0 and other log-probs)."""
    import signal

    cfg = config(
        tmp_path,
        max_staleness=1,
        engine="embedded_http",
        embedded_server_process=True,
        engine_threads=1,
        max_retries=1,
    )
    cfg.algo.response_length = 60
    cfg.rollout.min_new_tokens = 60  # the kill lands inside the generation
    trainer = {"version": 2}
    with ExitStack() as resources:
        driver = AsyncRolloutDriver(
            cfg, resources, weights=lambda: iter(policies[trainer["version"]])
        )
        engine = driver.rollout_engine
        engine.weight_transport = TransportWithoutACopy(str(tmp_path / "weights"))
        engine.retry_backoff_s = 0.05
        (restart,) = engine._restarters.values()
        server = restart.__self__  # the EmbeddedServerProcess
        driver.start(2, None)
        driver.sync_weights(iter(policies[2]), version=2)
        wait_until(lambda: driver.background.in_flight > 0)
        server.process.process.send_signal(signal.SIGKILL)
        first = driver.rollout(2)  # waits; recovery; the trainer's weights; the batch
        driver.mark_trained(2)
        trainer["version"] = 3
        driver.sync_weights(iter(policies[3]), version=3)
        second = driver.rollout(3)
    assert server.restarts == 1 and first.metrics["engine_restarts"] == 1
    assert first.metrics["requeued_lost"] >= BATCH
    assert all(sample.weight_version == 2 for sample in first.samples)
    assert all(sample.weight_version >= 2 for sample in second.samples)
    models = {k: EmbeddedEngine(TrainConfig().model, seed=100 + k).hf_model for k in (2, 3)}
    # The first batch was generated while the trainer waited: by version 2 alone. (The second
    # may continue across the sync of version 3, whose tokens see the old weights' KV cache.)
    whole = [s for s in second.samples if bool((s.rollout_weight_versions == 3).all())]
    for sample in first.samples + whole:
        expected = teacher_forced_log_probs(models[sample.weight_version], sample)
        torch.testing.assert_close(sample.rollout_log_probs, expected, atol=1e-4, rtol=0)
