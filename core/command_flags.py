"""The flag-driven commands' settings: a ``CommandFlags`` section per command (``python -m eval.acceptance``,
``import_head``, ``verify_engines``, ...), whose fields are both its flags and its config section's keys, checked
by the one settings check (``core.settings``)."""

from __future__ import annotations

import argparse
import json
import re
import sys
import typing
from typing import Any, ClassVar, Literal, TypeVar

from pydantic.fields import FieldInfo

from headstart.core.config_files import ConfigError
from headstart.core.settings import Registered, Section, check, describe, strip_optional, union_members

Flags = TypeVar("Flags", bound="CommandFlags")


class CommandFlags(Section):
    """The settings of a command driven by flags (``python -m eval.acceptance --target ...``): one declaration
    from which the command's flags are built (``add_flags``), and which its config section (``eval:``) holds.

    Each field is the flag of that name (``max_new_tokens`` is ``--max-new-tokens``) with the field's type, choices,
    default and description (its help); ``positional`` names the fields the command takes as positional arguments.
    A list is given comma-separated or by repeating its flag. The command runs on the validated settings
    (``from_args``), whether they came from flags or from a config's section (``headstart <command> --config``).
    """

    section: ClassVar[str]  # its key in a config file (``eval``; ``import_head``: ``import`` is Python's)
    positional: ClassVar[tuple[str, ...]] = ()
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {}  # a field's flag spellings, where not only --its-name

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """A flag per field. Flags left out stay out of the namespace (``SUPPRESS``): the field's default is
        the model's, declared once."""
        for name, field in cls.model_fields.items():
            scalar, many, choices = _flag_shape(field.annotation)
            registered = _registered(field)
            choices = list(registered.names()) if registered is not None else choices
            # Choices are the model's to check (argparse would say it in other words than a config's check).
            shown = [f"one of {', '.join(map(str, choices))}"] if choices else []
            shown += [] if field.is_required() else [f"default: {_shown(field.default)}"]
            note = f" ({'; '.join(shown)})" if shown else ""
            # argparse %-formats help strings: a literal "2%" in a description would break --help
            text = ((field.description or "") + note).replace("%", "%%")
            options: dict[str, Any] = {"help": text, "default": argparse.SUPPRESS}
            if name in cls.positional:
                parser.add_argument(name, type=scalar, **options)
                continue
            flags = cls.aliases.get(name, ("--" + name.replace("_", "-"),))
            if scalar is bool:
                parser.add_argument(*flags, dest=name, action="store_true", **options)
            elif many:
                options |= {"metavar": name.upper() + "[,...]", "required": field.is_required()}
                parser.add_argument(*flags, dest=name, action="append", type=_items(scalar), **options)
            else:
                options["required"] = field.is_required()
                parser.add_argument(*flags, dest=name, type=scalar, **options)

    @classmethod
    def parser(cls, prog: str, description: str) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog=prog, description=description)
        cls.add_flags(parser)
        return parser

    @classmethod
    def parse_flags(
        cls: type[Flags], parser: argparse.ArgumentParser, argv: list[str] | None
    ) -> tuple[Flags, argparse.Namespace]:
        """``argv`` through ``parser`` (``parser()``, perhaps with flags of the command's own): the validated
        settings and the parsed namespace; a problem exits as argparse does (code 2), naming its flag."""
        args = parser.parse_args(argv)
        try:
            return cls.from_args(args), args
        except ConfigError as err:
            parser.error(str(err))

    @classmethod
    def from_argv(cls: type[Flags], argv: list[str] | None, prog: str, description: str) -> Flags:
        """A command line of exactly these flags as validated settings (``parser``, then ``parse_flags``)."""
        return cls.parse_flags(cls.parser(prog, description), argv)[0]

    @classmethod
    def from_args(cls: type[Flags], args: argparse.Namespace) -> Flags:
        """The parsed flags as validated settings; ConfigError naming each problem by its flag (``--top-p must
        be <= 1, got 2.0``): ``python -m eval.acceptance`` refuses what ``headstart eval`` does."""
        given = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        for name, value in given.items():  # a repeated list flag: its comma-separated parts, in order
            if isinstance(value, list) and value and isinstance(value[0], list):
                given[name] = [item for part in value for item in part]
        settings, problems = check(given, cls)
        if settings is None:
            raise ConfigError("; ".join(_as_flag(cls, problem) for problem in problems))
        return settings

    def as_config(self) -> dict[str, Any]:
        """The settings as a config, ``{section: {key: value}}``: the command saves it beside what it wrote, and
        ``headstart <command> --config`` on it runs the same again."""
        return {self.section: self.model_dump(mode="json")}

    @classmethod
    def keys_help(cls) -> list[str]:
        """The section's keys for ``headstart <command> --help``: each with its type and default."""
        lines = []
        for name, field in cls.model_fields.items():
            default = "required" if field.is_required() else f"default {json.dumps(field.default)}"
            lines.append(f"{cls.section}.{name}: {describe(field.annotation)} ({default})")
        return lines


def _registered(field: FieldInfo) -> Registered | None:
    """The registry a name field, or each name of a list field, is checked against."""
    metadata = list(field.metadata)
    for member in union_members(field.annotation):
        if typing.get_origin(member) is list:
            metadata += getattr(typing.get_args(member)[0], "__metadata__", ())
    return next((m for m in metadata if isinstance(m, Registered)), None)


def _flag_shape(annotation: Any) -> tuple[Any, bool, list[Any] | None]:
    """(the type one value on the command line converts to, whether the field is a list, its choices)."""
    members = [a for a in union_members(annotation) if a is not type(None)]
    many = any(typing.get_origin(a) is list for a in members)
    if many:
        members = [strip_optional(typing.get_args(next(a for a in members if typing.get_origin(a) is list))[0])]
    member = members[0]
    if typing.get_origin(member) is Literal:
        choices = list(typing.get_args(member))
        return type(choices[0]), many, choices
    return member, many, None


def _items(scalar: Any) -> Any:
    def convert(text: str) -> list[Any]:
        return [scalar(item.strip()) for item in text.split(",") if item.strip()]

    convert.__name__ = getattr(scalar, "__name__", "value")  # argparse names the type in its errors
    return convert


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def command_failed(message: str) -> typing.NoReturn:
    """A flag-driven command stops on what it was given, as argparse stops on a bad flag: the message on stderr,
    exit code 2, whether the settings came from flags or from a config (``headstart <command>``)."""
    sys.stderr.write(message.rstrip("\n") + "\n")
    raise SystemExit(2)


def _as_flag(flags: type[CommandFlags], problem: str) -> str:
    """``top_p must be ...`` -> ``--top-p must be ...``: on the command line a key is its flag."""
    key = re.match(r"(\w+)", problem)
    if key is None or key[1] not in flags.model_fields:
        return problem
    return "--" + key[1].replace("_", "-") + problem[key.end() :]
