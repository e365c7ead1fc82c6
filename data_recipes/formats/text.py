"""Plain text: ``{"text": ...}``. Not a chat: one ``text`` message, tokenized raw and trained on every token."""

from __future__ import annotations

from headstart.data_recipes.errors import get_field


def to_messages(record: dict) -> list[dict[str, str]]:
    return [{"role": "text", "content": get_field(record, "text")}]
