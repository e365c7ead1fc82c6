"""Import a published draft head into headstart's head format.

    python -m scripts.export.import_head --from eagle3 SRC --out runs/imported/head --target PATH

Sources: ``eagle`` (EAGLE-1/2, the EAGLE repo's layout), ``eagle3`` (the EAGLE repo's EAGLE-3 layout,
as vLLM and SGLang load it; with ``mask_hidden``, a P-EAGLE head), ``medusa`` (the Medusa repo's layout),
``speculators`` (speculators' eagle3 and peagle formats) and ``dflash`` (vLLM's DFlash layout, as z-lab and
SpecForge publish it, with its ``mask_embedding.pt`` when there is one); weights as ``model.safetensors``,
``pytorch_model.bin`` (or sharded) or the Medusa repo's ``medusa_lm_head.safetensors|.pt``. Our own exports
import back to the same weights. The head is checked against the target (hidden size, vocab, layer ids)
before it is written; the draft layer's shape (MLP width, attention heads, norms, rotary) is the draft's own. An EAGLE
draft's ``embed_tokens`` is kept where vLLM would serve it, when it differs from the target's (``own_embedding``), and
dropped where it is the target's copy (``export.common.keep_own_embedding``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, ClassVar

import torch
from pydantic import Field
from transformers import AutoConfig, PretrainedConfig

from headstart.core.command_flags import CommandFlags, command_failed
from headstart.core.config_files import run_command
from headstart.core.settings import Folder, Registered
from headstart.core.weights import checkpoint_folder, meta_model, read_borrowed
from headstart.export.common import DRAFT_ARCH_KEYS, OWN_EMBEDDING, check_out, keep_own_embedding
from headstart.export.layouts import Imported
from headstart.export.registry import layouts_of, sources
from headstart.heads import (
    DraftArch,
    DraftHead,
    check_compatible,
    check_finite,
    head_options,
    head_type,
    state_problems,
)
from headstart.heads.head_config import LayerOptions
from headstart.heads.target import dense_mlp_width

# --from: a layout a registered head type reads (read when the schema is built: export.registry.register_layouts
# rebuilds it).
Source = Annotated[str, Registered(sources)]


class ImportHead(CommandFlags):
    """``python -m scripts.export.import_head``'s flags, the config's ``import_head:`` section: a published draft
    head in headstart's head format."""

    section: ClassVar[str] = "import_head"
    positional: ClassVar[tuple[str, ...]] = ("src",)
    aliases: ClassVar[dict[str, tuple[str, ...]]] = {"kind": ("--from", "--kind")}

    kind: Source = Field(description="the checkpoint's layout")
    src: str = Field(description="the checkpoint folder")
    out: Folder = Field(description="the head folder to write (new or empty)")
    overwrite: bool = Field(False, description="replace --out whole even if it holds files")
    target: str = Field(description="the target model the head drafts for (path or hub id)")


def read_source(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of the checkpoint in ``src``, read by the head type that reads
    ``kind``."""
    return layouts_of(sources()[kind]).import_files(kind, src, target_config)


def target_embedding(target: str, target_config: PretrainedConfig) -> torch.Tensor:
    """The target's token embedding as stored (``core.weights``: read by name, no decoder layer loaded)."""
    return read_borrowed(checkpoint_folder(target), meta_model(target_config))["embed"]


def build_imported(
    options: dict[str, Any],
    arch: DraftArch,
    state: dict[str, torch.Tensor],
    target: str,
    target_config: PretrainedConfig,
    source: str,
) -> DraftHead:
    """A head of our format holding ``state``, its config from the target plus the draft's own layer shape."""
    parsed = head_options(options)
    if isinstance(parsed, LayerOptions) and arch.intermediate_size != dense_mlp_width(target_config):
        parsed.intermediate_size = arch.intermediate_size  # the published width is the head's own MLP's
    cls = head_type(parsed.type).head
    config = cls.make_config(parsed, target_config)
    config.arch = replace(config.arch, **{k: getattr(arch, k) for k in DRAFT_ARCH_KEYS})
    # The published draft's attention shape, vocab and layer ids against the target's: a named mismatch.
    check_compatible(replace(config, arch=arch, target=source), target_config)
    config.target = target
    cls.check_fits(config, target_config, source)  # what export and loading check: the head written loads back
    head = cls(config)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    head.to(dtype)  # keep the checkpoint's precision: a bf16 head stays bf16
    problems = state_problems(head.state_dict(), state)
    if problems:
        raise ValueError(f"the checkpoint's tensors do not fit a {parsed.type} head: " + "; ".join(problems))
    head.load_state_dict(state)
    return head


def import_head(kind: str, src: str | Path, out: str | Path, target: str, overwrite: bool = False) -> Path:
    """Convert the ``kind`` checkpoint in ``src`` into a headstart head folder ``out`` for ``target``.

    An existing ``out`` must be empty unless ``overwrite``: a head folder looks the same whether an earlier
    import or hours of training wrote it.
    """
    if kind not in sources():
        raise ValueError(f"unknown source {kind!r}; known: {', '.join(sources())}")
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a folder")
    check_out(out, src, "checkpoint folder", overwrite)
    try:
        target_config = AutoConfig.from_pretrained(target)
    except OSError as err:
        raise FileNotFoundError(f"cannot read the target's config from {target!r}: {err}") from err
    try:
        options, arch, state = read_source(kind, src, target_config)
    except KeyError as err:
        raise ValueError(f"the {kind} checkpoint in {src} has no {err}: is it a {kind} checkpoint?") from err
    check_finite(state, f"the {kind} checkpoint in {src} (tensors as headstart names them)")
    if OWN_EMBEDDING in state:  # only then is the target's table read
        keep_own_embedding(options, state, target_embedding(target, target_config))
    head = build_imported(options, arch, state, target, target_config, str(src))
    head.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    run(ImportHead.from_argv(argv, "python -m scripts.export.import_head", __doc__.split("\n")[0]))


def run(args: ImportHead) -> None:
    """The import ``args`` describe (from flags, or a config's ``import_head:`` section)."""
    try:
        out = import_head(args.kind, args.src, args.out, args.target, args.overwrite)
    except (ValueError, FileNotFoundError) as err:
        command_failed(f"import failed: {err}")
    print(f"wrote {out}")


if __name__ == "__main__":
    run_command(main, "python -m scripts.export.import_head")
