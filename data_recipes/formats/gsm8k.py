"""GSM8K: ``{"question": ..., "answer": ...}`` (the bundled ``assets/data/gsm8k_train.jsonl``)."""

from __future__ import annotations

from headstart.data_recipes.errors import get_field


def to_messages(record: dict) -> list[dict[str, str]]:
    return [
        {"role": "user", "content": get_field(record, "question")},
        {"role": "assistant", "content": get_field(record, "answer")},
    ]
