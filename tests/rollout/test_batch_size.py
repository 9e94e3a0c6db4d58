"""``rollout.embedded_max_batch_size``: how many samples the embedded engine decodes together (the
batch composition source of ``tools/compare_grpo_gspo.py --suite attribution``)."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_gspo.config import EMBEDDED_MAX_BATCH_SIZE, ConfigError, RolloutConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.server_process import EmbeddedServerProcess
from megatron_gspo.rollout.types import GenerateRequest


def _requests(count: int = 4) -> list[GenerateRequest]:
    # Prompts of different lengths: in one batch they are left-padded, alone they are not.
    return [
        GenerateRequest(
            input_ids=[(7 * i + j) % 90 + 1 for j in range(i + 2)],
            seed=11 + i,
            max_new_tokens=6,
            temperature=1.0,
            return_logprob=True,
        )
        for i in range(count)
    ]


class _CountingEngine(EmbeddedEngine):
    """The real engine; it records the size of every batch it decodes."""

    def _generate_batch(self, batch):
        self.batch_sizes.append(len(batch))
        return super()._generate_batch(batch)


def test_batch_size_sets_how_many_samples_decode_together(model_config):
    engines = {}
    for size in (1, EMBEDDED_MAX_BATCH_SIZE):
        engine = _CountingEngine(model_config, seed=3, max_batch_size=size)
        engine.batch_sizes = []
        engines[size] = (engine, engine.generate(_requests()))
    assert engines[1][0].batch_sizes == [1] * 4
    assert engines[EMBEDDED_MAX_BATCH_SIZE][0].batch_sizes == [4]
    # float32: another batch changes log-probs by rounding only (the gap the attribution table
    # shows for batch1); each sample draws from its own seed, so the tokens stay the same unless
    # a uniform lands within rounding of a CDF boundary.
    compared = 0
    for alone, together in zip(engines[1][1], engines[EMBEDDED_MAX_BATCH_SIZE][1]):
        if alone.output_ids == together.output_ids:
            np.testing.assert_allclose(
                alone.output_log_probs, together.output_log_probs, rtol=0, atol=1e-5
            )
            compared += 1
    assert compared >= 3


def test_config_reaches_every_embedded_engine(model_config, tmp_path):
    assert RolloutConfig().embedded_max_batch_size == EMBEDDED_MAX_BATCH_SIZE == 64
    engine = build_rollout_engine(RolloutConfig(embedded_max_batch_size=3), model_config, seed=1)
    assert engine.max_batch_size == 3
    engine.close()
    process = EmbeddedServerProcess(
        model_config, api_key="k", log_path=str(tmp_path / "log"), max_batch_size=2
    )
    command = process.process.command
    assert command[command.index("--max-batch-size") + 1] == "2"


def test_invalid_batch_sizes_are_refused():
    with pytest.raises(ConfigError, match="embedded_max_batch_size"):
        RolloutConfig(embedded_max_batch_size=0)
    with pytest.raises(ConfigError, match="SGLang's scheduler"):
        RolloutConfig(engine="sglang", embedded_max_batch_size=8)
