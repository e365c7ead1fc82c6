"""OpenAI chat messages: ``{"messages": [{"role": "user", "content": "..."}, ...]}``.

An assistant message's reasoning, under any of the names it is written with (``thinking``, what gpt-oss's
template reads and what regeneration writes; ``reasoning_content``, vLLM's and Qwen3's; ``reasoning``), is kept
as ``thinking``: templates that render reasoning put it back into the sample (harmony's analysis channel).
A message's content is a string or a list of text and image parts (``data_recipes.images.content_parts``).
"""

from __future__ import annotations

from typing import Any

from headstart.data_recipes.errors import get_field
from headstart.data_recipes.images import content_parts

REASONING_KEYS = ("thinking", "reasoning_content", "reasoning")


def to_messages(record: dict) -> list[dict[str, Any]]:
    messages = []
    for i, message in enumerate(get_field(record, "messages", list)):
        where = f"messages[{i}]"
        # Other keys (name, tool_calls, ...) are dropped: the recipes train on plain text turns.
        content = content_parts(get_field(message, "content", object, where=where), where)
        turn = {"role": get_field(message, "role", where=where), "content": content}
        reasoning = next(
            (text for key in REASONING_KEYS if (text := get_field(message, key, required=False, where=where))), None
        )
        if reasoning is not None:
            turn["thinking"] = reasoning
        messages.append(turn)
    return messages
