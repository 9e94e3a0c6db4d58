"""Megatron-Core imported without building ``torch.compile``'s backend (docs/megatron-cpu.md,
"Start-up").

Megatron-Core decorates its fused functions with ``torch.compile`` when their modules are imported
(``megatron.core.jit.jit_fuser``, torch >= 2.2). Decorating already builds the inductor backend,
which imports ``torch._dynamo`` and ``torch._inductor``: about 3 s of CPU of the ~9 s that
``import megatron.core`` takes, paid by every rank of every launch, although nothing is compiled
before a decorated function's first call (and no decorated function runs on the CPU path: the one
that did, the router's expert-bias update, is unwrapped by CPU shim 7b).

:func:`install` (called by ``megatron_gspo.engine``'s ``__init__``, before any engine module
imports Megatron) makes the first import of ``megatron.core`` run with ``torch.compile`` replaced
by :func:`compile_on_first_call`'s decorator: it calls the real ``torch.compile`` with the same
arguments on the function's first call, so a function that runs is compiled exactly as before,
only later. ``megatron.core.jit.jit_fuser`` keeps the deferring decorator, so the modules that
Megatron imports later defer too. Stdlib only at import: the engine's package stays light.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

MEGATRON_CORE = "megatron.core"


def compile_on_first_call(compile_function: Callable) -> Callable:
    """A stand-in for ``compile_function`` (``torch.compile``) that compiles a function with the
    same arguments when it is first called, instead of when it is decorated."""

    def deferred_compile(model: Callable | None = None, **options: Any) -> Callable:
        if model is None:  # used as @torch.compile(...)
            return lambda function: deferred_compile(function, **options)
        compiled: Callable | None = None

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal compiled
            if compiled is None:
                compiled = compile_function(model, **options)
            return compiled(*args, **kwargs)

        # torch.compile's own wrapper names the original so: CPU shim 7b unwraps through it.
        call._torchdynamo_orig_callable = model
        return call

    return deferred_compile


class _DeferringLoader(importlib.abc.Loader):
    """Runs ``megatron.core``'s ``__init__`` (and every module it imports) with ``torch.compile``
    deferred; everything else is the wrapped loader's."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # Lazy: the engine's package imports this module and stays light; Megatron needs torch.
        import torch

        original = torch.compile
        torch.compile = compile_on_first_call(original)
        try:
            self._loader.exec_module(module)
        finally:
            torch.compile = original

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...
        return getattr(self._loader, name)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core`` with the other finders and wraps its loader."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MEGATRON_CORE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _DeferringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Defers ``torch.compile`` during the first import of ``megatron.core``; nothing when
    Megatron is already imported (its functions are decorated) or the finder is installed."""
    if MEGATRON_CORE in sys.modules:
        return
    if any(isinstance(finder, _MegatronCoreFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())
