"""The one model loader: a frozen Hugging Face causal LM (and its tokenizer) on the configured device and dtype.

Every command that runs a model (capture, regenerate, training, eval, autotune, the benches, engine
verification) loads it here, so they all see the same weights in the same precision with the same
attention kernel. Decoding commands also call ``core.runtime.prepare_decoding`` once for the device.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.runtime import resolve_device, resolve_dtype, slow_dtype_warning


def load_model(path: str, device: str | torch.device = "auto", dtype: str | torch.dtype = "fp32") -> PreTrainedModel:
    """``path`` (a folder or hub id) in eval mode with gradients off, SDPA attention, on ``device`` in ``dtype``."""
    device = device if isinstance(device, torch.device) else resolve_device(device)
    dtype = resolve_dtype(dtype)
    if why := slow_dtype_warning(device, dtype):
        warnings.warn(f"{path}: {why}", stacklevel=2)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    # transformers types PreTrainedModel.to through a decorator that loses self: it takes a device.
    return model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)


def load_target(target: dict[str, Any]) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The ``target:`` section of a config (path, device, dtype) -> (model, tokenizer)."""
    path = target["path"]
    return load_model(path, target.get("device", "auto"), target.get("dtype", "fp32")), load_tokenizer(path)


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
