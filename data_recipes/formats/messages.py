"""OpenAI chat messages: ``{"messages": [{"role": "user", "content": "..."}, ...]}``."""

from __future__ import annotations

from headstart.data_recipes.errors import get_field


def to_messages(record: dict) -> list[dict[str, str]]:
    messages = []
    for i, message in enumerate(get_field(record, "messages", list)):
        where = f"messages[{i}]"
        # Other keys (name, tool_calls, ...) are dropped: the recipes train on plain text turns.
        messages.append(
            {"role": get_field(message, "role", where=where), "content": get_field(message, "content", where=where)}
        )
    return messages
