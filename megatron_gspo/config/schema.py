"""What every section of the configuration shares: the error and warning types, the value
checks of ``__post_init__`` methods, and building the tree from plain data
(:func:`from_dict`, :func:`to_dict`). The sections themselves: :mod:`megatron_gspo.config`.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
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


def warn_config(key: str, message: str) -> None:
    # A warning, not a log line: callers can filter or catch it, and the command line prints it
    # once as a log line (megatron_gspo.runtime.console).
    warnings.warn(f"config warning at '{key}': {message}", ConfigWarning, stacklevel=3)


def check_choice(key: str, value: Any, choices: tuple, why: str) -> None:
    if value not in choices:
        raise ConfigError(
            key,
            f"{value!r} is not one of {list(choices)}",
            why,
            f"set {key} to one of {', '.join(repr(c) for c in choices)}",
        )


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (a name or address, IPv6 with or without brackets) is this machine's
    loopback interface: ``localhost``, ``127.0.0.0/8`` or ``::1``."""
    host = host.strip().strip("[]").rstrip(".").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_positive(key: str, value: float, *, allow_zero: bool = False) -> None:
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


def suggest(name: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, choices, n=3, cutoff=0.5)
    return f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""


RENAMED_KEYS: dict[str, str] = {
    # The SGLang engine's knobs moved into its own section (``rollout.sglang``), the surrogates'
    # into theirs (``algo.cispo``, ``algo.gmpo``): one section per engine and per surrogate.
    "rollout.sglang_urls": "rollout.sglang.urls",
    "rollout.sglang_launch": "rollout.sglang.launch",
    "rollout.sglang_python": "rollout.sglang.python",
    "rollout.sglang_return_routes": "rollout.sglang.return_routes",
    "rollout.sglang_host": "rollout.sglang.host",
    "rollout.sglang_port": "rollout.sglang.port",
    "rollout.sglang_tp": "rollout.sglang.tp",
    "rollout.sglang_ep": "rollout.sglang.ep",
    "rollout.sglang_mem_fraction": "rollout.sglang.mem_fraction",
    "rollout.sglang_extra_args": "rollout.sglang.extra_args",
    "rollout.sglang_release_memory": "rollout.sglang.release_memory",
    "algo.cispo_weight_low": "algo.cispo.weight_low",
    "algo.cispo_weight_high": "algo.cispo.weight_high",
    "algo.gmpo_log_clip": "algo.gmpo.log_clip",
}
"""Old key -> new key. An old key keeps working for one release, read as the new one with a
:class:`ConfigWarning` that names it; the command line, presets and plain data
(:func:`from_dict`) all go through :func:`renamed_key` / :func:`move_renamed_keys`. Giving both
is a :class:`ConfigError`."""


def renamed_key(key: str) -> str:
    """The current name of ``key`` (a full dotted key), warning when ``key`` is an old name."""
    new_key = RENAMED_KEYS.get(key)
    if new_key is None:
        return key
    warn_config(
        key,
        f"deprecated: renamed to '{new_key}', which it sets now; write '{new_key}' instead "
        "(the old name goes away in the next release)",
    )
    return new_key


def both_names_error(old_key: str, new_key: str) -> ConfigError:
    """Both the old and the new name of a renamed key are given."""
    return ConfigError(
        new_key,
        f"given twice: as '{new_key}' and as its old name '{old_key}'",
        f"'{old_key}' was renamed to '{new_key}'; the two values would fight",
        f"keep only '{new_key}'",
    )


def move_renamed_keys(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``data`` (nested plain data of the section at ``prefix``) with each old key of
    :data:`RENAMED_KEYS` moved to its new place (:func:`renamed_key` warns). The input is not
    changed; the dictionaries on the way to a moved key are copied."""
    for old_key, new_key in RENAMED_KEYS.items():
        if not old_key.startswith(prefix):
            continue
        *old_sections, old_name = old_key[len(prefix) :].split(".")
        old_parent = _section(data, old_sections)
        if old_parent is None or old_name not in old_parent:
            continue
        *new_sections, new_name = new_key[len(prefix) :].split(".")
        new_parent = _section(data, new_sections)
        if new_parent is not None and new_name in new_parent:
            raise both_names_error(old_key, new_key)
        renamed_key(old_key)
        data = _copied_path(data, old_sections)
        value = _section(data, old_sections).pop(old_name)
        data = _copied_path(data, new_sections)
        _section(data, new_sections)[new_name] = value
    return data


def _section(data: Any, path: list[str]) -> Optional[dict[str, Any]]:
    """The mapping at ``path`` under ``data``, or None where there is none."""
    for name in path:
        if not isinstance(data, dict) or not isinstance(data.get(name), dict):
            return None
        data = data[name]
    return data if isinstance(data, dict) else None


def _copied_path(data: dict[str, Any], path: list[str]) -> dict[str, Any]:
    """A copy of ``data`` whose mappings along ``path`` are copies too (created where missing),
    so that moving a key never changes the caller's data."""
    root = dict(data)
    node = root
    for name in path:
        child = node.get(name)
        node[name] = dict(child) if isinstance(child, dict) else {}
        node = node[name]
    return root


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from nested plain data, rejecting unknown keys with a suggestion.

    Renamed keys (:data:`RENAMED_KEYS`) are read under their new names, with a warning. Values
    are validated by each dataclass's ``__post_init__``.
    """
    if isinstance(data, dict):
        data = move_renamed_keys(data, prefix)
    if not isinstance(data, dict):
        raise ConfigError(
            prefix.rstrip(".") or "<root>",
            f"expected a mapping, got {type(data).__name__}",
            f"'{prefix}' is a section of the config",
            f"write '{prefix}' as key: value pairs",
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full_key = f"{prefix}{key}"
        if key not in fields:
            valid = sorted(fields)
            raise ConfigError(
                full_key,
                f"unknown key '{key}' in {cls.__name__}",
                f"{cls.__name__} has no such field, and unknown keys are never ignored",
                f"{suggest(key, valid)}valid keys are: {', '.join(valid)}",
            )
        sub_cls = section_type(cls, key)
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


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of config dataclass ``cls`` (read-only: shared). String
    annotations resolve in the module that defines ``cls``, which imports every section it
    holds; resolved once per class, since every key of every load asks."""
    return typing.get_type_hints(cls)


def section_type(cls: type, field_name: str) -> Optional[type]:
    """The dataclass that field ``field_name`` of config dataclass ``cls`` holds (a nested
    section), or None for a plain value."""
    hint = field_types(cls).get(field_name)
    return hint if dataclasses.is_dataclass(hint) else None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain nested data of a config (for logging, checkpoints and subprocess overrides)."""
    return dataclasses.asdict(config)


class StartupErrors(ConfigError):
    """Every problem found before start, each a :class:`ConfigError`."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        self.key = self.errors[0].key
        count = f"{len(errors)} problem{'s' if len(errors) > 1 else ''}"
        body = "\n\n".join(str(error) for error in self.errors)
        ValueError.__init__(self, f"{count} found before start:\n\n{body}")
