"""EAGLE-1/2 heads <-> the EAGLE repo's layout as vLLM (``eagle``) and SGLang (``EAGLE``) load it.

Matched against vllm 0.33.0 ``model_executor/models/llama_eagle.py`` and sglang 0.5.23
``srt/models/llama_eagle.py``: ``fc`` over cat(embedding, feature), the layer at ``layers.0`` with no
``input_layernorm``, no final norm, the target's embedding and ``lm_head`` shared (vLLM when the
checkpoint has none; SGLang always, ``eagle_worker_v2.py``). The engines differ in two places:
- ``architectures``: vLLM prefixes ``Eagle`` to the draft's architecture unless it starts with it
  (``transformers_utils/configs/eagle.py``), so ``EagleLlamaForCausalLM``; SGLang looks up
  ``architectures[0]`` as written, so ``LlamaForCausalLMEagle``.
- ``fc.bias``: vLLM's fc has none (a ``fc.bias`` in the checkpoint fails to load); SGLang's fc is an
  ``nn.Linear`` with a bias that stays at its random init unless the checkpoint has one, so the SGLang
  export always writes it (zeros for a bias-free head).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from headstart.export.card import (
    ENGINES,
    code_block,
    reexport_command,
    served_schedule,
    served_steps,
    sglang_command,
    vllm_command,
)
from headstart.export.common import (
    arch_from_decoder,
    check_sglang_embedding,
    decoder_config,
    dtype_name,
    read_checkpoint,
    read_json,
)
from headstart.export.layouts import EngineFiles, Imported, layout_name, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig

LAYOUTS: tuple[str, ...] = ("vllm", "sglang")
SOURCES: tuple[str, ...] = ("eagle",)
FILES: tuple[str, ...] = (WEIGHTS_NAME,)
SERVED = True
ARCHITECTURES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
# A head with q/k/v biases (Qwen2 targets): vLLM's Llama layer reads ``qkv_bias``; SGLang gets its
# Qwen2 EAGLE class (qwen2_eagle.py: Qwen2DecoderLayer, q/k/v biases, no o_proj bias), the same layer.
SGLANG_QKV_BIAS = {"architectures": ["Qwen2ForCausalLMEagle"], "model_type": "qwen2"}


def refusal(fmt: str) -> str:
    why = "speculators 0.9.0 and vLLM 0.33 define no EAGLE-1 speculators type (only eagle3 and newer)"
    return not_written("eagle", fmt, LAYOUTS, {"speculators": why})


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors of an EAGLE-1/2 head for ``fmt`` ("vllm" or "sglang")."""
    check_sglang_embedding(config, fmt)
    tensors = dict(state)
    if fmt == "vllm" and "fc.bias" in tensors:
        raise ValueError(
            "this EAGLE head has an fc bias (fc_bias: true), which vLLM's EagleLlamaForCausalLM cannot load "
            "(its fc has no bias): export it with --format sglang, or train with fc_bias: false for vLLM"
        )
    if fmt == "sglang" and "fc.bias" not in tensors:
        weight = tensors["fc.weight"]
        tensors["fc.bias"] = torch.zeros(weight.shape[0], dtype=weight.dtype)
    engine_config = {"architectures": [ARCHITECTURES[fmt]], **decoder_config(config.arch, dtype_name(state))}
    if fmt == "sglang" and config.arch.qkv_bias:
        engine_config |= SGLANG_QKV_BIAS
    return EngineFiles(engine_config, tensors)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {}


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, draft arch, our tensors) of an EAGLE-1/2 checkpoint in the EAGLE repo's layout."""
    engine_config, state = read_json(src / "config.json"), read_checkpoint(src)
    extra_layers = sorted({k.split(".")[1] for k in state if k.startswith("layers.") and not k.startswith("layers.0.")})
    if extra_layers:
        raise ValueError(f"the draft has decoder layers {['0', *extra_layers]}; headstart's EAGLE head has one")
    if "layers.0.input_layernorm.weight" in state:
        raise ValueError(
            "the draft's first layer has an input_layernorm, which vLLM and SGLang drop (EAGLE's first layer has none)"
        )
    # The target's lm_head is used, as both engines do; embed_tokens is for import_head to judge
    # (common.keep_own_embedding: vLLM keeps a table of the draft's own).
    state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    bias = state.get("fc.bias")
    if bias is not None and not bias.any():  # an all-zero bias (our SGLang export) is no bias
        del state["fc.bias"]
    options = {"type": "eagle", "fc_bias": "fc.bias" in state}
    arch = arch_from_decoder(engine_config, target_config)
    # The weights say it, whatever the config spells (EAGLE repo Qwen2 heads, our SGLang Qwen2 export).
    arch.qkv_bias = "layers.0.self_attn.q_proj.bias" in state
    return Imported(options, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return layout_name(fmt, short)


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    return [("feature", "the target's last hidden state (after its final norm)")]


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """One engine per folder: the other one's needs its own export."""
    schedule = served_schedule(head_dir)
    other = "sglang" if fmt == "vllm" else "vllm"
    command = (
        vllm_command(target, draft, "eagle", served_steps(schedule), schedule=schedule)
        if fmt == "vllm"
        else sglang_command(target, draft, "EAGLE")
    )
    return (
        f"{ENGINES[fmt]}:\n\n{code_block(command)}\n\n{ENGINES[other]} needs its own folder (the `architectures` "
        "name and the `fc.bias` differ between the engines):\n\n"
        + reexport_command(head_dir, other, f"{draft}-{other}")
    )
