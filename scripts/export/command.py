"""Export a trained head for a serving engine.

    python -m scripts.export --head runs/demo/eagle3/head --format vllm --out exports/demo-eagle3 [--target PATH]

Formats: ``vllm`` and ``sglang`` (EAGLE-1/2 and EAGLE-3, the EAGLE repo's layout; DFlash: vLLM's DFlash
layout, ``vllm`` only), ``speculators`` (EAGLE-3), ``medusa`` (the Medusa repo's layout). A P-EAGLE head
(EAGLE-3 with ``parallel_drafting``) goes to ``vllm`` (with ``mask_hidden`` and ``mask_token_id``) or
``speculators`` (type ``peagle``); SGLang has no parallel drafting. The head's config names its target;
``--target`` overrides it. The head is checked against the target's config (hidden size, vocab, attention
shape, layer ids, and every rule a build of the head follows: ``heads.check_head_config``, what loading and
import check) before anything is written, and against a ``--target``'s tokenizer (the hash the head
recorded in training), and the folder appears whole or not at all, with the command's settings as
export_config.yaml (the ``export:`` section that ``headstart export --config`` reads). See docs/EXPORT.md.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig

from headstart.core.command_flags import CommandFlags, command_failed
from headstart.core.config_files import run_command, save_config
from headstart.core.fingerprint import tokenizer_hash
from headstart.core.io import atomic_dir, check_writable
from headstart.core.settings import Folder, Registered
from headstart.export.card import export_command, model_card, tree_card_section
from headstart.export.common import check_out
from headstart.export.layouts import EngineFiles
from headstart.export.parity import card_section, weights_digest
from headstart.export.registry import export_files_names, layouts_of, written_layouts
from headstart.export.stitch import stitch_target
from headstart.heads import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    HeadConfig,
    check_finite,
    check_head_config,
    check_tokenizer,
    head_type,
    read_head_config,
    state_problems,
)

# --format: a layout of a registered head type (read when the schema is built: export.registry.register_layouts
# rebuilds it).
ExportFormat = Annotated[str, Registered(written_layouts)]


class Export(CommandFlags):
    """``python -m scripts.export``'s flags, the config's ``export:`` section: a trained head in a serving engine's
    layout."""

    section: ClassVar[str] = "export"

    head: str = Field(description="a head folder saved by training (config.json + model.safetensors)")
    format: ExportFormat
    out: Folder = Field(description="the folder to write (new, empty or an earlier export)")
    overwrite: bool = Field(False, description="replace --out whole even if it holds other files")
    target: str | None = Field(
        None, description="the target model (path or hub id); null: the one in the head's config"
    )
    parity: str | None = Field(
        None, description="a parity.json by scripts.export.verify_engines: its figures for this head go in the card"
    )
    allow_other_tokenizer: bool = Field(
        False, description="export for a --target whose tokenizer differs from the one the head was trained with"
    )
    stitch: bool = Field(
        False,
        description="write a copy of the target with the head's tensors in place of its own (an MTP head), "
        "not a draft folder",
    )


CONFIG_FILE = "export_config.yaml"  # the settings of `python -m scripts.export` (`headstart export`)


def load_target_config(target: str | None, head_config: HeadConfig) -> tuple[str, PretrainedConfig]:
    """The target's name and config: ``target`` if given, else the one the head was trained on."""
    name = target or head_config.target
    if not name:
        raise ValueError("the head's config names no target: pass --target PATH")
    try:
        return name, AutoConfig.from_pretrained(name)
    except OSError as err:
        raise FileNotFoundError(f"cannot read the target's config from {name!r}: {err}") from err


def check_target_tokenizer(config: HeadConfig, target: str, head_dir: Path) -> None:
    """The head's recorded tokenizer against ``target``'s (read only when the head records one)."""
    target_hash = None
    if config.tokenizer_hash is not None:
        try:
            target_hash = tokenizer_hash(AutoTokenizer.from_pretrained(target))
        except OSError as err:
            raise FileNotFoundError(
                f"cannot read the tokenizer of {target!r} to check the head was trained with it: {err}"
            ) from err
    check_tokenizer(config, target_hash, head_dir)


def load_head_state(head_dir: Path, config: HeadConfig) -> dict[str, torch.Tensor]:
    """The head's tensors, checked name by name and shape by shape against what its config builds."""
    path = head_dir / WEIGHTS_NAME
    if not path.is_file():
        raise FileNotFoundError(f"missing {WEIGHTS_NAME} in {head_dir}")
    state = load_file(str(path))
    with torch.device("meta"):  # the expected names and shapes, without allocating a head
        expected = head_type(config.type).head(config).state_dict()
    problems = state_problems(expected, state)
    if problems:
        raise ValueError(f"{path} does not match its config.json: " + "; ".join(problems))
    check_finite(state, path)  # nothing non-finite is written, exported or pushed
    return state


def engine_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """(config.json, tensors, weights file name) of the head in ``fmt``; ValueError where ``fmt`` cannot hold it,
    naming the formats this head takes (its type's layouts, less those its options rule out)."""
    layouts = layouts_of(config.type)
    try:
        if fmt not in layouts.LAYOUTS:
            raise ValueError(layouts.refusal(fmt))
        return layouts.export_files(config, state, fmt, target, target_config)
    except ValueError as refused:
        takes = [
            other for other in layouts.LAYOUTS if other != fmt and writes(config, state, other, target, target_config)
        ]
        raise ValueError(f"{refused}; formats this head takes: {', '.join(takes) or 'none'}") from None


def writes(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> bool:
    """Whether the head's layouts write it in ``fmt`` (a dry run of the conversion, nothing written)."""
    try:
        layouts_of(config.type).export_files(config, state, fmt, target, target_config)
    except ValueError:
        return False
    return True


def parity_card_section(parity: Path, head_dir: Path) -> str:
    """The card's section of measured engine figures for the weights in ``head_dir``, from ``parity``."""
    try:
        report = json.loads(parity.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the parity report {parity}: {err}") from err
    section = card_section(report, weights_digest(head_dir))
    if section is None:
        raise ValueError(f"{parity} holds no figures for the weights in {head_dir / WEIGHTS_NAME} (other sha256)")
    return section


def holds_head(folder: Path) -> bool:
    """Whether ``folder`` holds a headstart head (its config.json has our ``type`` and ``arch``), not an export."""
    try:
        config = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "arch" in config and "type" in config and "architectures" not in config


def export_head(
    head_dir: str | Path,
    fmt: str,
    out: str | Path,
    target: str | None = None,
    target_name: str | None = None,
    draft_name: str | None = None,
    made_by: str | None = None,
    card_sections: list[str] | None = None,
    parity: str | Path | None = None,
    head_name: str | None = None,
    overwrite: bool = False,
    allow_other_tokenizer: bool = False,
    settings: dict[str, Any] | None = None,
    stitch: bool = False,
) -> Path:
    """Write the head in ``head_dir`` as ``fmt`` to ``out`` (config.json, weights, README.md), atomically.

    ``target_name`` is how users load the target (a hub id where ``target`` is a local path): the card, the
    speculators verifier and the Medusa base model name it. The card's serve commands name the folder
    ``draft_name`` (default: ``out``); it says it was ``made_by`` (default: this export's command) and ends
    with ``card_sections`` (markdown), then the served-acceptance figures that ``parity`` (a parity.json by
    ``scripts.export.verify_engines``) holds for these very weights; its re-export commands name the head folder
    ``head_name`` (default: ``head_dir``). An existing ``out`` is replaced only if it holds an earlier
    export, or with ``overwrite``. A ``target`` given must have the tokenizer the head was trained with,
    unless ``allow_other_tokenizer``. ``settings`` (the command's config) go in as export_config.yaml; the
    hub push leaves them out, as they name local folders. ``stitch``: ``out`` is a copy of the target with the
    head's tensors of ``fmt`` in place of its own (``export.stitch``), and nothing else.
    """
    head_dir, out = Path(head_dir), Path(out)
    if fmt not in written_layouts():
        raise ValueError(f"unknown format {fmt!r}; known: {', '.join(written_layouts())}")
    if not (head_dir / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"missing {CONFIG_NAME} in {head_dir}: not a headstart head folder")
    config = read_head_config(head_dir)
    # An earlier export: its card and nothing else an export does not write. A trained head has a card too
    # (train writes head/README.md), so a folder whose config.json is a headstart head's is never one.
    written = export_files_names() | {"config.json", "README.md", CONFIG_FILE}
    earlier = written if (out / "README.md").is_file() and not holds_head(out) else frozenset()
    check_out(out, head_dir, "head folder", overwrite, earlier)
    target_given = target is not None
    target, target_config = load_target_config(target, config)
    # What loading and import check (the build's rules too): never write a folder that import would refuse.
    check_head_config(config, target_config, head_dir / CONFIG_NAME)
    if target_given and not allow_other_tokenizer:
        check_target_tokenizer(config, target, head_dir)
    state = load_head_state(head_dir, config)
    sections = list(card_sections or [])
    if parity:
        sections.append(parity_card_section(Path(parity), head_dir))
    public_target = target_name or target
    engine_config, tensors, weights_file = engine_files(config, state, fmt, public_target, target_config)
    if stitch:
        return stitch_target(target, tensors, out)
    layouts = layouts_of(config.type)
    extra = layouts.extra_files(config, state)
    command = export_command(head_dir, fmt, out)
    if target != config.target:
        command += " " + shlex.join(["--target", target])
    # The tree eval.autotune tuned for this head, when its folder has a tree.json.
    sections.extend(tree_card_section(head_dir))
    draft, head = draft_name or str(out), head_name or str(head_dir)
    card = model_card(config, layouts, fmt, public_target, draft, head, made_by or command, sections)
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(engine_config, indent=2) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / weights_file), metadata={"format": "pt"})
        for name, data in extra.items():
            (tmp / name).write_bytes(data)
        (tmp / "README.md").write_text(card)
        if settings is not None:
            save_config(settings, tmp / CONFIG_FILE)
    return out


def main(argv: list[str] | None = None) -> None:
    run(Export.from_argv(argv, "python -m scripts.export", __doc__.split("\n")[0]))


def run(args: Export) -> None:
    """The export ``args`` describe (from flags, or a config's ``export:`` section)."""
    check_writable(args.out)  # before the target loads for the parity check
    try:
        out = export_head(
            args.head,
            args.format,
            args.out,
            args.target,
            parity=args.parity,
            overwrite=args.overwrite,
            allow_other_tokenizer=args.allow_other_tokenizer,
            settings=args.as_config(),
            stitch=args.stitch,
        )
    except (ValueError, FileNotFoundError, NotImplementedError) as err:  # NotImplementedError: the target's family
        command_failed(f"export failed: {err}")
    print(f"wrote {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")


if __name__ == "__main__":
    run_command(main, "python -m scripts.export")
