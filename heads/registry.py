"""The head types: one entry each, declared in the head's own module, registered here; everything that works
with heads (the config check, training, decoding, autotune, the memory estimate, export, import, the model
card, the CLI) finds a head type through this registry and nothing else branches on a head type's name.

    HEAD_TYPES["eagle3"].trainer              # "eagle": train/eagle.py trains it
    drafting_of(config).method                # "peagle" for an EAGLE-3 head with parallel_drafting
    register(HeadType(name="mine", head=MyHead, ...))   # a head type from outside the package

An entry holds the facts about the head itself. The floors above keep their own tables, keyed by the names
declared here, and fill them for the package's head types themselves: ``decoding`` maps each drafting method to
the proposer that drafts with it, ``export`` each head type to its engine layouts. heads/ imports nothing above it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from headstart.core.settings import rebuild_schemas

if TYPE_CHECKING:
    from headstart.heads.base import DraftHead
    from headstart.heads.head_config import HeadConfig, HeadOptions


@dataclass(frozen=True)
class Drafting:
    """How a head drafts: the method eval and tree.json name it by (``decoding`` maps it to the proposer that
    drafts with it), and its title in reports and cards."""

    method: str
    title: str
    card_title: str | None = None  # the model card's, where it says more than ``title``
    requires: str = ""  # what the head's options must say for it to draft this way ("with parallel_drafting")


@dataclass(frozen=True)
class HeadType:
    """One head type: everything the rest of the system needs to know about it."""

    name: str  # the config's head.type and config.json's "type"
    head: type[DraftHead]  # the module; its options model (``head.options_model``) is the head: section
    trainer: str  # the recipe that trains it: train/<trainer>.py
    fuses_layers: bool  # trains on fused target layers (the batch carries aux_hidden; options.layer_ids)
    drafting: Drafting
    # Another way the same head type drafts, picked by its options (EAGLE-3 with parallel_drafting: P-EAGLE).
    variant: tuple[Callable[[HeadOptions], bool], Drafting] | None = None

    @property
    def options(self) -> type[HeadOptions]:
        return self.head.options_model

    def drafting_for(self, options: HeadOptions) -> Drafting:
        if self.variant is not None and self.variant[0](options):
            return self.variant[1]
        return self.drafting

    def draftings(self) -> tuple[Drafting, ...]:
        return (self.drafting,) if self.variant is None else (self.drafting, self.variant[1])


HEAD_TYPES: dict[str, HeadType] = {}


def register(entry: HeadType) -> HeadType:
    """Add a head type: configs accept its ``head:`` section from now on (every schema is rebuilt), and
    training, decoding, export and import find it."""
    if entry.name in HEAD_TYPES and HEAD_TYPES[entry.name] is not entry:
        raise ValueError(f"a head type {entry.name!r} is registered already")
    if entry.head.head_type != entry.name or entry.options.model_fields["type"].default != entry.name:
        raise ValueError(f"head type {entry.name!r}: its module and options must declare type {entry.name!r}")
    if entry.fuses_layers and "layer_ids" not in entry.options.model_fields:
        raise ValueError(f"head type {entry.name!r} fuses target layers: its options need a layer_ids option")
    taken = {d.method for other in HEAD_TYPES.values() if other is not entry for d in other.draftings()}
    if clash := taken & {d.method for d in entry.draftings()}:
        raise ValueError(f"head type {entry.name!r}: drafting methods {sorted(clash)} are taken")
    HEAD_TYPES[entry.name] = entry
    rebuild_schemas()
    return entry


@contextmanager
def registered(entry: HeadType) -> Iterator[HeadType]:
    """``entry`` registered for the duration of the block (a test's own head type), then removed (unless it was
    registered before the block)."""
    before = HEAD_TYPES.get(entry.name)
    register(entry)
    try:
        yield entry
    finally:
        if before is None:
            del HEAD_TYPES[entry.name]
            rebuild_schemas()


def head_type(name: str) -> HeadType:
    if name not in HEAD_TYPES:
        raise ValueError(f"unknown head type {name!r}; known: {sorted(HEAD_TYPES)}")
    return HEAD_TYPES[name]


def head_options_models() -> dict[str, type[HeadOptions]]:
    """Head type -> its options model: the members of the config's ``head:`` section."""
    return {name: entry.options for name, entry in HEAD_TYPES.items()}


def drafting_of(config: HeadConfig) -> Drafting:
    """How a saved head drafts (its method: the type, or ``peagle`` for EAGLE-3 with parallel drafting)."""
    return head_type(config.type).drafting_for(config.options)


def draftings() -> dict[str, Drafting]:
    """Every method a registered head drafts with -> its drafting, in registration order."""
    return {d.method: d for entry in HEAD_TYPES.values() for d in entry.draftings()}


def drafting_owner(method: str) -> HeadType:
    """The head type that drafts with ``method``."""
    for entry in HEAD_TYPES.values():
        if any(drafting.method == method for drafting in entry.draftings()):
            return entry
    raise ValueError(f"no registered head type drafts with {method!r}; known: {list(draftings())}")


def method_needs(method: str) -> str:
    """The head a drafting method needs, in words: ``'eagle3' with parallel_drafting``."""
    return f"{drafting_owner(method).name!r} {draftings()[method].requires}".rstrip()


def trainers() -> dict[str, str]:
    """Head type -> the recipe that trains it (train/<recipe>.py)."""
    return {name: entry.trainer for name, entry in HEAD_TYPES.items()}
