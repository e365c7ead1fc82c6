"""Alpaca: ``{"instruction": ..., "input": ... (optional), "output": ..., "system": ... (optional)}``."""

from __future__ import annotations

from headstart.data_recipes.errors import get_field


def to_messages(record: dict) -> list[dict[str, str]]:
    prompt = get_field(record, "instruction")
    extra = get_field(record, "input", required=False)
    if extra and extra.strip():
        prompt = f"{prompt}\n\n{extra}"
    system = get_field(record, "system", required=False)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    messages.append({"role": "assistant", "content": get_field(record, "output")})
    return messages
