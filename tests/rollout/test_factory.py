"""``build_rollout_engine``: each ``rollout.engine`` value gives a working engine."""

from __future__ import annotations

import pytest
import requests

from megatron_gspo.config import ConfigError, RolloutConfig, SGLangConfig
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.types import GenerateRequest, sync_weights_paused


def test_embedded(model_config):
    engine = build_rollout_engine(RolloutConfig(engine="embedded"), model_config, seed=1)
    assert isinstance(engine, EmbeddedEngine)


def test_embedded_http_owns_its_server(model_config, tmp_path):
    client = build_rollout_engine(
        RolloutConfig(engine="embedded_http"), model_config, seed=1, work_dir=str(tmp_path)
    )
    assert isinstance(client, SGLangEngine)
    request = GenerateRequest(
        input_ids=[1, 2], max_new_tokens=4, seed=3, return_routed_experts=True
    )
    expected = EmbeddedEngine(model_config, seed=1).generate([request])[0]
    assert client.generate([request])[0].output_ids == expected.output_ids
    donor = EmbeddedEngine(model_config, seed=2)
    sync_weights_paused(client, donor.hf_state(), version=1)
    assert client.generate([request])[0].output_ids == donor.generate([request])[0].output_ids
    url = client.urls[0]
    client.close()
    with pytest.raises(requests.ConnectionError):
        requests.get(url + "/health_generate", timeout=5)


def test_sglang_without_servers_is_a_config_error(model_config):
    with pytest.raises(ConfigError, match="sglang.urls"):
        build_rollout_engine(RolloutConfig(engine="sglang"), model_config)
    with pytest.raises(ConfigError, match="hf_path"):
        build_rollout_engine(
            RolloutConfig(engine="sglang", sglang=SGLangConfig(launch=True)), model_config
        )
