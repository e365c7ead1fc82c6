"""A target checkpoint's safetensors, read tensor by tensor: where each tensor lives, and the few a head borrows.

A head borrows the target's embedding, final norm and lm_head (or the embedding again, when the two are tied).
Training from shards needs nothing else, so it reads those tensors by name from the checkpoint (one
``model.safetensors`` or a sharded ``model.safetensors.index.json``) and never opens a decoder-layer file: a 70B
target's 140 GB stay on disk, and a decoder shard that cannot even be read does not matter. The names come from
the target's own module tree, built on the meta device (no memory), so every family names its tensors as its
transformers class does.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightRenaming, apply_renamings

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
BORROWED = ("embed", "norm", "lm_head")  # the roles, in the order they are read and fingerprinted
SHOWN_NAMES = 5  # tensor names in an error: a wrong family misses one per layer, a bad head may have dozens


class CheckpointError(ValueError):
    """A target folder whose files do not hold what its config.json needs (the tensors a borrowed-tensor load
    reads, or every weight of a full load), named with what is missing."""


# The dtypes a borrowed tensor may be stored in: an integer or 8-bit float table is a quantized checkpoint's,
# meaningless without its scales, and a plain cast would hand the head garbage without a word.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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


def file_inside(path: Path, roots: tuple[Path, ...], what: str | None = None) -> Path:
    """``path`` with every link followed, checked to be a regular file inside one of ``roots``.

    ``path`` comes from data (an index's ``weight_map``) or from a folder the user named: an absolute
    name, a ``../`` or a link must not carry a read (or an upload) to a file the user never pointed us at.
    ``what`` says where the name came from, for the error. The one rule for training from shards, import and
    push (``export.common`` re-exports it).
    """
    name = f"{what} ({path})" if what else str(path)
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise ValueError(
            f"{name} leads outside {roots[0]} (to {resolved}): only files inside it are used; "
            "copy the file in if you trust it"
        )
    if not resolved.exists():
        raise FileNotFoundError(f"{name} does not exist")
    if not resolved.is_file():
        raise ValueError(f"{name} is not a regular file")
    return resolved


def checkpoint_roots(src: Path) -> tuple[Path, ...]:
    """Where the files of the checkpoint folder ``src`` may live: in it, and for a huggingface_hub cache
    snapshot (``<repo>/snapshots/<revision>``, whose files are links to ``<repo>/blobs/``) in its blobs."""
    src = src.resolve()
    return (src, src.parent.parent / "blobs") if src.parent.name == "snapshots" else (src,)


def _inside(path: Path, folder: Path, what: str | None = None) -> Path:
    """``file_inside`` for a target folder (or its hub-cache blobs), as a CheckpointError."""
    try:
        return file_inside(path, checkpoint_roots(folder), what)
    except ValueError as error:
        raise CheckpointError(str(error)) from None


def read_index(folder: Path) -> dict[str, str]:
    """The ``weight_map`` of ``folder``'s sharded index, every entry a file inside ``folder``; CheckpointError
    naming the index, the entry and its value otherwise. Files no entry's tensor is read from may be absent."""
    index = _inside(folder / INDEX_NAME, folder)
    try:
        data = json.loads(index.read_text())
    except ValueError as error:  # truncated, not JSON, not UTF-8
        raise CheckpointError(f"{index}: not JSON ({error}): the index is damaged; copy it again") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        found = f"a {type(data).__name__}" if not isinstance(data, dict) else f"weight_map {weight_map!r:.60}"
        raise CheckpointError(f"{index}: a safetensors index maps tensor names to files in weight_map; found {found}")
    checked = set()
    for name, file in weight_map.items():
        what = f"{index}: weight_map entry {name!r} -> {file!r}"
        if not isinstance(file, str) or not file:
            raise CheckpointError(f"{what}: a file name must be a non-empty string")
        if file not in checked:  # each file once: a 70B index names ~30 files in ~700 entries
            checked.add(file)
            with contextlib.suppress(FileNotFoundError):  # a decoder file may be left out: only a read needs it
                _inside(folder / file, folder, what)
    return weight_map


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint -> the safetensors file holding it (headers only, no tensor data)."""
    if (folder / INDEX_NAME).exists():
        return {name: folder / file for name, file in read_index(folder).items()}
    if not (folder / SINGLE_NAME).exists():
        raise CheckpointError(
            f"{folder}: no {SINGLE_NAME} or {INDEX_NAME}; borrowed tensors are read from safetensors checkpoints "
            "(convert a .bin checkpoint with transformers' save_pretrained)"
        )
    single = _inside(folder / SINGLE_NAME, folder)
    try:
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    except SafetensorError as error:
        raise CheckpointError(f"{single}: not a readable safetensors file ({error})") from None


def target_config(folder: Path) -> PretrainedConfig:
    """``folder``'s config as transformers reads it; CheckpointError naming its config.json when it refuses it
    (transformers' own validation error names no file)."""
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as error:
        said = " ".join(str(error).split())  # one line: pydantic-style errors span several
        raise CheckpointError(f"{folder / 'config.json'}: transformers refuses this config: {said}") from None


def is_vision_language(config: PretrainedConfig) -> bool:
    """Whether the target reads images: its config has a vision tower (Qwen-VL, Llava, Gemma-3, ...)."""
    return getattr(config, "vision_config", None) is not None


def model_class(config: PretrainedConfig) -> type[AutoModelForCausalLM] | type[AutoModelForImageTextToText]:
    """The transformers auto class a target loads with: image-text-to-text for a vision-language target (its vision
    tower and projector included; most of those families have no causal-LM mapping), else causal LM."""
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The target's module tree without memory: every parameter on the meta device (a vision tower included)."""
    with torch.device("meta"):
        return model_class(config).from_config(config)


def borrowed_names(model: PreTrainedModel) -> dict[str, str]:
    """Role (``embed``, ``norm``, ``lm_head``) -> the parameter name of the tensor a head borrows from ``model``."""
    modules = {
        "embed": model.get_input_embeddings(),
        "norm": getattr(model.get_decoder(), "norm", None),
        "lm_head": model.get_output_embeddings(),
    }
    names = {id(module): name for name, module in model.named_modules()}
    return {role: f"{names[id(module)]}.weight" for role, module in modules.items() if module is not None}


def stored_names(model: PreTrainedModel, stored: Iterable[str]) -> dict[str, str]:
    """The model's parameter name -> the name ``stored`` holds it under. Checkpoints of several families keep an
    older layout than transformers' modules (Llava's ``language_model.model.*``, Qwen2.5-VL's ``model.*`` for
    ``model.language_model.*``), which transformers renames as it loads them (its conversion mapping's
    renamings): the same renamings, applied here to the stored names."""
    renamings = [rule for rule in get_model_conversion_mapping(model) if isinstance(rule, WeightRenaming)]
    stored = list(stored)
    return {name: name for name in stored} | {apply_renamings(name, renamings): name for name in stored}


def read_borrowed(folder: Path, model: PreTrainedModel, tokenizer_size: int | None = None) -> dict[str, torch.Tensor]:
    """Role -> the tensor as stored, read by name; a tied lm_head absent from the file is the embedding.

    Each is checked against ``model``'s own parameter (its config's shapes) and ``tokenizer_size`` (the
    tokenizer's length, where the caller has it) before anything trains on it (``check_borrowed``)."""
    files = tensor_files(folder)
    stored_as = stored_names(model, files)
    tensors = {}
    for role, name in borrowed_names(model).items():
        if name not in stored_as and role == "lm_head" and model.config.get_text_config().tie_word_embeddings:
            continue  # tied: the embedding read above serves as lm_head
        if name not in stored_as:
            raise CheckpointError(
                f"{folder}: the checkpoint has no tensor {name!r} (the target's {role}); "
                f"its tensors are named like {sorted(files)[:3]}"
            )
        stored = stored_as[name]
        file = _inside(files[stored], folder, f"the file of {stored!r}")
        try:
            with safe_open(str(file), framework="pt") as f:
                if stored not in f.keys():  # noqa: SIM118 - safe_open has keys(), no __contains__
                    where = f"{INDEX_NAME} names it" if (folder / INDEX_NAME).exists() else "its tensors are listed"
                    raise CheckpointError(f"{file}: holds no tensor {stored!r} (the target's {role}), yet {where}")
                tensors[role] = f.get_tensor(stored)
        except SafetensorError as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None
        check_borrowed(file, name, role, tensors[role], model, tokenizer_size)
    return tensors


def read_named(path: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of the checkpoint in ``path`` (a folder or a cached hub id), read by name from the files
    that hold them and nothing else: the layers a head borrows whole (a target's own MTP layer), which transformers
    leaves out of the model it loads. CheckpointError naming the folder and the tensors it lacks."""
    folder = checkpoint_folder(path)
    files = tensor_files(folder)
    missing = [name for name in names if name not in files]
    if missing:
        raise CheckpointError(
            f"{folder}: the checkpoint has no tensors {first_names(missing)}; its tensors are named like "
            f"{first_names(sorted(files))}"
        )
    tensors: dict[str, torch.Tensor] = {}
    for file in dict.fromkeys(files[name] for name in names):
        inside = _inside(file, folder)
        try:
            with safe_open(str(inside), framework="pt") as f:
                tensors |= {name: f.get_tensor(name) for name in names if files[name] == file}
        except SafetensorError as error:
            raise CheckpointError(f"{inside}: not a readable safetensors file ({error})") from None
    return tensors


def check_borrowed(
    file: Path, name: str, role: str, tensor: torch.Tensor, model: PreTrainedModel, tokenizer_size: int | None
) -> None:
    """CheckpointError naming the file, the tensor and both sides unless ``tensor`` is what ``model``'s config
    makes (its meta parameter's shape) in a float dtype, with a row for every token of the tokenizer.

    Without it a norm of shape [1] broadcasts silently, an embedding shorter than the config's vocabulary
    fails mid-step with a bare IndexError, and an int8 table is cast to floats that mean nothing."""
    what = f"{file}: tensor {name!r} (the target's {role})"
    if tensor.dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{what} is stored as {tensor.dtype}; a borrowed tensor must be one of "
            f"{', '.join(map(str, FLOAT_DTYPES))} (a quantized checkpoint's tables mean nothing without their scales)"
        )
    shape = tuple(model.get_parameter(name).shape)
    text = model.config.get_text_config()
    keys = ["hidden_size"] if role == "norm" else ["vocab_size", "hidden_size"]
    said = ", ".join(f"{key} {getattr(text, key, '?')}" for key in keys)
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            f"{what} has shape {list(tensor.shape)}, but its config.json ({said}) makes it {list(shape)}: "
            "the config and the weights are not of one model"
        )
    if role in ("embed", "lm_head") and tokenizer_size is not None and tokenizer_size > shape[0]:
        raise CheckpointError(
            f"{what} has {shape[0]} rows, but the tokenizer has {tokenizer_size} tokens: "
            f"ids from {shape[0]} on would index past it"
        )


def borrowed_model(
    path: str | Path, device: torch.device, dtype: torch.dtype, tokenizer_size: int | None = None
) -> PreTrainedModel:
    """The target as a head sees it when it trains from shards: its config, and real embedding, final norm and
    lm_head on ``device`` in ``dtype``; every decoder layer stays on the meta device (a forward fails loudly).
    ``tokenizer_size``: the tokenizer's length, checked against the embedding's rows where the caller has it."""
    folder = checkpoint_folder(path)
    model = meta_model(target_config(folder))
    tensors = read_borrowed(folder, model, tokenizer_size)
    names = borrowed_names(model)
    for role, tensor in tensors.items():
        module_name, _ = names[role].rsplit(".", 1)
        module = model.get_submodule(module_name)
        module.weight = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
    if "lm_head" not in tensors and "lm_head" in names:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # tied
    return model.eval()


def first_names(names: list[str]) -> str:
    """The first SHOWN_NAMES of ``names``, and their count when some are left out: ``a, b, c, ... (9 in all)``."""
    more = f", ... ({len(names)} in all)" if len(names) > SHOWN_NAMES else ""
    return ", ".join(names[:SHOWN_NAMES]) + more


def safetensors_bytes(path: str | Path) -> int:
    """Bytes of the safetensors files of a model or head folder (a hub id: its cached snapshot)."""
    return sum(file.stat().st_size for file in checkpoint_folder(path).glob("*.safetensors"))
