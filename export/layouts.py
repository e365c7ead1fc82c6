"""The protocol of a head type's engine layouts: one module per head type implements it (``eagle``, ``eagle3``,
``medusa``, ``dflash``, ``dspark``, ``dflash2``), and ``export.registry`` maps each head type to its module.

    layouts = layouts_of("eagle3")                   # export.registry
    layouts.LAYOUTS                                  # ("vllm", "sglang", "speculators"): what --format takes
    files = layouts.export_files(config, state, "vllm", target, target_config)
    options, arch, state = layouts.import_files("speculators", src, target_config)

The export command and import (``scripts.export``) work with any module or object of this shape, so a head type
registered from outside the package brings its own (``export.registry.register_layouts``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from transformers import PretrainedConfig

from headstart.heads import WEIGHTS_NAME, DraftArch, HeadConfig


class EngineFiles(NamedTuple):
    """A head in an engine's layout: its config.json, its tensors and the file they go in."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    weights_file: str = WEIGHTS_NAME


class Imported(NamedTuple):
    """A published checkpoint read back: our head options, the draft layer's shape and our tensors."""

    options: dict[str, Any]
    arch: DraftArch
    state: dict[str, torch.Tensor]


class EngineLayouts(Protocol):
    """What a head type's engine-layout module declares and does."""

    LAYOUTS: tuple[str, ...]  # the layouts it writes (export --format)
    SOURCES: tuple[str, ...]  # the layouts it reads (import --from)
    FILES: tuple[str, ...]  # the files its exports hold besides config.json (the weights, ``extra_files``)
    SERVED: bool  # an engine serves it (its card tells how to check acceptance and to prompt raw-text targets)

    def refusal(self, fmt: str) -> str:
        """Why the layout ``fmt`` (one it does not write) cannot hold this head type: the whole error message."""
        ...

    def export_files(
        self, config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
    ) -> EngineFiles:
        """The head in ``fmt`` (one of ``LAYOUTS``); ValueError where this head cannot take that form."""
        ...

    def extra_files(self, config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
        """Files besides config.json and the weights (file name -> bytes), in every layout it writes."""
        ...

    def import_files(self, kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
        """The checkpoint in ``src``, in the layout ``kind`` (one of ``SOURCES``)."""
        ...

    def layout(self, fmt: str, short: bool = False) -> str:
        """The layout ``fmt`` in words, for the model card (``short``: for the parity table)."""
        ...

    def describe(self, config: HeadConfig) -> list[tuple[str, str]]:
        """Rows of the model card's table for the head's own settings."""
        ...

    def serve(self, config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
        """The model card's "Serve it": the exact commands that serve the folder ``draft`` written as ``fmt``
        (``head_dir``'s tree.json may set the chain length per batch size), and what to do where an engine cannot
        read it."""
        ...


LAYOUT_NAMES = {  # the engines' layouts in words: the model card's, then the parity table's
    "vllm": ("the EAGLE repo's layout, as vLLM loads it", "EAGLE-repo layout"),
    "sglang": ("the EAGLE repo's layout, as SGLang loads it", "EAGLE-repo layout"),
    "speculators": ("the speculators format (speculators 0.9.0, read by vLLM)", "speculators layout"),
    "medusa": ("the Medusa repo's layout", "Medusa-repo layout"),
}


def layout_name(fmt: str, short: bool = False) -> str:
    """A layout's usual name (``EngineLayouts.layout`` of a head type written in the engines' shared layouts)."""
    return LAYOUT_NAMES[fmt][short]


# Layouts that hold one head type only, and say so to every other one asked for them.
OWN_LAYOUTS = {"medusa": "the 'medusa' format holds Medusa heads only"}


def not_written(head_type: str, fmt: str, layouts: tuple[str, ...], reasons: dict[str, str] | None = None) -> str:
    """The usual refusal: ``cannot export a eagle head as 'speculators': <why>``, the reason from ``reasons`` (the
    head type's own), else the layout's. The export adds the formats this very head takes (``layouts`` are its
    type's; a head's options can rule some out)."""
    why = (reasons or {}).get(fmt) or OWN_LAYOUTS.get(fmt) or f"no {fmt} layout is written for {head_type} heads"
    return f"cannot export a {head_type} head as {fmt!r}: {why}"
