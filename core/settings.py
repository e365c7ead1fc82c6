"""Settings, typed: the base every config section is made of, the value types they share, and the check that
turns a YAML mapping into a validated section or one ConfigError naming every problem by its dotted key.

Each command's and each head's settings are a ``Section`` declared beside the code that reads them
(``train.train_config.Train``, ``data_recipes.settings.Capture``, ``heads.eagle3.Eagle3Options``, ...); a command's
root model (``Stage``) composes the sections it reads, and ``scripts.pipeline_config`` composes every section into the
whole file's schema, which ``headstart`` checks before any verb runs. ``parse`` returns the validated model,
which the code reads as attributes (``cfg.train.lr``), so mypy checks every read.

Values are checked strictly: no string is read as a number, no number as a flag. The one exception is
YAML 1.1's: it reads ``1e-4`` (an exponent without a dot) as a string, so a float accepts numeric strings.
"""

from __future__ import annotations

import contextlib
import re
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    model_validator,
)
from pydantic_core import CoreSchema, ErrorDetails, PydanticCustomError

from headstart.core.config_files import ConfigError, quoted

Settings = TypeVar("Settings", bound="Section")


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
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _a_device(name: str) -> str:
    if not _DEVICE.fullmatch(name):  # torch would take "meta" or refuse "tpu" only once the model is loading
        raise PydanticCustomError("value", "must be auto, cpu, cuda or cuda:N, got '{name}'", {"name": name})
    return name


Device = Annotated[str, AfterValidator(_a_device)]  # auto: CUDA when present, else the CPU

AUTO_ATTENTION = "auto"  # the default of target.attn_implementation and --attn-implementation


def _an_attention_kernel(name: str) -> str:
    # Imported here: transformers loads when a config is checked, not when a command merely imports its schema.
    from transformers.integrations.hub_kernels import is_kernel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = [AUTO_ATTENTION, "eager", *ALL_ATTENTION_FUNCTIONS]
    if name not in known and not is_kernel(name):  # else refused only once the target is loading
        raise PydanticCustomError(
            "value",
            "must be {known} or a hub kernel (org/repo), got '{name}'",
            {"known": ", ".join(known), "name": name},
        )
    return name


# The target's attention kernel, as transformers names it (core.models.attention_implementation).
AttentionKernel = Annotated[
    str,
    AfterValidator(_an_attention_kernel),
    Field(description="the target's attention kernel: auto (SDPA where the family has it), eager, sdpa, ..."),
]

# A dtype has one name in the settings; torch's and Hugging Face's spellings of it are read as that name when a
# config or flag is parsed, so the code compares and records that name alone (core.runtime.resolve_dtype: its torch
# dtype).
DTYPE_SPELLINGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(value: Any) -> Any:
    """A dtype spelling as the settings' name for it (``bfloat16`` -> ``bf16``); anything else as it is."""
    return DTYPE_SPELLINGS.get(value, value) if isinstance(value, str) else value


Dtype = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(dtype_name)]
TrainDtype = Annotated[Literal["fp32", "bf16"], BeforeValidator(dtype_name)]  # what a head trains in
StoreDtype = Annotated[Literal["fp32", "bf16", "fp16", "fp8_e4m3"], BeforeValidator(dtype_name)]  # shards only


_SECTIONS: list[type[Section]] = []  # every section model, in the order they were declared


class Section(BaseModel):
    """A mapping with exactly these keys (an unknown key is a typo), values checked strictly."""

    model_config = ConfigDict(extra="forbid", strict=True)
    command: ClassVar[str] = "config"  # as a root model: who reads it ("invalid capture config: ...")
    top_level: ClassVar[str] = "key"  # as a root model: what its keys are called in errors

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        _SECTIONS.append(cls)


class TaggedUnion:
    """A field whose ``tag`` key picks its model among ``members()`` (the config's ``head:`` section: ``type``
    picks the head type's options model). The members are read when a schema is built, so a model registered
    later (a head type from outside the package) joins every schema at ``rebuild_schemas``.

        Head = Annotated[HeadOptions, TaggedUnion(head_options_models)]
    """

    def __init__(self, members: Callable[[], Mapping[str, type[Section]]], tag: str = "type") -> None:
        self.members, self.tag = members, tag

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        members = tuple(self.members().values())
        union = Union.__getitem__(members) if len(members) > 1 else members[0]
        return handler.generate_schema(Annotated[union, Field(discriminator=self.tag)])


class Registered:
    """A name field whose choices are read from a registry when a schema is built (``export.format``: the layouts
    of the registered head types), so a name registered later is taken once ``rebuild_schemas`` has run; the
    config check and the flags say the choices as for a Literal.

        format: Annotated[str, Registered(written_layouts)]
    """

    def __init__(self, names: Callable[[], Iterable[str]]) -> None:
        self.names = names

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return handler.generate_schema(Literal.__getitem__(tuple(self.names())))


def rebuild_schemas() -> None:
    """Rebuild every section's schema, in declaration order (a section's fields before the sections holding it),
    so that a ``TaggedUnion``'s new members are taken everywhere it is used."""
    for section in _SECTIONS:
        section.model_rebuild(force=True)


def one_of(names: Iterable[str]) -> Any:
    """The Literal of ``names``: a key's choices read from the registry that declares them (``FORMATS``), not
    copied. mypy sees such a type as ``str`` (declare it under ``if TYPE_CHECKING``)."""
    return Literal.__getitem__(tuple(names))


# Every top-level section a config file may hold, in pipeline order. Each is declared beside the command that
# reads it; scripts.pipeline_config composes them all into the whole file's schema (and checks it holds exactly these).
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
        for problem in _problems(schema, err.errors()):
            if problem not in problems:  # several members of a union may refuse a value alike
                problems.append(problem)
        return None, problems
    return (None, problems) if problems else (resolved, [])


def parse(config: dict[str, Any], schema: type[Settings], source: str | None = None) -> Settings:
    """``config`` (read from the file ``source``) as a ``schema``, or one ConfigError naming the file and listing
    every problem by its dotted key."""
    resolved, problems = check(config, schema)
    raise_problems(schema, problems, source)
    assert resolved is not None
    return resolved


def as_dict(settings: BaseModel) -> dict[str, Any]:
    """Validated settings as the YAML mapping that gives them again: an absent optional section stays absent."""
    return {key: value for key, value in settings.model_dump(mode="json").items() if value is not None}


def raise_problems(schema: type[Section], problems: list[str], source: str | None = None) -> None:
    if problems:
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}invalid {schema.command} config:\n  " + "\n  ".join(problems))


# ---- pydantic's errors, told as "<dotted key> must be ..., got ..."

# What a value must be, by pydantic's error type, in the words of the error's context.
_MUST = {
    "greater_than_equal": "be >= {ge}",
    "greater_than": "be > {gt}",
    "less_than_equal": "be <= {le}",
    "less_than": "be < {lt}",
    "too_short": "have at least {min_length} item(s)",
    "too_long": "have at most {max_length} item(s)",
    "finite_number": "be a finite number",
    "literal_error": "be one of {expected}",
}
# The type a value must have, by pydantic's error type (``int_type``, ``float_parsing``, ...).
_TYPES = {"int": "int", "bool": "bool", "float": "float", "string": "str", "list": "list", "model": "a mapping"}


class _Where(NamedTuple):
    key: str  # dotted: "capture.aux_layers[1]", "stages[0].cmd", "head.ttt_steps"
    model: Any  # the section holding the last key (a tagged union: the tag's model), else None
    tagged: tuple[str, str] | None  # (key, tag) of a tagged union on the way: ("head", "eagle3")
    union: str | None  # the key of a union on the way, whose member pydantic names (capture.aux_layers)
    shape: bool  # the loc ends at that member: it refused the value's shape


def _walk(schema: type[Section], loc: tuple) -> _Where:
    """Follow an error's ``loc`` through the models."""
    key, model, tagged, union, shape = "", schema, None, None, False
    for item in loc:
        shape = False
        if isinstance(item, int):
            key += f"[{item}]"
        elif isinstance(model, dict) and item in model:  # a tagged union: pydantic names the tag
            model, tagged = model[item], (key, item)
        elif isinstance(model, type) and item in model.model_fields:
            key = f"{key}.{item}" if key else item
            field = model.model_fields[item]
            # pydantic keeps a field's own Annotated[...] extras apart from its annotation (a TaggedUnion there).
            annotated = (field.annotation, *field.metadata)
            model = _sections(Annotated[annotated] if field.metadata else field.annotation)
        else:  # a union's member, by pydantic's name for it ("literal['auto']", "list[...]")
            union, shape = union or key, True
    return _Where(key, model, tagged, union, shape)


def _sections(annotation: Any) -> Any:
    """The section a field holds (one, or a list of them), {tag: section} for a tagged union, else None."""
    found: list[type[Section]] = []
    tagged = next((arg for arg in typing.get_args(annotation) if isinstance(arg, TaggedUnion)), None)
    if tagged is not None:
        return dict(tagged.members())
    for arg in typing.get_args(annotation) or (annotation,):
        if isinstance(arg, type) and issubclass(arg, Section):
            found.append(arg)
        elif typing.get_args(arg) and (inner := _sections(arg)):
            found += list(inner.values()) if isinstance(inner, dict) else [inner]
    if len(found) > 1:
        return {section.model_fields["type"].default: section for section in found}
    return found[0] if found else None


def _problems(schema: type[Section], errors: list[ErrorDetails]) -> Iterator[str]:
    # An unknown key's loc ends with that key, not with a field.
    found = [(e, _walk(schema, e["loc"][:-1] if e["type"] == "extra_forbidden" else e["loc"])) for e in errors]
    # A union's members each refuse a value that is not their shape. A value of one member's shape
    # (capture.aux_layers: a list) is told by that member's reasons; a value of no member's shape
    # (train.online_capture: 3) once, naming every member (bool or 'vllm').
    deeper = {where.union for _, where in found if where.union and not where.shape}
    told: set[str | None] = set()
    for error, where in found:
        if not where.shape:
            yield _problem(schema, error, where)
        elif where.union not in deeper and where.union not in told:
            told.add(where.union)
            kinds = " or ".join(dict.fromkeys(_kind(e) for e, w in found if w.union == where.union and w.shape))
            value = error["input"]
            yield f"{where.union} must be {kinds}, got {quoted(value)} ({type(value).__name__})"


def _problem(schema: type[Section], error: ErrorDetails, where: _Where) -> str:
    key, kind, ctx, value = where.key, error["type"], error.get("ctx", {}), error.get("input")
    if kind == "extra_forbidden":
        name, known = error["loc"][-1], ", ".join(sorted(where.model.model_fields))
        if not key:
            return f"unknown {schema.top_level} {name!r} (known: {known})"
        what = f" for a {where.tagged[1]} {where.tagged[0]}" if where.tagged else ""
        return f"unknown key {key}.{name}{what} (known: {known})"
    if kind == "missing":
        return f"{key} is required" + (f" (a `{key}:` section)" if where.model else "")
    if kind == "value":  # a field's own rule, said by its field validator ("must be ...")
        return f"{key} {error['msg']}"
    if kind == "section_rule":  # a rule across a section's keys, said by its model validator
        return f"{key}.{error['msg']}"
    if kind.startswith("union_tag_"):  # a tagged union's tag (head.type): missing, or none of the tags
        tag, tags = ctx["discriminator"].strip("'"), ", ".join(where.model)
        if kind == "union_tag_not_found":
            return f"{key}.{tag} is required (one of {tags})"
        return f"{key}.{tag} {ctx['tag']!r} is not a {key} type (known: {tags})"
    if kind in _MUST:
        return f"{key} must {_MUST[kind].format(**ctx)}, got {quoted(value)}"
    if kind.endswith(("_type", "_parsing")):
        return f"{key} must be {_kind(error)}, got {quoted(value)} ({type(value).__name__})"
    return f"{key}: {error['msg']}, got {quoted(value)}"


def _kind(error: ErrorDetails) -> str:
    """What a value must be, in a word, by the error a field (or a union's member) raised."""
    if error["type"] == "literal_error":
        return error["ctx"]["expected"]
    return _TYPES.get(error["type"].removesuffix("_type").removesuffix("_parsing"), error["type"])


def strip_optional(annotation: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> X (for a single X)."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return strip_optional(args[0])
    return annotation


def union_members(annotation: Any) -> list[Any]:
    annotation = strip_optional(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return [strip_optional(a) for a in typing.get_args(annotation)]
    return [annotation]


def describe(annotation: Any) -> str:
    """What a value of ``annotation`` looks like, in words: ``int``, ``'auto' or list``, ``int or null``."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(a) for a in typing.get_args(annotation)))  # once each
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(annotation))
    if origin is list:
        return "list"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))
