"""A vision-language target's inputs besides its tokens: which token id stands for image features, the vision
inputs on the target's device, and the rotary positions of a target with 3-D positions (Qwen-VL's mrope) as a
text-only draft sees them. Capture (``data_recipes``) and decoding (``decoding``) read them alike."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel

# The processor's outputs with one value per token (Qwen-VL's text / image / video flags): cut with the tokens.
TOKEN_KEYS = ("mm_token_type_ids", "token_type_ids")


def image_token_id(config: PretrainedConfig) -> int:
    """The placeholder token id whose rows the vision tower's features replace."""
    token = getattr(config, "image_token_id", None)
    token = getattr(config, "image_token_index", None) if token is None else token
    if token is None:
        raise ValueError(f"{config.model_type}: the vision-language target's config names no image token id")
    return int(token)


def uses_mrope(model: PreTrainedModel) -> bool:
    """Whether the target computes 3-D rotary positions from its images (``get_rope_index``: Qwen-VL)."""
    return callable(getattr(model.base_model, "get_rope_index", None))


def rope_positions(
    model: PreTrainedModel, input_ids: torch.Tensor, vision: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    """(the rotary position [S] of each row of ``input_ids`` [1, S] as a text-only draft sees it, the shift of the rows
    after them: row i past the end sits at i + shift).

    For an mrope target that is the temporal row of its 3-D positions, what vLLM hands an EAGLE-3 draft of such a
    target (``llm_base_proposer._set_positions``: ``positions[0]`` when the target uses mrope and the draft does not);
    past an image a row's position is its index less what the image's grid saved. Every other target counts rows."""
    rope_inputs = {key: value for key, value in vision.items() if key != "pixel_values"}
    if not uses_mrope(model) or "image_grid_thw" not in rope_inputs:
        return torch.arange(input_ids.shape[1]), 0
    grid = rope_inputs["image_grid_thw"]
    rope_index: Any = getattr(model.base_model, "get_rope_index")  # noqa: B009 - typed as a module attribute
    positions, shift = rope_index(input_ids.to(grid.device), **rope_inputs)
    return positions[0, 0].cpu().long(), int(shift.flatten()[0])


def on_model(vision: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Vision inputs on the target's device, the pixels in its dtype (processors give float32)."""
    return {
        key: value.to(model.device, model.dtype) if value.is_floating_point() else value.to(model.device)
        for key, value in vision.items()
    }
