"""megatron_gspo.rollout.sglang_cpu: the CPU server's flags and environment, and which fused-MoE
shapes SGLang's AMX kernels pack only in part (the shapes whose bracketed updates are wrong)."""

from __future__ import annotations

import pytest

from megatron_gspo.rollout.sglang_cpu import (
    cpu_server_args,
    cpu_server_env,
    unpackable_expert_weights,
)


def test_float32_takes_the_plain_torch_path_and_bf16_leaves_the_choice_to_sglang(monkeypatch):
    assert cpu_server_env("float32")["SGLANG_CPU_DISABLE_AMX"] == "1"
    # "0", not absent: an inherited SGLANG_CPU_DISABLE_AMX=1 must not force bf16 off the AMX path.
    assert cpu_server_env("bfloat16")["SGLANG_CPU_DISABLE_AMX"] == "0"
    assert cpu_server_args("bfloat16")[:4] == ["--dtype", "bfloat16", "--device", "cpu"]
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_server_args("float16")


@pytest.mark.parametrize(
    "hidden, expert, unpackable",
    [
        (64, 48, ["w2 (down_proj) 64x48"]),  # the CPU demo: w13 96x64 packs, w2 does not
        (64, 64, []),  # every weight packs
        (64, 40, ["w2 (down_proj) 64x40"]),  # w13 80x64 packs, w2 64x40 not
        (48, 64, []),  # w13 128x48 does not pack: the layer stays plain, nothing half-packed
    ],
)
def test_half_packed_expert_shapes(hidden, expert, unpackable):
    assert unpackable_expert_weights(hidden, expert) == unpackable
