"""The asynchronous driver on a real embedded engine, reward runner and prompt stream, driven the
way the loop drives it (start, sync, rollout, mark_trained, sync, ...) with the weights of other
engines standing in for the trainer's updates; and what both batch sources share: aborted
samples warned about only when a step trains them, a killed server brought back.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import ExitStack

import pytest
import torch

from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.driver.build import build_rollout_driver
from megatron_gspo.driver.ledger import read_trained_prompts
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.weight_sync import DiskTransport

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
    """Training takes long enough for the producer to finish the next chunk at the step's
    weights. Waiting only until the engine runs its requests raced: a sync that came before
    their first token paused them, and they generated every token at the new version (a batch
    one step fresher than the test asserts, seen once in a loaded CI-tier run)."""
    producer = driver.source.background
    wait_until(lambda: len(producer.buffer) >= BATCH)


def test_bound_zero_gives_the_synchronous_batches(tmp_path, policies):
    """The producer thread with max_staleness 0 generates each step's batch after the step's
    weight sync, with the step's seeds: the synchronous driver's samples, bit for bit."""
    with ExitStack() as resources:
        synchronous = build_rollout_driver(config(tmp_path / "sync"), resources)
        expected = run_steps(synchronous, policies, steps=3)
    with ExitStack() as resources:
        asynchronous = build_rollout_driver(config(tmp_path / "async"), resources, background=True)
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
        driver = build_rollout_driver(config(tmp_path, max_staleness=1), resources, background=True)
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
        driver = build_rollout_driver(config(tmp_path, max_staleness=1), resources, background=True)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        first = driver.rollout(0)
        driver.mark_trained(0)
        wait_until(
            lambda: len(driver.source.background.buffer) == BATCH
        )  # step 1's, from version 0
        for version in (1, 2, 3):
            driver.sync_weights(iter(policies[version]), version=version)
        batch = driver.rollout(4)
        totals = driver.source.run_totals()
        driver.mark_trained(4)
        pending = driver.state_dict()["pending_prompt_ids"]
    assert [s.group_id for s in first.samples[::GROUP]] == [0, 1]
    assert totals["requeued_stale"] >= BATCH
    assert all(s.weight_version >= 3 for s in batch.samples)
    # Prompts 2 and 3 were not trained on their stale samples: they wait to be generated again,
    # or step 4 trained them on fresh samples (every sample of its batch is of version 3 or
    # later, above), depending on how far the producer got before the requeue.
    lines = read_trained_prompts(tmp_path)
    trained = [i for line in lines for i in line["prompt_ids"]]
    at_step_4 = {i for line in lines if line["step"] == 4 for i in line["prompt_ids"]}
    assert len(set(trained)) == len(trained)
    assert {2, 3} <= (set(pending) - set(trained)) | at_step_4
    assert not {2, 3} & set(trained) - at_step_4


def test_partial_rollouts_keep_each_tokens_version(tmp_path, policies):
    """A sync lands while the producer generates: the samples in flight continue with the new
    weights, their tokens carrying the version that sampled them."""
    cfg = config(tmp_path, max_staleness=2)
    cfg.algo.response_length = 120
    cfg.rollout.min_new_tokens = 120  # long responses: the sync lands inside them
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
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
        driver = build_rollout_driver(config(tmp_path, max_staleness=1), resources, background=True)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        driver.source.background.fail(RuntimeError("reward workers are gone"))
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


@pytest.mark.slow
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
        driver = build_rollout_driver(
            cfg, resources, weights=lambda: iter(policies[trainer["version"]]), background=True
        )
        engine = driver.rollout_engine
        engine.weight_transport = TransportWithoutACopy(str(tmp_path / "weights"))
        engine.retry_backoff_s = 0.05
        (restart,) = engine._restarters.values()
        server = restart.__self__  # the EmbeddedServerProcess
        driver.start(2, None)
        driver.sync_weights(iter(policies[2]), version=2)
        wait_until(lambda: driver.source.background.in_flight > 0)
        server.process.process.send_signal(signal.SIGKILL)
        first = driver.rollout(2)  # waits; recovery; the trainer's weights; the batch
        first_totals = driver.source.run_totals()
        driver.mark_trained(2)
        trainer["version"] = 3
        driver.sync_weights(iter(policies[3]), version=3)
        second = driver.rollout(3)
    assert server.restarts == 1 and first_totals["engine_restarts"] == 1
    assert first_totals["requeued_lost"] >= BATCH
    assert all(sample.weight_version == 2 for sample in first.samples)
    assert all(sample.weight_version >= 2 for sample in second.samples)
    models = {k: EmbeddedEngine(TrainConfig().model, seed=100 + k).hf_model for k in (2, 3)}
    # The first batch was generated while the trainer waited: by version 2 alone. (The second
    # may continue across the sync of version 3, whose tokens see the old weights' KV cache.)
    whole = [s for s in second.samples if bool((s.rollout_weight_versions == 3).all())]
    for sample in first.samples + whole:
        expected = teacher_forced_log_probs(models[sample.weight_version], sample)
        torch.testing.assert_close(sample.rollout_log_probs, expected, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Aborted samples: a warning only when they reach a trained batch
# ---------------------------------------------------------------------------------------------

ABORTED_WARNING = "rollout samples were aborted"


def long_responses(cfg: TrainConfig) -> TrainConfig:
    """Responses long enough for an abort (or a kill) to land inside the generation."""
    cfg.algo.response_length = 120
    cfg.rollout.min_new_tokens = 120
    return cfg


def hold_the_generation(engine) -> None:
    """Wait until the embedded engine generates, then freeze it between two decode steps
    (``pause("in_place")``) past the start of its decode loop, which reads the abort epoch: an
    abort or a stop then lands inside the generation however fast the machine decodes (a fast
    CPU decoded all 120 tokens within the 0.1 s a bare sleep had left it)."""
    wait_until(lambda: engine.num_running > 0)
    engine.pause("in_place")
    time.sleep(0.1)


def abort_when_generating(engine) -> threading.Thread:
    """Abort the embedded engine's generation once it runs (from another thread, as the
    background producer's stop does)."""

    def abort() -> None:
        hold_the_generation(engine)
        engine.abort()
        engine.resume()

    thread = threading.Thread(target=abort)
    thread.start()
    return thread


def aborted_warnings(caplog) -> list[str]:
    return [
        record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING and ABORTED_WARNING in record.getMessage()
    ]


def test_work_cancelled_at_shutdown_is_not_a_training_warning(tmp_path, policies, caplog):
    """The run ends while the producer generates the next chunk: stop aborts it. Those samples
    reach no trained batch, so the log says the in-flight work was cancelled (INFO), and no
    warning about aborted samples being kept out of the loss."""
    caplog.set_level(logging.INFO, logger="megatron_gspo")
    cfg = long_responses(config(tmp_path, max_staleness=1))
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
        batches = run_steps(driver, policies, steps=1)
        hold_the_generation(driver.rollout_engine)  # step 1's chunk, which no step trains
    assert not any(s.finish_reason == "abort" for s in batches[0].samples)
    assert not aborted_warnings(caplog), aborted_warnings(caplog)
    cancelled = [r for r in caplog.records if "cancelled" in r.getMessage()]
    assert cancelled and all(r.levelno == logging.INFO for r in cancelled), caplog.text


def test_aborted_groups_are_generated_again_and_counted_not_warned(tmp_path, policies, caplog):
    """An abort in the middle of an asynchronous run: the groups with aborted samples go back
    to the prompt queue (``requeued_lost``) and the batch is generated again, so no trained
    batch holds an aborted sample and nothing warns that one was kept out of the loss."""
    caplog.set_level(logging.INFO, logger="megatron_gspo")
    cfg = long_responses(config(tmp_path, max_staleness=1))
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
        driver.start(0, None)
        aborting = abort_when_generating(driver.rollout_engine)
        driver.sync_weights(iter(policies[0]), version=0)
        aborting.join()
        batch = driver.rollout(0)
        totals = driver.source.run_totals()
        driver.mark_trained(0)
    assert totals["requeued_lost"] == BATCH
    assert not any(s.finish_reason == "abort" for s in batch.samples)
    assert sorted({s.group_id for s in batch.samples}) == [0, 1]  # the same prompts, again
    assert not aborted_warnings(caplog), aborted_warnings(caplog)


def test_aborted_samples_in_a_trained_batch_still_warn(tmp_path, policies, caplog):
    """The synchronous source trains a step's aborted samples with an empty loss mask: that
    is worth a warning, and the batch's metrics count them."""
    cfg = long_responses(config(tmp_path))
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources)
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        aborting = abort_when_generating(driver.rollout_engine)
        batch = driver.rollout(0)
        aborting.join()
    assert batch.metrics["finish_abort_frac"] == 1.0
    assert aborted_warnings(caplog) == [
        f"{BATCH * GROUP} of {BATCH * GROUP} rollout samples were aborted; they are kept out of "
        "the loss"
    ]


# ---------------------------------------------------------------------------------------------
# A killed loopback server in the synchronous loop
# ---------------------------------------------------------------------------------------------


def server_process_config(tmp_path, **rollout) -> TrainConfig:
    cfg = config(
        tmp_path,
        engine="embedded_http",
        embedded_server_process=True,
        engine_threads=1,
        max_retries=1,  # the dead server is noticed after one retry
        **rollout,
    )
    return long_responses(cfg)  # the kill lands inside the generation


@pytest.mark.slow
def test_synchronous_source_restarts_a_killed_server_and_generates_the_step_again(
    tmp_path, policies
):
    """SIGKILL the loopback server process while a synchronous step generates, then again
    between two steps (the weight sync finds it gone), with a weight transport that keeps no
    copy: each time the source restarts it, gives it the trainer's weights (its ``weights``,
    or the sync's own stream) and the step's prompts are generated again with the step's
    seeds: the batches equal an uninterrupted run's."""
    with ExitStack() as resources:
        reference = build_rollout_driver(server_process_config(tmp_path / "reference"), resources)
        reference.rollout_engine.weight_transport = TransportWithoutACopy(
            str(tmp_path / "reference" / "weights")
        )
        reference.start(2, None)
        reference.sync_weights(iter(policies[2]), version=2)
        expected = [reference.rollout(2)]
        reference.mark_trained(2)
        reference.sync_weights(iter(policies[3]), version=3)
        expected.append(reference.rollout(3))
        reference.mark_trained(3)

    cfg = server_process_config(tmp_path / "killed")
    trainer = {"version": 2}
    with ExitStack() as resources:
        driver = build_rollout_driver(
            cfg, resources, weights=lambda: iter(policies[trainer["version"]])
        )
        engine = driver.rollout_engine
        engine.weight_transport = TransportWithoutACopy(str(tmp_path / "killed" / "weights"))
        engine.retry_backoff_s = 0.05
        (restart,) = engine._restarters.values()
        server = restart.__self__  # the EmbeddedServerProcess
        driver.start(2, None)
        driver.sync_weights(iter(policies[2]), version=2)

        def kill_when_generating() -> None:
            wait_until(lambda: engine.servers[0].in_flight > 0)
            time.sleep(0.05)  # the request has reached the server
            server.process.process.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_generating)
        killer.start()
        first = driver.rollout(2)  # the kill; restart; the trainer's weights; the step again
        first_totals = driver.source.run_totals()
        killer.join()
        driver.mark_trained(2)
        server.process.process.send_signal(signal.SIGKILL)
        server.process.process.wait()
        trainer["version"] = 3
        synced = driver.sync_weights(iter(policies[3]), version=3)  # finds the server gone
        second = driver.rollout(3)
        second_totals = driver.source.run_totals()
        driver.mark_trained(3)
    assert server.restarts == 2
    assert first_totals["engine_restarts"] == 1 and second_totals["engine_restarts"] == 2
    assert synced["weight_sync_tensors"] == len(policies[3])
    for want, got in zip(expected, [first, second]):
        assert len(got.samples) == BATCH * GROUP
        for a, b in zip(want.samples, got.samples):
            assert torch.equal(a.tokens, b.tokens) and a.group_id == b.group_id
            assert a.reward == b.reward and a.weight_version == b.weight_version
            torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs)
        for key in ("reward_mean", "response_len_mean", "num_samples"):
            assert got.metrics[key] == want.metrics[key]
    trained = [line["prompt_ids"] for line in read_trained_prompts(tmp_path / "killed")]
    assert trained == [line["prompt_ids"] for line in read_trained_prompts(tmp_path / "reference")]
