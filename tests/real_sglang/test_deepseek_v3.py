"""DeepSeek-V3 (``deepseek_v3``) on a real SGLang 0.5.23 server (CPU, float32): where it fails.

SGLang would serve the model with its own DeepSeek class (``sglang/srt/models/deepseek_v2.py``,
which ``DeepseekV3ForCausalLM`` maps to). On this CPU backend it loads the checkpoint and fails
on the first forward, in the attention backend (docs/deepseek-v3.md, section 8); DeepSeek-V3
trains on the embedded engine (``tests/tools/test_compare_families.py``). Slow tier (``--full``):
a server start, minutes on a crowded machine.
"""

from __future__ import annotations

import pytest
from free_ports import free_port  # tests/free_ports.py: safe beside other workers

from megatron_gspo.convert.hf_config import hf_config_from_model_config
from megatron_gspo.rollout.embedded import EmbeddedEngine
from megatron_gspo.rollout.types import RolloutEngineError
from megatron_gspo.weight_sync import write_hf_checkpoint

from .server import SKIP_REASON, server_model_config, sglang_python, start_server

DEEPSEEK_FIELDS = {
    "architecture": "deepseek_v3",
    "num_query_groups": 4,
    "first_k_dense_layers": 1,
    "shared_expert_intermediate_size": 48,
    "moe_router_num_groups": 2,
    "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5,
    "qk_layernorm": False,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
    "rope_theta": 10000.0,
    "rope_scaling_factor": 4.0,
    "rope_scaling_original_max_position_embeddings": 32,
    "yarn_mscale_all_dim": 1.0,
}
"""The CPU demo's shape as DeepSeek-V3: layer 0 dense, layer 1 routed (8 experts in 2 groups, one
group per token, top-2 scaled by 2.5) with a shared expert, MLA (query rank 32, latent 16, head
widths 16 + 16, values 12) and YaRN (factor 4 over 32 positions): the compare tool's
``--architecture deepseek_v3`` model."""
pytestmark = pytest.mark.slow


def test_sglang_cpu_backend_cannot_serve_latent_attention_yet(tmp_path):
    """SGLang 0.5.23's CPU server loads the exported DeepSeek-V3 (config.json with the published
    ``topk_method``, ``scoring_func`` and ``moe_layer_freq``) and then fails on its first prefill:
    the CPU backend's attention (``--attention-backend torch_native``, the float32 path; the
    ``intel_amx`` one needs AMX tiles and bf16) reads keys and values from MLA's latent KV pool
    (values ``kv_lora_rank`` wide) into an output of ``v_head_dim`` per head
    (``torch_native_backend.py``, ``_run_sdpa_forward_extend``, line 172). docs/deepseek-v3.md,
    section 8, has the trace. This test fails when an SGLang upgrade serves the model: then
    write the generation, routes and training checks here as ``test_glm4_moe.py`` has them."""
    python = sglang_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    model = server_model_config(**DEEPSEEK_FIELDS)
    engine = EmbeddedEngine(model, seed=0)
    write_hf_checkpoint(
        list(engine.hf_state()),
        str(tmp_path / "model"),
        config_json=hf_config_from_model_config(model).to_json_string(),
    )
    engine.close()
    with pytest.raises(RolloutEngineError) as failure:
        server = start_server(
            python, model, tmp_path / "model", tmp_path / "server.log", free_port("127.0.0.1")
        )
        server.stop()  # it served: this test's premise no longer holds
    message = str(failure.value)
    assert "torch_native_backend.py" in message and "_run_sdpa_forward_extend" in message
    assert "must match the existing size" in message
