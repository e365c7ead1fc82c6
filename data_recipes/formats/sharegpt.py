"""ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}``."""

from __future__ import annotations

from headstart.data_recipes.errors import DataError, get_field

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


def to_messages(record: dict) -> list[dict[str, str]]:
    messages = []
    for i, turn in enumerate(get_field(record, "conversations", list)):
        where = f"conversations[{i}]"
        speaker = get_field(turn, "from", where=where)
        if speaker not in ROLES:
            raise DataError(f"{where}: unknown 'from' value {speaker!r}; expected one of {sorted(ROLES)}")
        messages.append({"role": ROLES[speaker], "content": get_field(turn, "value", where=where)})
    return messages
