"""Medusa heads <-> the Medusa repo's layout (FasterDecoding/Medusa ``medusa/model/medusa_model.py``).

``config.json`` of its ``MedusaConfig`` (``medusa_num_heads``, ``medusa_num_layers``,
``base_model_name_or_path``) and ``medusa_lm_head.safetensors`` holding the ``medusa_head``
ModuleList's state dict: ``{k}.{j}.linear.weight|bias`` for residual block j of head k and
``{k}.{num_layers}.weight`` for its vocabulary projection. The repo repeats ONE block object
``num_layers`` times, so a head with several different blocks has no faithful form there.

vLLM 0.33 and SGLang 0.5.23 no longer serve Medusa (no ``medusa`` speculative method in vLLM's
``config/speculative.py``, no ``MEDUSA`` algorithm in SGLang's ``speculative/spec_info.py``).
"""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PretrainedConfig

from headstart.export.card import code_block
from headstart.export.common import dtype_name, read_checkpoint, read_json, rename_prefixes
from headstart.export.layouts import EngineFiles, Imported, layout_name
from headstart.heads import HeadConfig, arch_from_target

LAYOUTS: tuple[str, ...] = ("medusa",)
SOURCES: tuple[str, ...] = ("medusa",)
WEIGHTS_FILE = "medusa_lm_head.safetensors"
FILES: tuple[str, ...] = (WEIGHTS_FILE,)
SERVED = False  # NOT_SERVED
NOT_SERVED = (
    "vLLM (0.33) and SGLang (0.5.23) no longer serve Medusa heads: vLLM has no 'medusa' speculative method and "
    "SGLang no MEDUSA algorithm. Export this head with --format medusa (the Medusa repo's layout, also read by "
    "TensorRT-LLM's Medusa), or train an EAGLE-3 head (head.type: eagle3) to serve with vLLM or SGLang"
)


def refusal(fmt: str) -> str:
    return f"cannot export a Medusa head as {fmt!r}: {NOT_SERVED}"


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """config.json + tensors in the Medusa repo's layout."""
    layers = config.options.num_layers
    for k in range(config.options.num_heads):
        blocks = [state[f"medusa_head.{k}.{j}.linear.weight"] for j in range(layers)]
        biases = [state[f"medusa_head.{k}.{j}.linear.bias"] for j in range(layers)]
        if any(not torch.equal(blocks[0], w) or not torch.equal(biases[0], b) for w, b in zip(blocks, biases)):
            raise ValueError(
                f"Medusa head {k} has {layers} different residual blocks; the Medusa repo repeats one block object "
                "num_layers times, so it cannot hold them (train with num_layers: 1)"
            )
    engine_config = {
        "medusa_num_heads": config.options.num_heads,
        "medusa_num_layers": layers,
        "base_model_name_or_path": target,
        "hidden_size": config.target_hidden_size,
        "vocab_size": config.vocab_size,
        "torch_dtype": dtype_name(state),
    }
    return EngineFiles(engine_config, rename_prefixes(state, {"medusa_head.": ""}), WEIGHTS_FILE)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {}


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(head options, arch, our tensors) of a Medusa-repo checkpoint."""
    engine_config = read_json(src / "config.json")
    names = (WEIGHTS_FILE, "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")
    state = read_checkpoint(src, names)
    heads, layers = engine_config["medusa_num_heads"], engine_config.get("medusa_num_layers", 1)
    state = {k if k.startswith("medusa_head.") else f"medusa_head.{k}": v for k, v in state.items()}
    # Some Medusa checkpoints carry more heads than the config asks for; the repo loads non-strictly.
    state = {k: v for k, v in state.items() if int(k.split(".")[1]) < heads}
    vocab, hidden = state[f"medusa_head.0.{layers}.weight"].shape
    arch = replace(arch_from_target(target_config), hidden_size=hidden, vocab_size=vocab)
    return Imported({"type": "medusa", "num_heads": heads, "num_layers": layers}, arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return layout_name(fmt, short)


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    options = config.options
    return [
        ("heads", f"{options.num_heads} (head k guesses the token k+2 ahead)"),
        ("blocks per head", str(options.num_layers)),
    ]


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    return (
        f"{NOT_SERVED}.\n\nWith the Medusa repo (it loads the target from `base_model_name_or_path`):\n\n"
        + code_block(shlex.join(["python", "-m", "medusa.inference.cli", "--model", draft]))
    )
