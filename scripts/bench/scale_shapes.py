"""The model shapes ``scripts.bench.scale`` measures at (the published configs, and a tiny one for the tests), and
the random-weight targets and configs built from them.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from headstart.core.models import default_aux_layers

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3 = {
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
}
# The published configs' shapes (hub config.json of each model); "tiny" is the test's, seconds on a CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "llama-3.3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    },
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
}
CPU_LAYERS = 4  # the fewest that give EAGLE-3 and DFlash three distinct layers to fuse (``fused_layers``)


def shape_settings(shape: str, layers: int | None) -> dict[str, Any]:
    """A copy of the shape's config settings, ``layers`` deep (None: as published)."""
    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    return settings


def build_target(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The shape's model with random weights from torch's seeded generator, ``layers`` deep (None: as published),
    frozen, with the attention kernel ``core.models.load_model`` picks.

    Built on ``device`` itself: an 8B model initialised on the host first takes minutes and its size in RAM.
    """
    settings = shape_settings(shape, layers)
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def fused_layers(num_layers: int) -> list[int]:
    """The target layers capture stores and the heads fuse: EAGLE-3's defaults (2, L//2, L-3) where the depth has
    them, else three spread ones. The heads' cost depends on their count (the fused input is 3 x hidden), not on
    which layers they are."""
    if num_layers >= 7:
        return default_aux_layers(num_layers)
    if num_layers < CPU_LAYERS:
        raise ValueError(
            f"--layers {num_layers}: EAGLE-3 and DFlash fuse three distinct layers of 1..L-1, "
            f"so the target needs at least {CPU_LAYERS}"
        )
    return [1, num_layers // 2, num_layers - 1]


def shape_config(shape: str, layers: int | None = None) -> PretrainedConfig:
    """The shape's transformers config, ``layers`` deep (None: as published), saved as bf16 weights."""
    settings = shape_settings(shape, layers)
    return AutoConfig.for_model(settings.pop("model_type"), dtype="bfloat16", **settings)
