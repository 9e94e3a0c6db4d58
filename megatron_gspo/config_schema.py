"""What every section of the configuration shares: the error and warning types, the value
checks of ``__post_init__`` methods, and building the tree from plain data
(:func:`from_dict`, :func:`to_dict`). The sections themselves: :mod:`megatron_gspo.config`.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
import warnings
from typing import Any, Optional


class ConfigError(ValueError):
    """An invalid configuration, reported before any work starts."""

    def __init__(self, key: str, what: str, why: str, fix: str):
        self.key = key
        super().__init__(f"config error at '{key}': {what}\n  why: {why}\n  fix: {fix}")


class ConfigWarning(UserWarning):
    """A configuration that is valid but probably not what the user wants."""


def _warn(key: str, message: str) -> None:
    # A warning, not a log line: callers can filter or catch it, and the command line prints it
    # once as a log line (megatron_gspo.console).
    warnings.warn(f"config warning at '{key}': {message}", ConfigWarning, stacklevel=3)


def _check_choice(key: str, value: Any, choices: tuple, why: str) -> None:
    if value not in choices:
        raise ConfigError(
            key,
            f"{value!r} is not one of {list(choices)}",
            why,
            f"set {key} to one of {', '.join(repr(c) for c in choices)}",
        )


def _is_loopback(host: str) -> bool:
    # Imported here: the rollout package is not needed to read a configuration.
    from megatron_gspo.rollout.auth import is_loopback_host

    return is_loopback_host(host)


def _check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value is None or (value < 0 if allow_zero else value <= 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            key,
            f"{value!r} is not {bound}",
            "a count or size must be positive",
            f"set {key} {bound}",
        )


# --------------------------------------------------------------------------------------------
# Building the tree from plain data
# --------------------------------------------------------------------------------------------


def _suggest(name: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from nested plain data, rejecting unknown keys with a suggestion.

    Values are validated by each dataclass's ``__post_init__``.
    """
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>",
            f"expected a mapping, got {type(data).__name__}",
            f"'{prefix}' is a section of the config",
            f"write '{prefix}' as key: value pairs",
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        full_key = f"{prefix}{key}"
        if key not in fields:
            valid = sorted(fields)
            raise ConfigError(
                full_key,
                f"unknown key '{key}' in {cls.__name__}",
                f"{cls.__name__} has no such field, and unknown keys are never ignored",
                f"{_suggest(key, valid)}valid keys are: {', '.join(valid)}",
            )
        field_type = fields[key].type
        sub_cls = _dataclass_of(field_type)
        if sub_cls is not None:
            kwargs[key] = from_dict(sub_cls, value, prefix=f"{full_key}.")
        else:
            kwargs[key] = _checked_value(full_key, value, hints[key])
    return cls(**kwargs)


def _checked_value(key: str, value: Any, annotation: Any) -> Any:
    """``value`` if it has the declared type (ints are accepted for floats), else a ConfigError."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        (annotation,) = [a for a in args if a is not type(None)]
        return _checked_value(key, value, annotation)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            _type_error(key, value, annotation)
        return [_checked_value(f"{key}[{i}]", item, args[0]) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            _type_error(key, value, annotation)
        return {
            _checked_value(f"{key}.<key>", name, args[0]): _checked_value(
                f"{key}.{name}", item, args[1]
            )
            for name, item in value.items()
        }
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is Any or (
        isinstance(value, annotation) and not (annotation is int and isinstance(value, bool))
    ):
        return value
    _type_error(key, value, annotation)


def _type_error(key: str, value: Any, annotation: Any) -> None:
    name = getattr(annotation, "__name__", str(annotation))
    raise ConfigError(
        key,
        f"{value!r} ({type(value).__name__}) is not a {name}",
        "the schema declares the type of every field",
        f"give {key} a {name} value",
    )


def _dataclass_of(type_name: Any) -> Optional[type]:
    """The dataclass a field holds, resolving string annotations (the sections' names) in
    :mod:`megatron_gspo.config`, which holds or imports every section."""
    if isinstance(type_name, str):
        type_name = vars(importlib.import_module("megatron_gspo.config")).get(type_name)
    return type_name if dataclasses.is_dataclass(type_name) else None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested data of a config (for logging, checkpoints and subprocess overrides)."""
    return dataclasses.asdict(config)
