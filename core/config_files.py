"""YAML configs with dotted ``key=value`` overrides (torchtune style).

A config is read by one safe loader (libyaml's C one where PyYAML has it: a 50 MB file took 250 s in the pure-Python
loader) that refuses what YAML would otherwise take silently: a key given twice in one mapping (the last one
would win, dropping the first ``train:`` section's settings), a file past ``MAX_CONFIG_BYTES``, and aliases that
expand past ``MAX_CONFIG_VALUES`` values (an alias bomb). Errors quote at most ``QUOTE_CHARS`` characters of a value.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from headstart.core.io import NotWritableError, atomic_write_text

MAX_CONFIG_BYTES = 1_000_000  # the largest bundled config is a few KB
MAX_CONFIG_VALUES = 100_000  # scalars and collections once aliases are expanded
QUOTE_CHARS = 200  # of a value quoted in an error

_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(ValueError):
    """A config file or override that cannot be used as written."""


def clipped(text: str) -> str:
    """``text`` cut to ``QUOTE_CHARS`` characters: an error never prints a whole expansion."""
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text):,} characters)"


def quoted(value: Any) -> str:
    """``repr(value)``, clipped."""
    return clipped(repr(value))


class _StrictLoader(_BaseLoader):
    """The safe loader, refusing a key that a mapping gives twice (naming both lines)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(
                    f"line {line}: key {quoted(key)} is given twice in one mapping (first on line {seen[key]}); "
                    "YAML would keep the last one silently: remove one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Values ``node`` stands for once every alias is expanded (an alias is the same node object again)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = 1  # a cycle counts once: PyYAML refuses recursive aliases on construction anyway
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = size
    return size


def parse_yaml(text: str, where: str) -> Any:
    """``text`` (from ``where``: a file, an override) read by the strict safe loader; ConfigError naming ``where``."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_CONFIG_VALUES:
            raise ConfigError(f"its aliases expand to more than {MAX_CONFIG_VALUES:,} values (an alias bomb?): refused")
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {clipped(str(err))}") from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    finally:
        loader.dispose()


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """Read a YAML config and apply ``a.b.c=value`` overrides (values parsed as YAML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size:,} bytes, more than a config's {MAX_CONFIG_BYTES:,}: refused")
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    config = parse_yaml(text, str(path)) or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(config).__name__}")
    return apply_overrides(config, overrides or [])


def apply_overrides(config: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``config`` with each ``dotted.key=value`` override applied."""
    config = copy.deepcopy(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {quoted(item)} is not of the form dotted.key=value")
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {quoted(item)}: {part!r} is a value, not a section")
            node = child
        node[leaf] = parse_yaml(raw, f"override {quoted(item)}") if raw else ""
    return config


# What a command refuses before its work, said without a traceback: a config, flag or input that cannot be used, and
# an output folder nothing can be written to (``core.io.check_writable``, checked before the work it would lose).
REFUSALS: tuple[type[Exception], ...] = (ConfigError, NotWritableError)


def run_command(main: Callable[[], Any], prog: str) -> Any:
    """A command's ``main`` run as its ``__main__`` (``python -m ...``, ``torchrun train/eagle.py``): a refusal of
    what it was given (``REFUSALS``) ends with its message alone on stderr and exit code 2, as ``headstart VERB`` and
    argparse end theirs; any other exception is a fault and keeps its traceback."""
    try:
        return main()
    except REFUSALS as err:
        sys.stderr.write(f"{prog}: {err}\n")
        raise SystemExit(2) from None


def save_config(config: dict[str, Any], path: str | Path, note: str = "") -> None:
    """Write the resolved config beside the artifact it produced (atomically); ``note``, what the keys alone do
    not say (what an ``auto`` became), as a YAML comment above them."""
    comment = "".join(f"# {line}\n" for line in note.splitlines())
    atomic_write_text(path, comment + yaml.safe_dump(config, sort_keys=False))
