"""The dataset formats: each maps one raw record to chat messages ``{"role", "content"}`` (and an assistant's
``thinking``, from the ``messages`` format)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headstart.data_recipes.errors import DataError
from headstart.data_recipes.formats import alpaca, gsm8k, messages, sharegpt, text
from headstart.data_recipes.images import text_of

FORMATS: dict[str, Callable[[dict], list[dict[str, Any]]]] = {
    "alpaca": alpaca.to_messages,
    "gsm8k": gsm8k.to_messages,
    "messages": messages.to_messages,
    "sharegpt": sharegpt.to_messages,
    "text": text.to_messages,
}

CHAT_ROLES = ("system", "user", "assistant")


def get_format(name: str) -> Callable[[dict], list[dict[str, Any]]]:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown data format {name!r}; known formats: {', '.join(sorted(FORMATS))}") from None


def check_messages(messages: list[dict[str, Any]], plain_text: bool = False) -> None:
    """Raise DataError unless ``messages`` is a chat with an assistant turn, or, from the ``text`` format
    (``plain_text``), a single ``text`` message. Only assistant turns carry reasoning (``thinking``), and one
    that does may have an empty content.

    Only the text format may make a ``text`` message: one that came from a chat record (a ``messages``
    turn with the role "text") would train as raw text with every token in the loss. Only user turns hold images
    (a list of parts, ``data_recipes.images``); a turn of images alone is not empty.
    """
    if not messages:
        raise DataError("conversation is empty")
    is_text = plain_text and len(messages) == 1 and messages[0]["role"] == "text"
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in CHAT_ROLES and not is_text:
            raise DataError(f"message {i}: unknown role {role!r}; expected one of {', '.join(CHAT_ROLES)}")
        thinking = message.get("thinking", "")
        if thinking and role != "assistant":
            raise DataError(f"message {i} ({role}): only an assistant turn has reasoning ('thinking')")
        content = message["content"]
        if not isinstance(content, str) and role != "user":
            raise DataError(f"message {i} ({role}): only a user turn's content may be a list of parts (images)")
        # A reply cut off by max_new_tokens inside its reasoning has no answer yet: its reasoning is kept.
        if not text_of(content).strip() and not thinking.strip() and (isinstance(content, str) or not content):
            raise DataError(f"message {i} ({role}): content is empty")
    if not is_text and not any(message["role"] == "assistant" for message in messages):
        raise DataError("conversation has no assistant turn (nothing to train on)")
