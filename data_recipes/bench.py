"""Benchmark prompts: Spec-Bench, GSM8K, or any JSONL of chats or prompts, rendered with the target's chat template.

One JSON object per line, in any of these shapes (told apart by their keys):

- Spec-Bench: ``{"question_id", "category", "turns": [str, ...]}``; multi-turn: each turn is asked after
  the model's own answer to the previous one;
- GSM8K: ``{"question", "answer"}``, category ``gsm8k`` (the answer is the reference, never shown);
- chat: ``{"messages": [{"role", "content"}, ...]}``; trailing assistant messages (reference answers)
  are dropped and the conversation must then end with a user message;
- prompt: ``{"prompt": str}``.

Chats and prompts take an optional ``category``, else the file's name. Errors name ``file:line``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from headstart.core.errors import DataError
from headstart.core.io import read_jsonl
from headstart.data_recipes.prompts import render


@dataclass
class BenchItem:
    id: str
    category: str
    turns: list[str]  # user messages, asked one after another
    history: list[dict[str, str]] = field(default_factory=list)  # earlier messages (system, past turns)


def _records(path: Path) -> Iterator[tuple[str, dict]]:
    for location, record in read_jsonl(path):
        if not isinstance(record, dict):
            raise DataError(f"expected a JSON object, got {type(record).__name__}", location)
        yield location, record


def _text(record: dict, key: str, location: str) -> str:
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{key!r} must be a non-empty string", location)
    return value


def _chat_item(record: dict, location: str, default_category: str) -> BenchItem:
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise DataError("'messages' must be a list of {'role': str, 'content': str}", location)
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages or messages[-1]["role"] != "user":
        raise DataError("'messages' must contain a user message after any system/assistant ones", location)
    # What the target is shown must say something, as a prompt must; the dropped reference answers may be empty.
    empty = [i for i, m in enumerate(messages) if not m["content"].strip()]
    if empty:
        raise DataError(f"message {empty[0]} ({messages[empty[0]]['role']}) has empty 'content'", location)
    category = record.get("category", default_category)
    return BenchItem(location, str(category), [messages[-1]["content"]], list(messages[:-1]))


def parse_record(record: dict, location: str, default_category: str) -> BenchItem:
    """One benchmark item from one JSONL record (any supported shape)."""
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DataError("'turns' must be a non-empty list of non-empty strings", location)
        if "category" not in record:
            raise DataError("a Spec-Bench record needs 'category'", location)
        return BenchItem(str(record.get("question_id", location)), str(record["category"]), turns)
    if "question" in record:
        return BenchItem(location, "gsm8k", [_text(record, "question", location)])
    if "messages" in record:
        return _chat_item(record, location, default_category)
    if "prompt" in record:
        category = str(record.get("category", default_category))
        return BenchItem(location, category, [_text(record, "prompt", location)])
    raise DataError(
        f"unknown record shape (keys {sorted(record)}); expected 'turns' (Spec-Bench), 'question' (GSM8K), "
        "'messages' or 'prompt'",
        location,
    )


def load_bench(path: str | Path, limit: int | None = None) -> list[BenchItem]:
    """The items of a benchmark JSONL file; with ``limit``, that many taken round-robin over categories.

    Round-robin (file order within a category) so that a small run of Spec-Bench, whose file is sorted
    by category, still covers every category instead of only the first one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    items = [parse_record(record, location, path.stem) for location, record in _records(path)]
    if not items:
        raise DataError("no benchmark records", str(path))
    return round_robin(items, limit)


def round_robin(items: list[BenchItem], limit: int | None) -> list[BenchItem]:
    """``limit`` of ``items`` (all of them when None), one from each category in turn, file order within one."""
    if limit is None or limit >= len(items):
        return items
    by_category: dict[str, list[BenchItem]] = {}
    for item in items:
        by_category.setdefault(item.category, []).append(item)
    picked: list[BenchItem] = []
    for rank in range(len(items)):
        for group in by_category.values():
            if rank < len(group) and len(picked) < limit:
                picked.append(group[rank])
    return picked


def context_tokens(tokenizer: PreTrainedTokenizerBase, item: BenchItem, max_new_tokens: int) -> int:
    """About the most tokens ``item``'s conversation reaches (what the KV cache holds at the end of its last
    turn): its history and all its turns rendered as one user message (a template may refuse two user messages
    in a row), plus per turn a full reply and ``TURN_OVERHEAD`` tokens of the template's markers."""
    rendered = render(tokenizer, [*item.history, {"role": "user", "content": "\n".join(item.turns)}]).shape[1]
    return rendered + (max_new_tokens + TURN_OVERHEAD) * len(item.turns)


def longest_context(tokenizer: PreTrainedTokenizerBase, items: list[BenchItem], max_new_tokens: int) -> int:
    return max(context_tokens(tokenizer, item, max_new_tokens) for item in items)


def check_positions(
    tokenizer: PreTrainedTokenizerBase, items: list[BenchItem], max_new_tokens: int, tree_tokens: int, positions: int
) -> None:
    """ValueError naming the first item whose conversation (``context_tokens`` plus a tree's ``tree_tokens``) can
    run past the target's ``positions`` (max_position_embeddings): refused before decoding, never a report of
    positions the target was not trained for."""
    for item in items:
        needed = context_tokens(tokenizer, item, max_new_tokens) + tree_tokens
        if needed > positions:
            raise ValueError(
                f"bench item {item.id} ({item.category}) can reach {needed} tokens (its turns rendered, "
                f"{max_new_tokens} new tokens and {TURN_OVERHEAD} template tokens a turn, {tree_tokens} tree nodes), "
                f"past the target's {positions} positions: lower --max-new-tokens or leave the item out"
            )


TURN_OVERHEAD = 16  # role markers around a turn and its reply: 4-10 tokens in the Llama, Qwen and Gemma templates
