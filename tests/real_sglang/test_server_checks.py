"""What the trainer checks when it connects to SGLang servers
(``sglang_engine.check_sglang_servers``), and releasing GPU memory, which SGLang on CPU cannot do.

``rollout.sglang.release_memory`` needs servers started with ``--enable-memory-saver``, which
needs CUDA: on CPU the run is refused at start. The calls themselves are SGLang 0.5.23's (the
server answers them with 200 but, without the memory saver, frees nothing): after
``release_memory`` the client refuses to generate until ``sync_weights`` has resumed the
weights, synced them and resumed the caches.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from megatron_gspo.config import ConfigError, RolloutConfig, SGLangConfig
from megatron_gspo.rollout.auth import API_KEY_ENV
from megatron_gspo.rollout.factory import build_rollout_engine
from megatron_gspo.rollout.sglang_client import SGLangEngine
from megatron_gspo.rollout.sglang_protocol import RouteLayout
from megatron_gspo.rollout.types import GenerateRequest, RolloutEngineError, sync_weights_paused
from megatron_gspo.rollout.weight_loader import iter_safetensors_directory
from megatron_gspo.weight_sync import DiskTransport


def rollout_config(server, **sglang) -> RolloutConfig:
    return RolloutConfig(
        engine="sglang",
        sglang=SGLangConfig(urls=[server.url], **sglang),
        weight_transport="disk",
    )


def test_release_memory_is_refused_at_start_on_cpu(fresh_server, monkeypatch, tmp_path):
    monkeypatch.setenv(API_KEY_ENV, fresh_server.api_key)
    config = rollout_config(fresh_server, release_memory=True)
    with pytest.raises(ConfigError) as error:
        build_rollout_engine(config, fresh_server.model, work_dir=str(tmp_path))
    assert error.value.key == "rollout.sglang.release_memory"
    assert "--enable-memory-saver" in str(error.value) and "CPU" in str(error.value)


def test_a_capable_server_passes_with_a_warning_about_seeds(
    fresh_server, monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv(API_KEY_ENV, fresh_server.api_key)
    with caplog.at_level(logging.WARNING):
        engine = build_rollout_engine(
            rollout_config(fresh_server),
            fresh_server.model,
            enable_routed_experts=True,
            work_dir=str(tmp_path),
        )
    engine.close()
    assert "ignores sampling seeds" in caplog.text
    assert "tested against" not in caplog.text  # the tested version


def test_release_then_sync_restores_the_server(fresh_server, tmp_path):
    """The release / resume calls as the trainer sends them (generation refused in between),
    on a server that cannot actually free memory: afterwards it generates from the synced
    weights, exactly."""
    assert fresh_server.get("/server_info")["enable_memory_saver"] is False
    engine = SGLangEngine(
        [fresh_server.url],
        RouteLayout.from_model_config(fresh_server.model),
        weight_transport=DiskTransport(
            str(tmp_path / "weights"), config_source_dir=str(fresh_server.model_dir)
        ),
        api_key=fresh_server.api_key,
    )
    request = GenerateRequest([1, 2, 3], max_new_tokens=6, temperature=0.9)
    try:
        engine.release_memory()
        with pytest.raises(RolloutEngineError, match="release_memory"):
            engine.generate([request])
        weights = iter_safetensors_directory(str(fresh_server.model_dir))
        assert sync_weights_paused(engine, weights, version=3).num_bytes > 0
        (result,) = engine.generate([request])
    finally:
        engine.close()
    assert result.weight_version == 3
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(fresh_server.model_dir), dtype=torch.float32
    )
    tokens = torch.tensor([[1, 2, 3, *result.output_ids]])
    with torch.no_grad():
        table = torch.log_softmax(model(tokens).logits[0].float() / 0.9, -1)
    expected = table[torch.arange(2, 8), torch.tensor(result.output_ids)]
    assert float((torch.from_numpy(result.output_log_probs) - expected).abs().max()) < 1e-5
