"""A vision-language target's inputs besides its tokens: which token id stands for image features, the vision
inputs on the target's device, and the rotary positions of a target with 3-D positions (Qwen-VL's mrope) as a
text-only draft sees them. Capture (``data_recipes``) and decoding (``decoding``) read them alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import AutoImageProcessor, AutoTokenizer, PretrainedConfig, PreTrainedModel, ProcessorMixin
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

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


@dataclass(frozen=True)
class DraftPositions:
    """The rotary position a text-only draft gives each row of a sequence being decoded: the prompt's rows at their
    own (``rope_positions``), every row i after them at i + ``shift``, as vLLM hands an EAGLE draft an mrope target's
    positions (``llm_base_proposer._set_positions``: the temporal row; each further draft step one more). A text
    prompt's rows sit at their indices. The draft pairs row i's target state with token i + 1 at row i's position,
    as training reads a shard's ``position_ids``."""

    prompt: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))  # [P]
    shift: int = 0

    def rows(self, start: int, count: int, device: torch.device) -> torch.Tensor:
        """Positions [count] of rows ``start`` .. ``start + count - 1``."""
        after = torch.arange(max(start, len(self.prompt)), start + count, device=device) + self.shift
        if start >= len(self.prompt):
            return after
        return torch.cat((self.prompt[start : start + count].to(device), after))

    def at(self, row: int) -> int:
        """The position of one row (read on the host: the prompt's positions stay there)."""
        return int(self.prompt[row]) if row < len(self.prompt) else row + self.shift


TEXT_POSITIONS = DraftPositions()


def with_text_after(vision: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """The vision inputs of a prompt followed by ``count`` text tokens: the per-token flags padded with text's 0."""
    return {
        key: torch.cat((value, value.new_zeros(*value.shape[:-1], count)), -1) if key in TOKEN_KEYS else value
        for key, value in vision.items()
    }


def on_model(vision: dict[str, torch.Tensor], model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Vision inputs on the target's device, the pixels in its dtype (processors give float32)."""
    return {
        key: value.to(model.device, model.dtype) if value.is_floating_point() else value.to(model.device)
        for key, value in vision.items()
    }


def images_only_processor(path: str, config: PretrainedConfig, why: ImportError) -> ProcessorMixin:
    """The family's own processor class (``AutoProcessor``'s pick) built from the folder's image processor and
    tokenizer alone, for a family whose processor also holds a video processor, which transformers builds only with
    torchvision (Qwen2.5-VL, Qwen3-VL). Without one the class cannot even be built: its argument check looks the
    video processor's base class up, and that class is torchvision's to define. Images go through the class's own
    code (placeholder expansion, token type flags); videos are refused (``why`` says what was missing)."""
    family = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(config.model_type, ""), None)
    if family is None or "video_processor" not in getattr(family, "get_attributes", lambda: [])():
        raise ValueError(f"{path}: the vision-language target's processor cannot be built ({why})") from why

    class ImagesOnly(family):  # type: ignore[misc, valid-type]  # the argument check reads this narrower signature
        def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> None:
            super().__init__(image_processor, tokenizer, chat_template=chat_template)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{family.__name__}ImagesOnly"
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ImagesOnly(AutoImageProcessor.from_pretrained(path), tokenizer, tokenizer.chat_template)
