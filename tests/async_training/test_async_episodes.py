"""Asynchronous multi-turn episodes and asynchronous dynamic sampling on the real embedded
engine, driven the way the loop drives the driver (tests/async_training/test_async_driver.py):
the background source at bound 0 gives the synchronous batches of an environment, bit for bit;
one step off-policy keeps the bound and trains each prompt once; a weight sync between two
turns gives episodes that span versions, each token with the version that sampled it, and with
independent turn scheduling the episodes that do not wait end before it; DAPO's dynamic sampling
drops uninformative groups as consumed prompts of the step."""

from __future__ import annotations

import itertools
import multiprocessing
import os
from contextlib import ExitStack

import torch

from megatron_gspo.config import TrainConfig, from_dict
from megatron_gspo.driver.build import build_rollout_driver
from megatron_gspo.driver.ledger import read_trained_prompts
from megatron_gspo.production.processes import following_client
from megatron_gspo.rollout.embedded import EmbeddedEngine
from tests.async_training import gated_environment
from tests.async_training.gated_environment import ENDED, GATE, WAITING

BATCH = 2
GROUP = 4
TURNS = 3
ENVIRONMENT = {
    "name": "tests.async_training.gated_environment:GatedEnvironment",
    "max_turns": TURNS,
    "num_workers": BATCH * GROUP,  # every episode of a chunk can wait at the gate at once
    # Every digit ends a turn: three short turns with observations in between.
    "options": {"turns": TURNS, "stop_token_ids": list(range(10)), "turn_reward": 0.25},
}
BINARY_REWARD = "tests.production.binary_rewards:first_digit_is_even"


def config(
    tmp_path,
    *,
    algo: dict | None = None,
    reward: dict | None = None,
    env: dict | None = None,
    **rollout,
):
    return from_dict(
        TrainConfig,
        {
            "output_dir": str(tmp_path),
            "sft_warmup_steps": 0,
            "algo": {
                "rollout_batch_size": BATCH,
                "num_return_sequences_in_group": GROUP,
                "num_mini_batches": 1,
                "response_length": 24,
                "old_log_prob_source": "rollout",
                **(algo or {}),
            },
            "env": {**ENVIRONMENT, **(env or {})},
            "reward": {"executor": "thread", **(reward or {})},
            "logging": {"tensorboard": False, "progress_bar": False},
            "rollout": rollout,
        },
    )


def run_steps(driver, policies, steps: int) -> list:
    """The loop's calls to the driver for ``steps`` steps; the batches it returned."""
    batches = []
    driver.start(0, None)
    driver.sync_weights(iter(policies[0]), version=0)
    for step in range(steps):
        batches.append(driver.rollout(step))
        driver.mark_trained(step)
        driver.sync_weights(iter(policies[(step + 1) % len(policies)]), version=step + 1)
    return batches


def model_versions(sample) -> torch.Tensor:
    return sample.rollout_weight_versions[sample.turns >= 0]


def test_bound_zero_gives_the_synchronous_episodes(tmp_path, policies):
    """Multi-turn episodes through the producer thread at max_staleness 0: the synchronous
    driver's trajectories (tokens, log-probs, versions, turns, rewards), bit for bit."""
    with ExitStack() as resources:
        synchronous = build_rollout_driver(config(tmp_path / "sync"), resources)
        expected = run_steps(synchronous, policies, steps=2)
    with ExitStack() as resources:
        asynchronous = build_rollout_driver(config(tmp_path / "async"), resources, background=True)
        batches = run_steps(asynchronous, policies, steps=2)
    for want, got in zip(expected, batches):
        assert len(got.samples) == BATCH * GROUP
        assert got.metrics["env/turns_mean"] > 1.0, "single-turn episodes show nothing"
        for a, b in zip(want.samples, got.samples):
            assert torch.equal(a.tokens, b.tokens) and a.group_id == b.group_id
            assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            assert torch.equal(a.rollout_weight_versions, b.rollout_weight_versions)
            assert torch.equal(a.turns, b.turns) and torch.equal(a.loss_mask, b.loss_mask)
            assert a.reward == b.reward and a.weight_version == b.weight_version
        assert got.metrics["staleness_max"] == 0
        for key in ("reward_mean", "response_len_mean", "env/turns_mean"):
            assert got.metrics[key] == want.metrics[key]
    assert read_trained_prompts(tmp_path / "sync") == read_trained_prompts(tmp_path / "async")


def test_episodes_span_versions_within_the_bound_and_train_each_prompt_once(tmp_path, policies):
    """The first step of every episode in flight waits while the trainer syncs version 1: their
    first turns were sampled by version 0, their later turns by version 1; every token keeps
    the version and the log-prob of the weights that sampled it, and the batch of step 1 is
    within the bound (one version old)."""
    GATE.clear()
    try:
        with ExitStack() as resources:
            driver = build_rollout_driver(
                config(tmp_path, max_staleness=1), resources, background=True
            )
            driver.start(0, None)
            driver.sync_weights(iter(policies[0]), version=0)
            for _ in range(BATCH * GROUP):  # every episode of chunk 0 is between turns 0 and 1
                assert WAITING.acquire(timeout=120)
            driver.sync_weights(iter(policies[1]), version=1)
            GATE.set()
            batches = [driver.rollout(1)]
            driver.mark_trained(1)
            for step in (2, 3):
                driver.sync_weights(iter(policies[step]), version=step)
                batches.append(driver.rollout(step))
                driver.mark_trained(step)
            state = driver.state_dict()
    finally:
        GATE.set()
    first = batches[0]
    for sample in first.samples:
        versions, turns = model_versions(sample), sample.turns[sample.turns >= 0]
        assert versions[turns == 0].eq(0).all() and versions[turns > 0].eq(1).all()
        assert sample.weight_version == 0 and bool(sample.turns.eq(-1).any())
    assert first.metrics["partial_sample_frac"] == 1.0
    assert first.metrics["staleness_max"] == 1.0
    # The trainer's log-probs of version 0 and 1 differ: each turn kept its own behaviour
    # policy's (a teacher-forced check of turn 0 under version 0 and turn 1 under version 1).
    sample = first.samples[0]
    for version in (0, 1):
        engine = EmbeddedEngine(TrainConfig().model, seed=100 + version)
        forced = teacher_forced(engine, sample)
        own = (sample.turns >= 0) & (sample.rollout_weight_versions == version)
        torch.testing.assert_close(forced[own], sample.rollout_log_probs[own], atol=1e-4, rtol=0)
    for step, batch in zip((1, 2, 3), batches):
        assert all(step - 1 <= s.weight_version <= step for s in batch.samples), step
        assert batch.metrics["staleness_max"] <= 1
    trained = [i for line in read_trained_prompts(tmp_path) for i in line["prompt_ids"]]
    assert len(trained) == len(set(trained)) == 3 * BATCH
    assert sorted(trained + state["pending_prompt_ids"]) == list(range(state["consumed"]))


def test_independent_episodes_end_while_others_wait_and_keep_the_bound(tmp_path, policies):
    """env.turn_scheduling=independent, one step off-policy: half the episodes of the first
    chunk wait after their first turn while the trainer syncs version 1; the other half do not
    wait for them and end under version 0 before the sync (lockstep would hold their second
    turns behind the waiting steps). Every token keeps the version and log-prob that sampled
    it, the waiting episodes' later turns version 1; every batch is within the bound; each
    prompt is trained once."""
    GATE.clear()
    gated_environment.HalfGatedEnvironment.made = itertools.count()
    env = {
        "name": "tests.async_training.gated_environment:HalfGatedEnvironment",
        "turn_scheduling": "independent",
    }
    try:
        with ExitStack() as resources:
            driver = build_rollout_driver(
                config(tmp_path, env=env, max_staleness=1), resources, background=True
            )
            driver.start(0, None)
            driver.sync_weights(iter(policies[0]), version=0)
            for _ in range(BATCH * GROUP // 2):  # half of chunk 0 is between turns 0 and 1
                assert WAITING.acquire(timeout=120)
            for _ in range(BATCH * GROUP // 2):  # the other half ends meanwhile
                assert ENDED.acquire(timeout=30), "an episode waited for the others' steps"
            driver.sync_weights(iter(policies[1]), version=1)
            GATE.set()
            batches = [driver.rollout(1)]
            driver.mark_trained(1)
            for step in (2, 3):
                driver.sync_weights(iter(policies[step]), version=step)
                batches.append(driver.rollout(step))
                driver.mark_trained(step)
            state = driver.state_dict()
    finally:
        GATE.set()
    first = batches[0]
    for index, sample in enumerate(first.samples):
        versions, turns = model_versions(sample), sample.turns[sample.turns >= 0]
        assert bool(sample.turns.eq(-1).any()) and sample.weight_version == 0
        if index % 2 == 0:  # waited at the gate
            assert versions[turns == 0].eq(0).all() and versions[turns > 0].eq(1).all()
        else:
            assert versions.eq(0).all()
    assert first.metrics["partial_sample_frac"] == 0.5
    assert first.metrics["staleness_max"] == 1.0
    waited, went_on = first.samples[0], first.samples[1]
    for sample, version in ((waited, 0), (waited, 1), (went_on, 0)):
        engine = EmbeddedEngine(TrainConfig().model, seed=100 + version)
        forced = teacher_forced(engine, sample)
        own = (sample.turns >= 0) & (sample.rollout_weight_versions == version)
        torch.testing.assert_close(forced[own], sample.rollout_log_probs[own], atol=1e-4, rtol=0)
    for step, batch in zip((1, 2, 3), batches):
        assert all(step - 1 <= s.weight_version <= step for s in batch.samples), step
        assert batch.metrics["staleness_max"] <= 1
    trained = [i for line in read_trained_prompts(tmp_path) for i in line["prompt_ids"]]
    assert len(trained) == len(set(trained)) == 3 * BATCH
    assert sorted(trained + state["pending_prompt_ids"]) == list(range(state["consumed"]))


def teacher_forced(engine: EmbeddedEngine, sample) -> torch.Tensor:
    """Log-probs of ``sample``'s response tokens under ``engine``'s model (temperature 1)."""
    with torch.no_grad():
        logits = engine.hf_model(input_ids=sample.tokens[None]).logits[0].double()
    log_probs = torch.log_softmax(logits, dim=-1)[:-1]
    next_tokens = sample.tokens[1:]
    gathered = log_probs.gather(-1, next_tokens[:, None])[:, 0]
    return gathered[sample.prompt_length - 1 :].float()


def test_dynamic_sampling_drops_uninformative_groups_as_consumed(tmp_path, policies):
    """Asynchronous DAPO: groups whose rewards are all equal never reach a batch; each is
    recorded once as a step's ``dropped_prompt_ids``; trained, dropped and pending prompts are
    the served ones, each once."""
    cfg = config(
        tmp_path,
        algo={"dynamic_sampling": True, "num_return_sequences_in_group": 2},
        reward={"functions": [BINARY_REWARD]},
        max_staleness=1,
    )
    cfg.env.name = None  # one completion per sample: the binary reward splits groups of two
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
        batches = run_steps(driver, policies, steps=3)
        state = driver.state_dict()
    lines = read_trained_prompts(tmp_path)
    dropped = [i for line in lines for i in line.get("dropped_prompt_ids", [])]
    trained = [i for line in lines for i in line["prompt_ids"]]
    assert dropped, "nothing was dropped: the test shows nothing"
    for batch in batches:
        rewards = [s.reward for s in batch.samples]
        assert all(rewards[i] != rewards[i + 1] for i in range(0, len(rewards), 2))
        assert batch.metrics["dynamic_sampling/filled_groups"] == 0.0
    everything = trained + dropped + state["pending_prompt_ids"]
    assert sorted(everything) == list(range(state["consumed"]))
    assert sum(b.metrics["dynamic_sampling/dropped_groups"] for b in batches) == len(dropped)


def test_producer_processes_step_episodes_off_the_trainers_interpreter(tmp_path, policies):
    """rollout.producer_processes: the episodes are stepped and scored in a child process (the
    environment reports its process), and its samples are those the driver's own producer
    makes in the trainer process for the same call on the same server: tokens, log-probs,
    versions, masks."""
    cfg = config(
        tmp_path,
        reward={"functions": []},
        engine="embedded_http",  # its loopback server in a thread of this process
    )
    cfg.env.name = "tests.async_training.gated_environment:ProcessReportingEnvironment"
    # Bound 0 (one chunk, then nothing until the next sync) so that the same call can be
    # repeated here on the same weights; the configuration asks for max_staleness >= 1.
    cfg.rollout.producer_processes = 1
    with ExitStack() as resources:
        driver = build_rollout_driver(cfg, resources, background=True)
        (process,) = driver.source.processes
        driver.start(0, None)
        driver.sync_weights(iter(policies[0]), version=0)
        batch = driver.rollout(0)
        prompts = [group.prompt for group in driver.source.background.buffer.groups]
        assert not prompts  # the batch took them all
        step_prompts = driver.task.stream.prompts_by_id(sorted({s.group_id for s in batch.samples}))
        again = driver.producer.produce(step_prompts, 0).samples
    assert len(batch.samples) == len(again) == BATCH * GROUP
    assert batch.metrics["env/turns_mean"] > 1.0
    for remote, local in zip(batch.samples, again):
        assert remote.turn_rewards[-1] == process.pid != os.getpid()
        assert local.turn_rewards[-1] == os.getpid()
        assert torch.equal(remote.tokens, local.tokens) and remote.group_id == local.group_id
        assert torch.equal(remote.rollout_log_probs, local.rollout_log_probs)
        assert torch.equal(remote.rollout_weight_versions, local.rollout_weight_versions)
        assert torch.equal(remote.loss_mask, local.loss_mask)


def test_producer_process_requests_carry_the_servers_weight_version():
    """A producer process's client takes its weight version (and with it the prefix-cache salt
    of its requests) from the value the trainer sets after each sync, never from itself."""
    version = multiprocessing.get_context("spawn").Value("q", 3, lock=False)
    client = following_client(version, urls=["http://127.0.0.1:9"])
    assert client.weight_version == 3 and client.cache_salt == "weights-v3"
    version.value = 4
    assert client.weight_version == 4 and client.cache_salt == "weights-v4"
    client.close()
