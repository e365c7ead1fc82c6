"""A target checkpoint's safetensors, read tensor by tensor: where each tensor lives, and the few a head borrows.

A head borrows the target's embedding, final norm and lm_head (or the embedding again, when the two are tied).
Training from shards needs nothing else, so it reads those tensors by name from the checkpoint (one
``model.safetensors`` or a sharded ``model.safetensors.index.json``) and never opens a decoder-layer file: a 70B
target's 140 GB stay on disk, and a decoder shard that cannot even be read does not matter. The names come from
the target's own module tree, built on the meta device (no memory), so every family names its tensors as its
transformers class does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
BORROWED = ("embed", "norm", "lm_head")  # the roles, in the order they are read and fingerprinted


class CheckpointError(ValueError):
    """A target folder without the safetensors a borrowed-tensor load needs, named with what is missing."""


def checkpoint_folder(path: str | Path) -> Path:
    """``path`` as a local folder: itself, or a hub id's snapshot in the local cache (never a download)."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except Exception as error:  # noqa: BLE001 - every way of not finding it means the same to the user
        raise CheckpointError(f"{path}: neither a local folder nor a hub id in the local cache ({error})") from None


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the safetensors file holding it (headers only, no tensor data)."""
    index = folder / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / SINGLE_NAME
    if not single.exists():
        raise CheckpointError(
            f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}; borrowed tensors are read from safetensors checkpoints "
            "(convert a .bin checkpoint with transformers' save_pretrained)"
        )
    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The target's module tree without memory: every parameter on the meta device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def borrowed_names(model: PreTrainedModel) -> dict[str, str]:
    """Role (``embed``, ``norm``, ``lm_head``) -> the parameter name of the tensor a head borrows from ``model``."""
    modules = {
        "embed": model.get_input_embeddings(),
        "norm": getattr(model.get_decoder(), "norm", None),
        "lm_head": model.get_output_embeddings(),
    }
    names = {id(module): name for name, module in model.named_modules()}
    return {role: f"{names[id(module)]}.weight" for role, module in modules.items() if module is not None}


def read_borrowed(folder: Path, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Role -> the tensor as stored, read by name; a tied lm_head absent from the file is the embedding."""
    files = tensor_files(folder)
    tensors = {}
    for role, name in borrowed_names(model).items():
        if name not in files and role == "lm_head" and model.config.get_text_config().tie_word_embeddings:
            continue  # tied: the embedding read above serves as lm_head
        if name not in files:
            raise CheckpointError(
                f"{folder}: the checkpoint has no tensor {name!r} (the target's {role}); "
                f"its tensors are named like {sorted(files)[:3]}"
            )
        with safe_open(str(files[name]), framework="pt") as f:
            tensors[role] = f.get_tensor(name)
    return tensors


def borrowed_model(path: str | Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The target as a head sees it when it trains from shards: its config, and real embedding, final norm and
    lm_head on ``device`` in ``dtype``; every decoder layer stays on the meta device (a forward fails loudly)."""
    folder = checkpoint_folder(path)
    model = meta_model(AutoConfig.from_pretrained(folder))
    tensors = read_borrowed(folder, model)
    names = borrowed_names(model)
    for role, tensor in tensors.items():
        module_name, _ = names[role].rsplit(".", 1)
        module = model.get_submodule(module_name)
        module.weight = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
    if "lm_head" not in tensors and "lm_head" in names:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied
    return model.eval()


def safetensors_bytes(path: str | Path) -> int:
    """Bytes of the safetensors files of a model or head folder (a hub id: its cached snapshot)."""
    return sum(file.stat().st_size for file in checkpoint_folder(path).glob("*.safetensors"))
