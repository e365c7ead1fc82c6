"""Drafting method (``heads.Drafting.method``) -> the ``HeadProposer`` that drafts with it: decoding's own table,
filled for the package's head types in ``decoding/__init__.py``, one line each; a head type from outside registers
its proposer here after its ``heads.register`` call.

    register_proposer("mine", MyProposer)      # a head type from outside the package
    proposer_of("peagle")                      # PEagle
    head_proposer(head.config)                 # the proposer the saved head drafts with
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from headstart.heads import HEAD_TYPES, HeadConfig, drafting_of, drafting_owner

if TYPE_CHECKING:
    from headstart.decoding.proposers_heads import HeadProposer

PROPOSERS: dict[str, type[HeadProposer]] = {}


def register_proposer(method: str, proposer: type[HeadProposer]) -> type[HeadProposer]:
    """``proposer`` drafts for the heads whose drafting is ``method`` (a registered head type's) from now on."""
    drafting_owner(method)  # refuses a method no registered head type drafts with
    if PROPOSERS.get(method, proposer) is not proposer:
        raise ValueError(f"a proposer for the drafting method {method!r} is registered already")
    PROPOSERS[method] = proposer
    return proposer


def proposer_of(method: str) -> type[HeadProposer]:
    """The proposer that drafts with ``method``."""
    if method not in PROPOSERS:
        raise ValueError(f"no proposer drafts with {method!r} (decoding.head_proposers.register_proposer)")
    return PROPOSERS[method]


def head_proposer(config: HeadConfig) -> type[HeadProposer]:
    """The proposer a saved head drafts with (its drafting: ``heads.drafting_of``)."""
    return proposer_of(drafting_of(config).method)


def head_types_of(proposer: type[HeadProposer]) -> list[str]:
    """The head types that draft with ``proposer`` in any of their draftings; where none names it, those drafting
    with a class it derives from (a subclass drafts as its base does, unless a head type drafts with it by name:
    DSpark's, a DFlash's)."""
    drafters = {
        entry.name: [PROPOSERS[d.method] for d in entry.draftings() if d.method in PROPOSERS]
        for entry in HEAD_TYPES.values()
    }
    own = [name for name, classes in drafters.items() if proposer in classes]
    return own or [name for name, classes in drafters.items() if any(issubclass(proposer, c) for c in classes)]
