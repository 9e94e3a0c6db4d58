"""Megatron-Core's torch.compile decorations build nothing at import (engine/deferred_compile.py),
and a decorated function is compiled with the same arguments on its first call."""

from __future__ import annotations

import subprocess
import sys

from megatron_gspo.engine.deferred_compile import compile_on_first_call


def test_a_function_is_compiled_on_its_first_call_with_the_same_arguments():
    calls = []

    def fake_compile(model, **options):
        calls.append((model, options))
        return lambda *args, **kwargs: ("compiled", model(*args, **kwargs))

    deferred = compile_on_first_call(fake_compile)

    def add(a, b=1):
        return a + b

    decorated = deferred(add, dynamic=False)
    factory_decorated = deferred(mode="max-autotune")(add)
    assert calls == [], "compiled when decorated"
    assert decorated(1, b=2) == ("compiled", 3) and decorated(2) == ("compiled", 3)
    assert factory_decorated(5) == ("compiled", 6)
    assert calls == [(add, {"dynamic": False}), (add, {"mode": "max-autotune"})]
    assert decorated.__name__ == "add" and decorated._torchdynamo_orig_callable is add


IMPORT_CHECK = """
import sys
import megatron_gspo.engine.model  # imports megatron.core through the engine
import torch
import megatron.core.jit
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.transformer.moe.router import TopKRouter
assert torch.compile.__module__ == "torch", "torch.compile left replaced"
compiler = [name for name in ("torch._inductor.compile_fx", "torch._dynamo.eval_frame")
            if name in sys.modules]
assert not compiler, f"built at import: {compiler}"
function = fused_bias_swiglu.swiglu
assert function._torchdynamo_orig_callable.__name__ == "swiglu", function
# CPU shim 7b still unwraps the router's expert-bias update (through the deferring decorator).
assert TopKRouter._apply_expert_bias._torchdynamo_orig_callable.__name__ == "_apply_expert_bias"
from megatron_gspo.engine.compat import apply_cpu_shims
assert apply_cpu_shims()
assert not hasattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable")
print("ok")
"""


def test_megatron_is_imported_without_building_the_compiler():
    completed = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", IMPORT_CHECK],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr[-3000:]
