"""Settings, typed: the base every config section is made of, the value types they share, and the check that
turns a YAML mapping into a validated section or one ConfigError naming every problem by its dotted key.

Each command's and each head's settings are a ``Section`` declared beside the code that reads them
(``train.config.Train``, ``data_recipes.settings.Capture``, ``heads.eagle3.Eagle3Options``, ...); a command's
root model (``Stage``) composes the sections it reads, and ``scripts.config`` composes every section into the
whole file's schema, which ``headstart`` checks before any verb runs. ``parse`` returns the validated model,
which the code reads as attributes (``cfg.train.lr``), so mypy checks every read.

Values are checked strictly: no string is read as a number, no number as a flag. The one exception is
YAML 1.1's: it reads ``1e-4`` (an exponent without a dot) as a string, so a float accepts numeric strings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import types
import typing
from collections.abc import Iterable, Iterator
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, TypeVar, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails, PydanticCustomError

from headstart.core.config import ConfigError

Settings = TypeVar("Settings", bound="Section")
Flags = TypeVar("Flags", bound="CommandFlags")


def _yaml_number(value: Any) -> Any:
    if isinstance(value, str):
        with contextlib.suppress(ValueError):  # not a number: reported as a wrong type
            return float(value)
    return value


def not_a_flag(value: Any) -> Any:
    # Literal[0, 1, ...] takes True for 1 (True == 1 in Python); a yes/no where a number belongs is a mistake.
    if isinstance(value, bool):
        raise PydanticCustomError("literal_error", "not one of the choices")
    return value


Float = Annotated[float, BeforeValidator(_yaml_number), Field(allow_inf_nan=False)]
Positive = Annotated[Float, Field(gt=0)]
NonNegativeFloat = Annotated[Float, Field(ge=0)]
Fraction = Annotated[Float, Field(ge=0, le=1)]
Decay = Annotated[Float, Field(gt=0, le=1)]  # weight decay**k of the k-th term: 0 drops them all, > 1 grows
Count = Annotated[int, Field(ge=1)]  # sizes, steps, lengths: at least one
NonNegative = Annotated[int, Field(ge=0)]


def _a_folder(path: str) -> str:
    if not path.strip():  # an empty path would be the folder the command runs in
        raise PydanticCustomError("value", "must name a folder, got '{path}'", {"path": path})
    return path


Folder = Annotated[str, AfterValidator(_a_folder)]  # where a command writes: a named folder or file, never ""
Dtype = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16"]
StoreDtype = Literal["fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "fp8_e4m3"]  # shards only


class Section(BaseModel):
    """A mapping with exactly these keys (an unknown key is a typo), values checked strictly."""

    model_config = ConfigDict(extra="forbid", strict=True)
    command: ClassVar[str] = "config"  # as a root model: who reads it ("invalid capture config: ...")
    top_level: ClassVar[str] = "key"  # as a root model: what its keys are called in errors


def one_of(names: Iterable[str]) -> Any:
    """The Literal of ``names``: a key's choices read from the registry that declares them (``FORMATS``), not
    copied. mypy sees such a type as ``str`` (declare it under ``if TYPE_CHECKING``)."""
    return Literal.__getitem__(tuple(names))


# Every top-level section a config file may hold, in pipeline order. Each is declared beside the command that
# reads it; scripts.config composes them all into the whole file's schema (and checks it holds exactly these).
SECTIONS = (
    "target", "data", "capture", "regenerate", "head", "train", "lora", "wandb", "metrics",
    "eval", "autotune", "export", "import_head", "push", "verify_engines",
)  # fmt: skip


class Stage(Section):
    """A command's config: the sections it reads as fields (required, or ``X | None = None``). The file's other
    ``SECTIONS`` belong to other commands, declared where this one cannot import them: they are left for those
    commands (and for ``headstart``, which checks the whole file first); a top-level key that is no section is
    an error."""

    top_level: ClassVar[str] = "section"

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_absent(cls, config: Any) -> Any:
        # `wandb:` with every line commented out is YAML null: the section's defaults, not an error.
        return {k: v for k, v in config.items() if v is not None} if isinstance(config, dict) else config


def check(config: dict[str, Any], schema: type[Settings]) -> tuple[Settings | None, list[str]]:
    """``config`` as a ``schema`` (defaults filled in), or None and every problem found."""
    problems = []
    if issubclass(schema, Stage):
        known = set(schema.model_fields)
        problems = [
            f"unknown section {key!r} (known: {', '.join(sorted(SECTIONS))})"
            for key in config
            if key not in known and key not in SECTIONS
        ]
        config = {key: value for key, value in config.items() if key in known}
    try:
        resolved = schema.model_validate(config)
    except ValidationError as err:
        for problem in _problems(schema, config, err.errors()):
            if problem not in problems:  # several members of a union may refuse a value alike
                problems.append(problem)
        return None, problems
    return (None, problems) if problems else (resolved, [])


def parse(config: dict[str, Any], schema: type[Settings]) -> Settings:
    """``config`` as a ``schema``, or one ConfigError listing every problem."""
    resolved, problems = check(config, schema)
    raise_problems(schema, problems)
    assert resolved is not None
    return resolved


def as_dict(settings: BaseModel) -> dict[str, Any]:
    """Validated settings as the YAML mapping that gives them again: an absent optional section stays absent."""
    return {key: value for key, value in settings.model_dump(mode="json").items() if value is not None}


def raise_problems(schema: type[Section], problems: list[str]) -> None:
    if problems:
        raise ConfigError(f"invalid {schema.command} config:\n  " + "\n  ".join(problems))


# ---- the flag-driven commands: a section each, a field per flag


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
            # Choices are the model's to check (argparse would say it in other words than a config's check).
            shown = [f"one of {', '.join(map(str, choices))}"] if choices else []
            shown += [] if field.is_required() else [f"default: {_shown(field.default)}"]
            note = f" ({'; '.join(shown)})" if shown else ""
            options: dict[str, Any] = {"help": (field.description or "") + note, "default": argparse.SUPPRESS}
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
            lines.append(f"{cls.section}.{name}: {_describe(field.annotation)} ({default})")
        return lines


def _flag_shape(annotation: Any) -> tuple[Any, bool, list[Any] | None]:
    """(the type one value on the command line converts to, whether the field is a list, its choices)."""
    members = [a for a in _union_args(annotation) if a is not type(None)]
    many = any(typing.get_origin(a) is list for a in members)
    if many:
        members = [_strip(typing.get_args(next(a for a in members if typing.get_origin(a) is list))[0])]
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


# ---- pydantic's errors, told as "<dotted key> must be ..., got ..."

_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<=")}
_BOUNDS |= {"less_than": ("lt", "<")}


class _Where(NamedTuple):
    key: str  # dotted, e.g. "capture.aux_layers" or "stages[0].cmd"
    model: type[Section]  # the model holding the field (or refusing an extra key)
    field: FieldInfo | None  # None: the error is about a key of ``model`` that is not a field
    annotation: Any  # the field's type, or the union member the value was checked against
    rest: list  # what is left of pydantic's loc: list indices, union member names, an extra key
    tagged: tuple[str, str] | None  # (key, tag) when the path went through a tagged union (head.type)


def _problems(schema: type[Section], config: dict[str, Any], errors: list[ErrorDetails]) -> Iterator[str]:
    located = [(error, _locate(schema, error["loc"])) for error in errors]
    # A value of a union (capture.aux_layers: "auto" or a list) that has one member's shape (a list) is
    # refused by the others for its shape alone: report why the member it looks like refused it.
    shaped = {where.key for _, where in located if len(where.rest) > 1 and isinstance(where.rest[0], str)}
    for error, where in located:
        if where.key in shaped and where.rest and isinstance(where.rest[0], str):
            if len(where.rest) == 1:
                continue
            member = next(a for a in _union_args(where.annotation) if typing.get_origin(a) is list)
            where = where._replace(rest=where.rest[1:], annotation=member)
        yield _problem(schema, config, error, where)


def _problem(schema: type[Section], config: dict[str, Any], error: ErrorDetails, where: _Where) -> str:
    key, model, field, annotation, rest, tagged = where
    kind, got = error["type"], f"got {error.get('input')!r}"
    if kind == "extra_forbidden":
        known = ", ".join(sorted(model.model_fields))
        if not key:
            return f"unknown {schema.top_level} {rest[0]!r} (known: {known})"
        what = f" for a {tagged[1]} {tagged[0]}" if tagged else ""
        return f"unknown key {key}.{rest[0]}{what} (known: {known})"
    if kind == "missing":
        return f"{key} is required" + (f" (a `{key}:` section)" if _model_members(field) else "")
    if kind == "value":  # a field's own rule, said by its field validator ("must be ...")
        return f"{key} {error['msg']}"
    if kind == "section_rule":  # a rule across a section's keys, said by its model validator
        return f"{key}.{error['msg']}"
    if kind == "union_tag_not_found":
        return f"{key}.{_discriminator(field)} is required (one of {', '.join(map(str, _model_members(field)))})"
    if kind == "union_tag_invalid":
        tag, tags = error["ctx"]["tag"], ", ".join(map(str, _model_members(field)))
        return f"{key}.{_discriminator(field)} {tag!r} is not a {key} type (known: {tags})"
    if any(isinstance(item, str) for item in rest):
        # Every member of a union refused the value for its shape: say once what it may be.
        value = _lookup(config, error["loc"][: len(error["loc"]) - len(rest)])
        return f"{key} must be {_describe(annotation)}, got {value!r} ({type(value).__name__})"
    for index in rest:  # an item of a list
        key, annotation = f"{key}[{index}]", typing.get_args(_strip(annotation))[0]
    if kind.endswith(("_type", "_parsing")):
        value = error.get("input")
        return f"{key} must be {_describe(annotation)}, got {value!r} ({type(value).__name__})"
    if kind == "literal_error":
        return f"{key} must be one of {list(typing.get_args(_strip(annotation)))}, {got}"
    if kind in _BOUNDS:
        bound, sign = _BOUNDS[kind]
        return f"{key} must be {sign} {error['ctx'][bound]}, {got}"
    if kind == "too_short":
        return f"{key} must have at least {error['ctx']['min_length']} item(s), {got}"
    if kind == "too_long":
        return f"{key} must have at most {error['ctx']['max_length']} item(s), {got}"
    if kind == "finite_number":
        return f"{key} must be a finite number, {got}"
    return f"{key}: {error['msg']}, {got}"


def _locate(schema: type[Section], loc: tuple) -> _Where:
    """Follow an error's ``loc`` through the models, as far as it names fields."""
    key, model, field, rest, tagged = "", schema, None, list(loc), None
    while rest and isinstance(rest[0], str) and rest[0] in model.model_fields:
        name = rest.pop(0)
        key = f"{key}.{name}" if key else name
        field = model.model_fields[name]
        members = _model_members(field)
        if not members or not rest:
            break
        if len(members) > 1:  # a tagged union: pydantic names the member
            if rest[0] not in members:
                break
            tagged = (key, rest[0])
            model = members[rest.pop(0)]
        else:
            model = members[None]
            if typing.get_origin(_strip(field.annotation)) is list:  # a list of sections
                key += f"[{rest.pop(0)}]"
        field = None
    return _Where(key, model, field, field.annotation if field else None, rest, tagged)


def _lookup(config: Any, loc: tuple) -> Any:
    for item in loc:
        config = config[item]
    return config


def _strip(annotation: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> X (for a single X)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


def _union_args(annotation: Any) -> list[Any]:
    annotation = _strip(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [_strip(a) for a in typing.get_args(annotation)]
    return [annotation]


def _model_members(field: FieldInfo | None) -> dict[str | None, type[Section]]:
    """The sections a field holds: {None: model} for one (or a list of them), {tag: model} for a tagged union."""
    if field is None:
        return {}
    args = _union_args(field.annotation)
    if len(args) == 1 and typing.get_origin(args[0]) is list:
        args = [_strip(typing.get_args(args[0])[0])]
    models = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    if not models or len(models) != len(args):
        return {}
    if len(models) == 1:
        return {None: models[0]}
    return {m.model_fields[_discriminator(field)].default: m for m in models}


def _discriminator(field: FieldInfo | None) -> str:
    """The tag's key of a tagged union, kept on the field (``head: Head``) or in its annotation (``Head | None``)."""
    if field is None:
        raise TypeError("no field: not a tagged union")
    if isinstance(field.discriminator, str):
        return field.discriminator
    for arg in typing.get_args(field.annotation):
        for meta in getattr(arg, "__metadata__", ()):
            if isinstance(getattr(meta, "discriminator", None), str):
                return meta.discriminator
    raise TypeError(f"{field} is not a tagged union")


def _describe(annotation: Any) -> str:
    """What a value of ``annotation`` looks like, in words: ``int``, ``'auto' or list``, ``int or null``."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(_describe(a) for a in typing.get_args(annotation)))  # once each
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return "list"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))
