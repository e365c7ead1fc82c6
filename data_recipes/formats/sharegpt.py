"""ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}``, and
LLaVA's records in it: an ``image`` field (a path or a list of them) whose images go where the human turns write
``<image>`` (or before the first human turn's text when no turn marks a place: ``data_recipes.images``)."""

from __future__ import annotations

from typing import Any

from headstart.data_recipes.errors import DataError, get_field
from headstart.data_recipes.images import LLAVA_MARKER, image_part, llava_turn

# The speaker names seen in ShareGPT-style dumps (Vicuna, SlimOrca, OpenHermes, ...).
ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}


def to_messages(record: dict) -> list[dict[str, Any]]:
    images = _record_images(record)
    pending = iter(images)
    messages: list[dict[str, Any]] = []
    for i, turn in enumerate(get_field(record, "conversations", list)):
        where = f"conversations[{i}]"
        speaker = get_field(turn, "from", where=where)
        if speaker not in ROLES:
            raise DataError(f"{where}: unknown 'from' value {speaker!r}; expected one of {sorted(ROLES)}")
        text = get_field(turn, "value", where=where)
        content = llava_turn(text, pending) if images and ROLES[speaker] == "user" else text
        messages.append({"role": ROLES[speaker], "content": content})
    if images and not any(LLAVA_MARKER in str(turn.get("value")) for turn in record["conversations"]):
        first = next((m for m in messages if m["role"] == "user"), None)
        if first is None:
            raise DataError("the record has images but no human turn to show them in")
        first["content"] = [*map(image_part, images), {"type": "text", "text": first["content"]}]
    elif next(pending, None) is not None:
        raise DataError(f"the record's 'image' field has more images than its turns have {LLAVA_MARKER} markers")
    return messages


def _record_images(record: dict) -> list[Any]:
    """The paths in a LLaVA record's ``image`` field: one path, a list of them, or none."""
    images = record.get("image")
    if images is None:
        return []
    images = images if isinstance(images, list) else [images]
    if not all(isinstance(image, str) for image in images):
        raise DataError("field 'image' must be a path or a list of paths")
    return images
