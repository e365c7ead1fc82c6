"""Domino heads <-> vLLM's DFlash layout with ``dflash_config.projector_type: domino`` (``method: dflash``; SpecForge's,
Model-Optimizer's and NeMo AutoModel's Domino checkpoints use it too).

Matched against a Domino-capable vLLM DFlash loader, read from its code (``model_executor/models/qwen3_dflash.py``
with ``DominoHead`` and ``DFlashQwen3ForCausalLM.load_weights``, a pull request after 0.32 that no vLLM release has
merged; docs/EXPORT.md, "Domino"), on top of the DFlash layout (``export/dflash.py``):
- ``architectures: ["DFlashDraftModel"]``, the DFlash backbone's keys and tensors, and in ``dflash_config``:
  ``projector_type: domino`` (which builds the head), ``gru_hidden_dim`` and ``emb_dim`` (required: vLLM indexes
  them), ``shift_label`` and ``pure_draft_prefix_len`` (the head's block: the anchor's slot drafts, and the first
  drafts are uncorrected), written so no reader guesses; a checkpoint without them reads as its readers default,
  false and 0. Some public Domino configs name the architecture ``DominoDraftModel``: the same layout, imported.
- ``prefix_gru.weight_ih_l0`` [3 G, H], ``prefix_gru.weight_hh_l0`` [3 G, G] (``nn.GRU`` without biases),
  ``embed_proj.0.weight`` [E, H + G] and ``embed_proj.2.weight`` [V, E]: vLLM routes the ``prefix_gru.`` and
  ``embed_proj.`` names to its ``domino_head`` and refuses a checkpoint that lacks any of them. Our module names,
  as vLLM's.
- The pinned vLLM (0.32) predates the head: it builds a plain DFlash draft from this config and has no parameter
  for these tensors, so the folder is served by a vLLM that has ``DominoHead`` only.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from transformers import PretrainedConfig

from headstart.export import dflash
from headstart.export.card import code_block, served_schedule, vllm_command
from headstart.export.common import read_json
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig
from headstart.heads.domino import DominoOptions

LAYOUTS: tuple[str, ...] = ("vllm",)
SOURCES: tuple[str, ...] = ("domino",)
PROJECTOR = "domino"
FILES: tuple[str, ...] = (WEIGHTS_NAME, dflash.MASK_EMBEDDING_FILE)
SERVED = True
HEAD_KEYS = ("gru_hidden_dim", "emb_dim")
# The block's dflash_config settings, with the value its readers (vLLM, SGLang, speculators) take when one is absent.
BLOCK_KEYS = {"shift_label": False, "pure_draft_prefix_len": 0}
# Why the pinned vLLM cannot serve the folder (its qwen3_dflash.py, read from the 0.32.0 wheel).
PINNED_REFUSAL = (
    "vLLM 0.32 predates Domino: its DFlash loader ignores projector_type and has no parameter for the "
    "prefix_gru and embed_proj tensors"
)


def refusal(fmt: str) -> str:
    reasons = {
        "speculators": "headstart writes vLLM's own DFlash layout (projector_type domino), which vLLM reads as it is",
        "sglang": dflash.SGLANG_REFUSAL,
    }
    return not_written("domino", fmt, LAYOUTS, reasons)


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors of vLLM's DFlash layout with the Domino head: the backbone's, the GRU's and
    embed_proj's."""
    files = dflash.export_files(config, state, fmt, target, target_config)
    options = config.options
    head = {"projector_type": PROJECTOR} | {key: getattr(options, key) for key in (*HEAD_KEYS, *BLOCK_KEYS)}
    return EngineFiles(files.config | {"dflash_config": files.config["dflash_config"] | head}, files.tensors)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return dflash.extra_files(config, state)  # a learned mask vector: DFlash's file


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of a Domino checkpoint in vLLM's DFlash layout."""
    settings = read_json(src / "config.json").get("dflash_config") or {}
    if settings.get("projector_type") != PROJECTOR:
        found = settings.get("projector_type")
        raise ValueError(f"dflash_config.projector_type is {found!r}, not {PROJECTOR!r}: this is no Domino draft")
    missing = [key for key in HEAD_KEYS if key not in settings]
    if missing:
        raise ValueError(f"the Domino config's dflash_config lacks {missing} (vLLM requires them)")
    options, arch, state = dflash.import_files(kind, src, target_config)
    block = {key: settings.get(key, default) for key, default in BLOCK_KEYS.items()}
    return Imported(options | {"type": "domino"} | {key: settings[key] for key in HEAD_KEYS} | block, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return (
        "DFlash layout (Domino)" if short else f"vLLM's DFlash layout (`{dflash.ARCHITECTURE}`, projector_type domino)"
    )


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = cast(DominoOptions, config.options)
    return [
        *dflash.describe(config),
        ("causal correction", f"GRU state {options.gru_hidden_dim}, embed_proj through {options.emb_dim}"),
        ("drafts", block_drafts(options)),
    ]


def block_drafts(options: DominoOptions) -> str:
    """Which slots draft, and which drafts the correction leaves alone."""
    slots = (
        "the newest token's slot drafts the first token, slot k the token after its own position, the last "
        "slot no served token"
        if options.shift_label
        else "slot k drafts the token at its own position"
    )
    plain = options.pure_draft_prefix_len
    return f"{slots}; " + (f"the first {plain} from the backbone's logits alone" if plain else "every draft corrected")


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The block the head was trained on, then the GRU's correction along the chain."""
    schedule = served_schedule(head_dir)
    command = vllm_command(
        target, draft, "dflash", config.trained_depth, schedule=schedule, aux_family=config.arch.family
    )
    return (
        "A vLLM with Domino support (a pull request after 0.32, in no release yet; one forward drafts the block, the "
        "GRU then corrects each slot along the chain; `method` stays `dflash`):\n\n"
        + code_block(command)
        + f"\n\nNot on the pinned vLLM: {PINNED_REFUSAL}. Not for SGLang: {dflash.SGLANG_REFUSAL}."
    )
