"""User code named in the configuration: a built-in name, or an import path
``package.module:attribute`` (reward functions, environments), resolved to the callable it names
with a :class:`~megatron_gspo.config.ConfigError` (what, why, fix) for each way it can fail."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from megatron_gspo import MOVED_MODULES
from megatron_gspo.config.schema import ConfigError


def load_named_callable(
    key: str,
    name: str,
    builtins: Mapping[str, str],
    what: str,
    attribute_kind: str,
    placeholder: str,
) -> Callable:
    """The callable ``name`` stands for: ``builtins[name]`` (an import path) or ``name`` itself
    when it has a ``:``. ``key`` is the configuration key the errors name; ``what`` says what is
    loaded ("reward function"), ``attribute_kind`` what the part after ``:`` names ("function")
    and ``placeholder`` how the error's example import path writes it."""
    if name not in builtins and ":" not in name:
        raise ConfigError(
            key,
            f"unknown {what} {name!r}",
            f"valid names are the built-ins {', '.join(sorted(builtins))}, or an import path "
            f"'package.module:{placeholder}'",
            f"use one of the built-in names, or write your {what}'s import path",
        )
    module_name, _, attribute = builtins.get(name, name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # any import-time failure of user code lands here
        moved = isinstance(error, ModuleNotFoundError) and error.name in MOVED_MODULES
        raise ConfigError(
            key,
            f"cannot import module {module_name!r}: {type(error).__name__}: {error}",
            "megatron_gspo was divided into packages and this module moved"
            if moved
            else "the module named before ':' must be importable from the trainer's Python path",
            f"write {MOVED_MODULES[error.name].split()[0]}:{attribute}"
            if moved
            else "install the package, or add its directory to PYTHONPATH",
        ) from error
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ConfigError(
            key,
            f"module {module_name!r} has no {attribute_kind} {attribute!r}",
            "the name after ':' is looked up in the module",
            f"check the spelling; the module defines: {_public_callables(module)}",
        )
    return found


def _public_callables(module: Any) -> str:
    names = [
        name
        for name, value in vars(module).items()
        if (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
        and not name.startswith("_")
    ]
    return ", ".join(sorted(names)[:20]) or "(no functions or classes)"
