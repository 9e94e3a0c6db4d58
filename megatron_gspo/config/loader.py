"""Compose a :class:`~megatron_gspo.config.TrainConfig` from a Hydra preset and overrides.

The schema (:class:`TrainConfig`) is registered in Hydra's ConfigStore as ``megatron_gspo``;
presets start with ``defaults: [megatron_gspo, _self_]`` so Hydra type-checks them against it.
Overrides use Hydra's grammar (``algo.clip_low=3e-4``, ``parallel.tp=2``,
``'reward.functions=[math,format]'``). Hydra's own errors for unknown keys suggest ``+key=`` (which
would be wrong here: the schema is closed), so they are translated into :class:`ConfigError`\\ s
that name the key, the valid keys and the closest match.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Optional

from megatron_gspo.config.schema import (
    RENAMED_KEYS,
    ConfigError,
    both_names_error,
    field_types,
    from_dict,
    move_renamed_keys,
    renamed_key,
    section_type,
    suggest,
)
from megatron_gspo.config.tree import TrainConfig

SCHEMA_NAME = "megatron_gspo"
PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""``megatron_gspo/``: this module lives in its ``config/`` package."""
EXAMPLES_DIR = PACKAGE_DIR.parent / "examples" / "moe"
"""The presets' one source: ``examples/moe/`` of a source checkout (also of an editable
install), where users read and copy them."""
PACKAGED_PRESETS_DIR = PACKAGE_DIR / "presets"
"""The copy of ``examples/moe/*.yaml`` that a built package carries (setup.py's build step), for
installs without a checkout beside them."""


def presets_dir() -> Path:
    """Where ``--preset NAME`` looks: the checkout's examples/moe/, else the packaged copy."""
    return EXAMPLES_DIR if EXAMPLES_DIR.is_dir() else PACKAGED_PRESETS_DIR


def register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainConfig)


def resolve_preset(name_or_path: Optional[str]) -> tuple[Optional[str], str]:
    """``(config_dir, config_name)`` for a preset name (``roll_gspo``), a YAML path, or None."""
    if name_or_path is None:
        return None, SCHEMA_NAME
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(
                "preset",
                f"preset file {str(path)!r} does not exist",
                "a preset is a YAML file",
                "give an existing path, or the name of a preset in examples/moe/",
            )
        return str(path.resolve().parent), path.stem
    directory = presets_dir()
    candidate = directory / f"{name_or_path}.yaml"
    if not candidate.is_file():
        known = sorted(p.stem for p in directory.glob("*.yaml")) if directory.is_dir() else []
        raise ConfigError(
            "preset",
            f"no preset named {name_or_path!r}",
            f"presets are the YAML files of {directory}",
            f"{suggest(name_or_path, known)}known presets: {', '.join(known) or '(none)'}",
        )
    return str(directory), name_or_path


def compose(preset: Optional[str] = None, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """Hydra composition of ``preset`` + ``overrides`` into plain nested data."""
    from hydra import compose as hydra_compose
    from hydra import initialize, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    register_schema()
    config_dir, config_name = resolve_preset(preset)
    if config_dir is not None:
        config_name = _preset_with_current_keys(config_dir, config_name)
    overrides = overrides_into_open_sections(overrides_with_current_keys(list(overrides or [])))
    GlobalHydra.instance().clear()
    context = (
        initialize_config_dir(config_dir=config_dir, version_base=None)
        if config_dir
        else initialize(config_path=None, version_base=None)
    )
    try:
        with context:
            composed = hydra_compose(config_name=config_name, overrides=overrides)
    except Exception as error:  # Hydra and OmegaConf raise several unrelated classes
        raise _translate(error, overrides) from None
    return OmegaConf.to_container(composed, resolve=True)


MIGRATED_PRESET_NAME = "_megatron_gspo_preset_with_current_keys"
"""The name under which a preset that uses renamed keys is composed, its keys renamed."""


def _preset_with_current_keys(config_dir: str, config_name: str) -> str:
    """The name to compose the preset ``config_dir/config_name.yaml`` by: its own, or, when it
    uses renamed keys (:data:`~megatron_gspo.config.schema.RENAMED_KEYS`), that of a copy with
    the current keys in Hydra's ConfigStore. Hydra checks a preset against the closed schema, so
    an old key must be renamed before it composes; the copy keeps the preset's defaults list and
    ``config_dir`` stays the search path for what it names."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    path = Path(config_dir) / f"{config_name}.yaml"
    if not path.is_file():
        return config_name
    # Unresolved: interpolations are Hydra's to resolve, after composition.
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(data, dict):
        return config_name
    moved = move_renamed_keys(data)
    if moved is data:
        return config_name
    ConfigStore.instance().store(name=MIGRATED_PRESET_NAME, node=OmegaConf.create(moved))
    return MIGRATED_PRESET_NAME


def overrides_with_current_keys(overrides: list[str]) -> list[str]:
    """``overrides`` with each renamed key (``rollout.sglang_host=...``) under its new name,
    warning for each; a :class:`ConfigError` when a key is given under both names."""
    result = []
    old_keys = {}  # new key -> the old name it was given under
    for override in overrides:
        key_start = len(override) - len(override.lstrip("+~"))
        key, separator, value = override[key_start:].partition("=")
        if key in RENAMED_KEYS:
            old_keys[RENAMED_KEYS[key]] = key
            key = renamed_key(key)
        result.append(override[:key_start] + key + separator + value)
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key in old_keys:
            raise both_names_error(old_keys[key], key)
    return result


def open_sections(cls: type = TrainConfig, prefix: str = "") -> list[str]:
    """Keys of the free-form mappings in the schema (``reward.options``, ``env.options``): the
    user's own keys go below them, so no schema lists what they may hold."""
    found = []
    hints = field_types(cls)
    for field in dataclasses.fields(cls):
        sub = section_type(cls, field.name)
        if sub is not None:
            found += open_sections(sub, f"{prefix}{field.name}.")
        elif typing.get_origin(hints[field.name]) is dict:
            found.append(f"{prefix}{field.name}")
    return found


def overrides_into_open_sections(overrides: list[str]) -> list[str]:
    """Overrides of a key below a free-form mapping (``reward.options.code.timeout_s=10``) in
    Hydra's add-or-replace form (``++``). Hydra refuses a key the mapping does not hold yet
    unless it is written ``+key=``; the docs and error messages write the plain form, which
    means the same thing here."""
    sections = tuple(f"{section}." for section in open_sections())
    return [
        f"++{override}"
        if not override.startswith(("+", "~")) and override.split("=", 1)[0].startswith(sections)
        else override
        for override in overrides
    ]


def load_config(preset: Optional[str] = None, overrides: Optional[list[str]] = None) -> TrainConfig:
    """Validated :class:`TrainConfig` from a preset and Hydra overrides."""
    data = compose(preset, overrides)
    data.pop("hydra", None)
    return from_dict(TrainConfig, data)


def _translate(error: Exception, overrides: list[str]) -> ConfigError:
    """Turn Hydra/OmegaConf composition errors into actionable :class:`ConfigError`\\ s."""
    # Hydra chains its exceptions through __context__ as well as __cause__; the innermost one that
    # carries a full_key is OmegaConf's, and its text is the useful one.
    chain, seen = [], set()
    link: Optional[BaseException] = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        chain.append(link)
        link = link.__cause__ or link.__context__
    keyed = [e for e in chain if getattr(e, "full_key", None)]
    root = keyed[-1] if keyed else chain[-1]
    full_key = getattr(root, "full_key", None)
    text = str(root)
    if full_key is None:
        # Hydra's "Could not override 'a.b'" messages carry the key only in the text.
        for override in overrides:
            key = override.lstrip("+~").split("=", 1)[0]
            if f"'{key}'" in str(error):
                full_key = key
                break
    if full_key and ("not in struct" in text or "not in '" in text or "Key '" in text):
        section, _, name = full_key.rpartition(".")
        valid = _valid_keys(section)
        return ConfigError(
            full_key,
            f"unknown key '{name}'",
            "the configuration schema is closed: an unknown key is a typo or a setting that does "
            "not exist, and it is never ignored",
            f"{suggest(name, valid)}valid keys{' of ' + section if section else ''}: "
            f"{', '.join(valid)}",
        )
    if full_key:
        return ConfigError(
            full_key,
            text.splitlines()[0],
            "the value does not have the type the schema declares",
            f"give {full_key} a value of the declared type (see `--help` or docs/configuration.md)",
        )
    return ConfigError(
        "<overrides>",
        str(error).splitlines()[0] if str(error) else type(error).__name__,
        "Hydra could not compose the configuration",
        "check the override syntax: key=value, lists as 'key=[a,b]', null for None",
    )


def _valid_keys(section: str) -> list[str]:
    cls: Any = TrainConfig
    for part in filter(None, section.split(".")):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields or section_type(cls, part) is None:
            return []
        cls = section_type(cls, part)
    return sorted(f.name for f in dataclasses.fields(cls))


def overrides_from_env() -> list[str]:
    """Extra overrides from MEGATRON_GSPO_OVERRIDES (space-separated), for launch scripts."""
    return os.environ.get("MEGATRON_GSPO_OVERRIDES", "").split()
