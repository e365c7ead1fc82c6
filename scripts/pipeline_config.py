"""The whole config file's schema: every section, each declared beside the command that reads it, composed here
at the top of the package tree, where every command is importable.

``headstart`` checks a file against it before any verb runs, so a typo in any section fails whichever verb reads
the file first; each command's own root model (``TrainConfig``, ``CaptureConfig``, ...) checks the sections it
reads when the command is run directly. ``COMMAND_CONFIGS`` are the roots of the flag-driven commands: the whole
file, with the command's own section required.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import create_model

from headstart.core.command_flags import CommandFlags
from headstart.core.settings import SECTIONS, Stage
from headstart.data_recipes.settings import Capture, Data, Regenerate, Target
from headstart.eval.acceptance import Eval
from headstart.eval.autotune import Autotune
from headstart.heads import Head
from headstart.heads.medusa import Lora
from headstart.scripts.export.command import Export
from headstart.scripts.export.import_head import ImportHead
from headstart.scripts.export.push_to_hub import Push
from headstart.scripts.export.verify_engines import VerifyEngines
from headstart.train.train_config import Metrics, Train, Wandb

# The flag-driven commands' sections, by section name.
COMMAND_FLAGS: dict[str, type[CommandFlags]] = {
    flags.section: flags for flags in (Eval, Autotune, Export, ImportHead, Push, VerifyEngines)
}


class PipelineConfig(Stage):
    """Any command's config file: every section optional, each checked against its own model when present."""

    command: ClassVar[str] = "pipeline"

    target: Target | None = None
    data: Data | None = None
    capture: Capture | None = None
    regenerate: Regenerate | None = None
    head: Head | None = None
    train: Train | None = None
    lora: Lora | None = None
    wandb: Wandb | None = None
    metrics: Metrics | None = None
    eval: Eval | None = None
    autotune: Autotune | None = None
    export: Export | None = None
    import_head: ImportHead | None = None
    push: Push | None = None
    verify_engines: VerifyEngines | None = None


if tuple(PipelineConfig.model_fields) != SECTIONS:  # the one list of section names is core.settings'
    raise ImportError(f"PipelineConfig's sections {tuple(PipelineConfig.model_fields)} are not {SECTIONS}")


def _command_config(flags: type[CommandFlags]) -> type[PipelineConfig]:
    """A flag-driven command's root: the whole file, with the command's own section required."""
    # The field's name is known at run time only; mypy matches a **dict against create_model's own keywords too.
    fields: dict[str, Any] = {flags.section: flags}
    root = create_model(f"{flags.__name__}Config", __base__=PipelineConfig, __module__=__name__, **fields)
    root.command = flags.section
    return root


COMMAND_CONFIGS: dict[str, type[PipelineConfig]] = {name: _command_config(f) for name, f in COMMAND_FLAGS.items()}
