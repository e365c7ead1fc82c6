"""YAML configs with dotted ``key=value`` overrides (torchtune style)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file or override that cannot be used as written."""


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config and apply ``a.b.c=value`` overrides (values parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    with path.open() as f:
        try:
            config = yaml.safe_load(f) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(config).__name__}")
    return apply_overrides(config, overrides or [])


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``config`` with each ``dotted.key=value`` override applied."""
    config = copy.deepcopy(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[leaf] = yaml.safe_load(raw) if raw else ""
    return config


def save_config(config: dict[str, Any], path: str | Path, note: str = "") -> None:
    """Write the resolved config beside the artifact it produced (atomically); ``note``, what the keys alone do
    not say (what an ``auto`` became), as a YAML comment above them."""
    from headstart.core.io import atomic_write_text

    comment = "".join(f"# {line}\n" for line in note.splitlines())
    atomic_write_text(path, comment + yaml.safe_dump(config, sort_keys=False))
