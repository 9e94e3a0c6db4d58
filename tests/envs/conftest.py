"""Shared by the environment tests: a tokenizer whose decode/encode does not round-trip, a tiny
MoE, configurations, and an engine that records every call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional, TypeVar

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from megatron_gspo.config import ModelConfig, TrainConfig, from_dict
from megatron_gspo.data.prompts import Prompt
from megatron_gspo.envs import EnvironmentFactory
from megatron_gspo.production.episodes import EnvironmentProducer, EpisodeSettings
from megatron_gspo.production.sampling import Sampling
from megatron_gspo.production.task import Task
from megatron_gspo.reward import RewardRunner
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import GenerateRequest, GenerateResult, RolloutEngine
from tests.reward.sandbox_support import require_sandbox
from tests.rollout.conftest import tiny_model_config

EOS, OBS = 12, 13
T = TypeVar("T")


def merging_tokenizer():
    """Ten letters a..j (ids 0..9), the merges ``ab`` (10) and ``cd`` (11), ``<eos>`` (12),
    ``<obs>`` (13), ``<unk>`` (14). Decoding ids 0, 1 gives "ab", which encodes as 10: text
    round-trips would change the model's tokens."""
    vocab = {character: index for index, character in enumerate("abcdefghij")}
    vocab.update({"ab": 10, "cd": 11, "<eos>": EOS, "<obs>": OBS, "<unk>": 14})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("c", "d")], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<obs>"],
    )


def tiny_moe() -> ModelConfig:
    """The rollout tests' tiny MoE (a dense first layer, 4 experts, top-2) over this vocabulary."""
    return tiny_model_config(vocab_size=16)


def train_config(env: Optional[dict] = None, **sections) -> TrainConfig:
    algo = {
        "rollout_batch_size": 2,
        "num_return_sequences_in_group": 2,
        "num_mini_batches": 1,
        "response_length": 24,
        "routing_replay": "r3",
        **sections.pop("algo", {}),
    }
    data = {
        "model": {k: v for k, v in vars(tiny_moe()).items()},
        "algo": algo,
        "env": {"name": "single_turn", **(env or {})},
        "reward": {"functions": [], "executor": "thread", **sections.pop("reward", {})},
        **sections,
    }
    return from_dict(TrainConfig, data)


def environment_producer(
    engine: RolloutEngine,
    task: Task,
    rewards: Optional[RewardRunner],
    cfg: TrainConfig,
    factory: EnvironmentFactory,
) -> EnvironmentProducer:
    """The run's producer of ``cfg`` (training sampling, ``env.*`` limits) with ``factory``."""
    return EnvironmentProducer(
        engine, task, rewards, Sampling.training(cfg), EpisodeSettings.from_config(cfg), factory
    )


def prompts(count: int = 2, length: int = 4, **metadata) -> list[Prompt]:
    return [
        Prompt(
            prompt_ids=[(3 * i + j) % 10 for j in range(length)],
            prompt_text="",
            answer=None,
            metadata=dict(metadata),
            source=f"test:{i}",
            group_id=i,
        )
        for i in range(count)
    ]


def isolated_or_fail_closed(call: Callable[[], T]) -> T:
    """``call()`` where the sandbox can isolate code here. Elsewhere the calling test is skipped
    with bubblewrap's reason, and fails in CI (``tests/reward/sandbox_support.require_sandbox``):
    a test of sandboxed tools never passes without its programs having run sandboxed. That the
    sandbox fails closed is tested on purpose in tests/reward."""
    require_sandbox()
    return call()


class RecordingEngine(RolloutEngine):
    """A real engine, remembering every ``generate`` call (requests and results); after each
    call it may run ``between_calls(engine)`` (e.g. a weight sync, as a weight update would
    land between two turns of an asynchronous rollout)."""

    def __init__(self, engine: RolloutEngine, between_calls: Optional[Callable] = None):
        self.engine, self.between_calls = engine, between_calls
        self.calls: list[list[tuple[GenerateRequest, GenerateResult]]] = []

    def generate(self, requests: Sequence[GenerateRequest], n: int = 1) -> list[GenerateResult]:
        results = self.engine.generate(requests, n)
        self.calls.append(list(zip(requests, results)))
        if self.between_calls is not None:
            self.between_calls(self.engine)
        return results

    def abort(self, request_ids=None):
        self.engine.abort(request_ids)

    def pause(self, mode="abort"):
        self.engine.pause(mode)

    def resume(self):
        self.engine.resume()

    def flush_cache(self):
        self.engine.flush_cache()

    def health(self):
        return self.engine.health()

    def sync_weights(self, named_tensors, version):
        return self.engine.sync_weights(named_tensors, version)

    @property
    def weight_version(self):
        return self.engine.weight_version

    def close(self):
        self.engine.close()


@pytest.fixture(scope="module")
def tokenizer():
    return merging_tokenizer()


@pytest.fixture(scope="module")
def embedded():
    engine = EmbeddedEngine(tiny_moe(), seed=5)
    yield engine
    engine.close()
