"""The one model loader: a frozen Hugging Face causal LM (and its tokenizer) on the configured device and dtype.

Every command that runs a model (capture, regenerate, training, eval, autotune, the benches, engine
verification) loads it here, so they all see the same weights in the same precision with the same
attention kernel. Decoding commands also call ``core.runtime.prepare_decoding`` once for the device.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from transformers import (
    AutoConfig,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    ProcessorMixin,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils import is_torchvision_available

from headstart.core.memory import check_memory, decoding_memory
from headstart.core.runtime import (
    Ranks,
    env_count,
    join_process_group,
    rank_device,
    resolve_device,
    resolve_dtype,
    slow_dtype_warning,
)
from headstart.core.settings import AUTO_ATTENTION
from headstart.core.vision import images_only_processor
from headstart.core.weights import (
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointError,
    borrowed_model,
    checkpoint_folder,
    first_names,
    is_vision_language,
    model_class,
)


def attention_implementation(config: Any, requested: str = AUTO_ATTENTION) -> str | None:
    """The attention kernel a target loads with: ``requested`` (``target.attn_implementation``: eager, sdpa,
    flash_attention_2, flex_attention or a hub kernel, as transformers names them) unless it is "auto"; then SDPA
    where transformers implements it for the target's family, else None, the family's own default (gpt-oss:
    eager, as transformers refuses SDPA for its attention sinks)."""
    if requested != AUTO_ATTENTION:
        return requested
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "sdpa" if model_class is None or getattr(model_class, "_supports_sdpa", False) else None


def load_model(
    path: str,
    device: str | torch.device = "auto",
    dtype: str | torch.dtype = "fp32",
    tp_size: int = 1,
    attention: str = AUTO_ATTENTION,
) -> PreTrainedModel:
    """``path`` (a folder or hub id) in eval mode with gradients off, on ``device`` in ``dtype``, with the
    ``attention`` kernel (``attention_implementation``: by default SDPA where the family has it).

    ``tp_size`` > 1 splits it across that many processes of the torchrun job (transformers' tensor parallelism
    over consecutive ranks, ``core.runtime.Ranks``): each holds 1/tp_size of the decoder, and every rank of the
    group gets the whole logits and hidden states. A family transformers cannot split is refused first.
    """
    device = device if isinstance(device, torch.device) else resolve_device(device)
    dtype = resolve_dtype(dtype)
    if why := slow_dtype_warning(device, dtype):
        warnings.warn(f"{path}: {why}", stacklevel=2)
    config = AutoConfig.from_pretrained(path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention_implementation(config, attention)}
    if tp_size > 1:
        check_tensor_parallel(config, tp_size, path)
        kwargs |= {"tp_plan": "auto", "device_mesh": tensor_parallel_mesh(device, tp_size)}
    try:
        # With output_loading_info it returns (model, load report); transformers' types name the model alone.
        loaded = model_class(config).from_pretrained(path, output_loading_info=True, **kwargs)
        model, report = cast(tuple[PreTrainedModel, dict[str, Any]], loaded)
    except (ValueError, ImportError) as err:
        if attention == AUTO_ATTENTION:
            raise
        # transformers' words for a kernel the family (or this install) lacks, named with the config key to change.
        raise ValueError(f"{path}: target.attn_implementation {attention!r} cannot load it: {err}") from None
    check_load_report(path, model, report)
    if tp_size > 1:
        return model.eval().requires_grad_(False)
    # transformers types PreTrainedModel.to through a decorator that loses self: it takes a device.
    return model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]


def mtp_tensor(name: str, config: PretrainedConfig) -> bool:
    """Whether ``name`` is a tensor of the checkpoint's multi-token-prediction layers (``num_nextn_predict_layers``
    of them: ``model.mtp_*``, or DeepSeek's ``model.layers.{L}`` past the decoder's L layers), which transformers
    leaves out of the model it builds, as it should: only an MTP head reads them (``heads/mtp.py``)."""
    if not getattr(config, "num_nextn_predict_layers", None):
        return False
    parts = name.split(".")
    layer = parts[2] if len(parts) > 2 and parts[1] == "layers" else ""
    past_the_decoder = layer.isdigit() and int(layer) >= config.num_hidden_layers
    return parts[1].startswith("mtp") or past_the_decoder


def check_load_report(path: str, model: PreTrainedModel, report: dict[str, Any]) -> None:
    """CheckpointError naming the checkpoint, the tensors and the likely cause when transformers' load report
    (``from_pretrained(..., output_loading_info=True)``) has a weight of the model missing from the checkpoint, or
    a decoder tensor in the checkpoint the model has no place for.

    transformers only logs these: a missing weight is drawn at random (differently in every process), and an
    extra decoder tensor is dropped, so a target with a shard missing, or a MoE checkpoint under a dense
    family's config.json, would run as another model. Tied weights (an lm_head that is the embedding) are not
    in the report, and buffers (rotary ``inv_freq``) are computed from the config, not read.
    """
    weights = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(name for name in report["missing_keys"] if name in weights)
    decoder = next((name for name, module in model.named_modules() if module is model.get_decoder()), "")
    unexpected = sorted(
        name
        for name in report["unexpected_keys"]
        if (name.startswith(f"{decoder}.") or not decoder) and not mtp_tensor(name, model.config)
    )
    if not missing and not unexpected:
        return
    folder = checkpoint_folder(path)
    files = next((folder / name for name in (INDEX_NAME, SINGLE_NAME) if (folder / name).exists()), folder)
    family = model.config.model_type
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} weights of the {family} model its config.json describes are not in {files} "
            f"({first_names(missing)}): transformers would draw them at random"
        )
    if unexpected:
        problems.append(
            f"{len(unexpected)} decoder tensors in {files} have no place in that model ({first_names(unexpected)})"
        )
    raise CheckpointError(
        f"{folder}: {'; '.join(problems)}. Likely causes: a truncated or partial download (fetch the checkpoint "
        f"again), or a config.json whose model_type ({family}) is not the family of these weights (a MoE "
        "checkpoint under a dense family's config)"
    )


def load_decoding_target(
    path: str,
    device_name: str,
    dtype: str | torch.dtype,
    tp_size: int,
    drafters: int,
    context_tokens: int,
    attention: str = AUTO_ATTENTION,
) -> tuple[PreTrainedModel, Ranks]:
    """The target a decoding command (evaluation, autotune) runs, and this process's ranks: whole on one
    process, or split across the ``tp_size`` processes torchrun started. Every rank decodes the same prompts
    in lockstep (the split forward needs them all); the first writes the results.

    First, before any weight is read, the rank's memory (``core.memory.decoding_memory``: ``drafters`` bytes of
    heads or draft model, a KV cache of ``context_tokens``) is checked against its device."""
    device = rank_device(device_name)
    ranks = join_process_group(device, tp_size)
    if ranks.dp_world > 1:
        raise ValueError(
            f"decoding runs one tensor-parallel group: torchrun started {ranks.world} processes for tp_size "
            f"{tp_size}; start exactly {tp_size} (--nproc_per_node {tp_size})"
        )
    need = decoding_memory(AutoConfig.from_pretrained(path), resolve_dtype(dtype), tp_size, drafters, context_tokens)
    line = check_memory(need, device, "split the target across more ranks (--tp-size) or use a larger device")
    if ranks.rank == 0:
        print(line)
    return load_model(path, device, dtype, tp_size, attention), ranks


def check_tensor_parallel(config: Any, tp_size: int, path: str) -> None:
    """NotImplementedError naming why transformers cannot split this target ``tp_size`` ways, read from its config
    alone (before any weight is loaded): a family without a tensor-parallel plan, or heads that do not divide."""
    text = config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise NotImplementedError(
            f"{path}: transformers has no tensor-parallel plan for {text.model_type} targets "
            "(base_model_tp_plan is empty in its config class), so target.tp_size must be 1"
        )
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    uneven = [
        f"{name} {count}"
        for name, count in (("attention heads", text.num_attention_heads), ("key/value heads", kv_heads))
        if count % tp_size
    ]
    if uneven:
        raise NotImplementedError(
            f"{path}: target.tp_size={tp_size} does not divide the target's {' and '.join(uneven)}: each rank must "
            "hold whole heads; pick a tp_size that divides both"
        )


def tensor_parallel_mesh(device: torch.device, tp_size: int) -> DeviceMesh:
    """This rank's tensor-parallel group: ranks [g * tp_size, (g + 1) * tp_size) of the job's world."""
    world = env_count("WORLD_SIZE", 1)
    mesh = init_device_mesh(device.type, (world // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    return mesh["tp"]


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_processor(path: str) -> ProcessorMixin | None:
    """The processor of a vision-language target (its image processor and tokenizer: what turns images and their
    markers into the target's inputs); None for a text target. Where transformers cannot build the family's
    processor for want of torchvision (the Qwen-VL families' video processor), the same class with images only
    (``core.vision.images_only_processor``)."""
    config = AutoConfig.from_pretrained(path)
    if not is_vision_language(config):
        return None
    try:
        return AutoProcessor.from_pretrained(path)
    except ImportError as err:
        if is_torchvision_available():
            raise
        return images_only_processor(path, config, err)


def load_target(
    path: str,
    device: str = "auto",
    dtype: str = "fp32",
    tp_size: int = 1,
    borrowed_only: bool = False,
    attention: str = AUTO_ATTENTION,
    tokenizer_fits: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A target (a config's ``target:`` section: path, device, dtype, tp_size, attn_implementation) -> (model,
    tokenizer).

    ``borrowed_only``: what training from shards needs, the config and the embedding, final norm and lm_head
    read by name from the safetensors (``core.weights.borrowed_model``), never the decoder layers.
    """
    if borrowed_only:
        # tokenizer_fits (training): an embedding with fewer rows than the tokenizer has tokens is refused up front
        # (ids past it would fail mid-step); the benches pair real shapes with the bundled tokenizer on purpose.
        tokenizer = load_tokenizer(path)
        rows = len(tokenizer) if tokenizer_fits else None
        return borrowed_model(path, resolve_device(device), resolve_dtype(dtype), rows), tokenizer
    return load_model(path, device, dtype, tp_size, attention), load_tokenizer(path)


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high target layers (2, L//2, L-3), as vLLM and SpecForge pick them: what the capture
    stores, the head fuses and an import assumes when a published config names none.

    Layer id i is the residual stream entering decoder layer i (HF ``hidden_states[i]``).
    """
    layers = sorted({2, num_hidden_layers // 2, num_hidden_layers - 3})
    if len(layers) < 3 or layers[0] < 1:
        raise ValueError(
            f"the target has {num_hidden_layers} layers, too few for EAGLE-3's default layers (2, L//2, L-3) to be "
            "three distinct target layers: name three in capture.aux_layers (and head.layer_ids)"
        )
    return layers
