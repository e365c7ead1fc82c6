"""Benchmark prompts: Spec-Bench, GSM8K, or any JSONL of chats, prompts or token ids, rendered in a prompt format
(``data_recipes.prompts``: the target's chat template, or raw text as a completion API feeds it).

One JSON object per line, in any of these shapes (told apart by their keys, in this order):

- Spec-Bench: ``{"question_id", "category", "turns": [str, ...]}``; multi-turn: each turn is asked after
  the model's own answer to the previous one;
- GSM8K: ``{"question", "answer"}``, category ``gsm8k`` (the answer is the reference, never shown);
- chat: ``{"messages": [{"role", "content"}, ...]}``; trailing assistant messages (reference answers)
  are dropped and the conversation must then end with a user message. A content may be a list of text and image
  parts, as training data write them (``data_recipes.images``: a path inside the bench file's folder, or inline
  base64); a prompt with images is rendered by the target's processor into token ids and vision inputs
  (``with_image_prompts``), one turn, the prompt format not applying (as token ids);
- token ids: ``{"input_ids": [int, ...]}``: a prompt already tokenized, fed to the target as it is (one turn;
  the prompt format does not apply). Training writes its held-out prompts so (``<train.out_dir>/eval_prompts.jsonl``,
  category ``heldout``): ``eval.acceptance --bench`` on that file decodes exactly what training measured;
- prompt: ``{"prompt": str}`` or ``{"text": str}``.

Chats, token ids and prompts take an optional ``category``, else the file's name. Errors name ``file:line``; token
ids past the tokenizer's vocabulary are refused once it is known (``check_token_ids``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from headstart.core.errors import DataError
from headstart.core.io import read_jsonl
from headstart.data_recipes.images import content_parts, image_refs, load_images, text_of
from headstart.data_recipes.prompts import RAW_TURN_SEPARATOR, render, resolve_prompt_format
from headstart.data_recipes.recipes import image_prompt


@dataclass
class BenchItem:
    id: str
    category: str
    turns: list[str]  # user messages, asked one after another (token ids: one turn, its text unused)
    history: list[dict[str, str]] = field(default_factory=list)  # earlier messages (system, past turns)
    input_ids: list[int] | None = None  # a prompt already tokenized: the target is fed these, as they are
    image_messages: list[dict[str, Any]] | None = None  # a prompt with images: its messages, parts unread
    root: Path | None = None  # the bench file's folder, where its images' paths lie
    vision: dict[str, torch.Tensor] | None = None  # its processor's vision inputs (``with_image_prompts``)


def turn_prompt(
    tokenizer: PreTrainedTokenizerBase, item: BenchItem, answers: list[str], prompt_format: str = "auto"
) -> torch.Tensor:
    """Token ids [1, S] of ``item``'s turn ``len(answers)``, asked after its earlier turns and the model's
    ``answers`` to them: its ``input_ids`` as they are, else its messages in ``prompt_format`` (raw: everything so
    far as one text, each turn a continuation of the answer before it)."""
    if item.input_ids is not None:
        return torch.tensor([item.input_ids])
    if item.image_messages is not None:
        raise ValueError(f"bench item {item.id} holds images: its prompt is the processor's (with_image_prompts)")
    messages = list(item.history)
    for turn, answer in zip(item.turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": item.turns[len(answers)]})
    return render(tokenizer, messages, prompt_format)


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


def _chat_item(record: dict, location: str, default_category: str, root: Path) -> BenchItem:
    messages = record["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise DataError("'messages' must be a list of {'role': str, 'content': str or parts}", location)
    try:
        messages = [
            {"role": m["role"], "content": content_parts(m.get("content"), f"message {i}")}
            for i, m in enumerate(messages)
        ]
    except DataError as err:
        raise DataError(err.message, location) from None
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages or messages[-1]["role"] != "user":
        raise DataError("'messages' must contain a user message after any system/assistant ones", location)
    # What the target is shown must say something, as a prompt must; the dropped reference answers may be empty.
    empty = [i for i, m in enumerate(messages) if not (text_of(m["content"]).strip() or image_refs([m]))]
    if empty:
        raise DataError(f"message {empty[0]} ({messages[empty[0]]['role']}) has empty 'content'", location)
    category = str(record.get("category", default_category))
    if image_refs(messages):
        return BenchItem(location, category, [text_of(messages[-1]["content"])], image_messages=messages, root=root)
    texts = [{"role": m["role"], "content": text_of(m["content"])} for m in messages]
    return BenchItem(location, category, [texts[-1]["content"]], texts[:-1])


def _ids_item(record: dict, location: str, default_category: str) -> BenchItem:
    ids = record["input_ids"]
    # bool is an int to Python; a true/false among token ids is a mistake, not token 1 or 0.
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DataError("'input_ids' must be a non-empty list of integer token ids", location)
    if min(ids) < 0:
        raise DataError(f"'input_ids' has a negative token id {min(ids)}", location)
    category = str(record.get("category", default_category))
    return BenchItem(location, category, [""], input_ids=ids)


def parse_record(record: dict, location: str, default_category: str, root: Path = Path(".")) -> BenchItem:
    """One benchmark item from one JSONL record (any supported shape); ``root``: the folder its images lie in."""
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
        return _chat_item(record, location, default_category, root)
    if "input_ids" in record:  # before text: where a record carries its ids, they are the prompt exactly
        return _ids_item(record, location, default_category)
    for key in ("prompt", "text"):
        if key in record:
            return BenchItem(location, str(record.get("category", default_category)), [_text(record, key, location)])
    raise DataError(
        f"unknown record shape (keys {sorted(record)}); expected 'turns' (Spec-Bench), 'question' (GSM8K), "
        "'messages', 'input_ids', 'prompt' or 'text'",
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
    items = [parse_record(record, location, path.stem, path.parent) for location, record in _records(path)]
    if not items:
        raise DataError("no benchmark records", str(path))
    return round_robin(items, limit)


def with_image_prompts(
    items: list[BenchItem], processor: ProcessorMixin | None, tokenizer: PreTrainedTokenizerBase
) -> list[BenchItem]:
    """``items``, each prompt with images read (a bad image refused naming the item and the image) and rendered by
    the target's ``processor`` (``data_recipes.recipes.image_prompt``): its token ids and vision inputs, which the
    prefill reads. A text target (no processor) refuses such prompts, naming the first."""
    out = []
    for item in items:
        if item.image_messages is None:
            out.append(item)
            continue
        if processor is None:
            raise ValueError(f"bench item {item.id}: a prompt with images needs a vision-language target")
        messages = copy.deepcopy(item.image_messages)
        try:
            load_images(messages, item.root, None)
        except DataError as err:
            raise DataError(err.message, item.id) from None
        ids, vision = image_prompt(processor, tokenizer, messages)
        out.append(replace(item, input_ids=ids[0].tolist(), vision=vision))
    return out


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


def turn_overhead(prompt_format: str) -> int:
    """Tokens a turn adds besides its message and reply (``prompt_format`` resolved): the chat template's
    markers, or raw text's separator before the next turn and the reply re-tokenized across its edges."""
    return TURN_OVERHEAD if prompt_format == "chat" else RAW_TURN_OVERHEAD


def context_tokens(
    tokenizer: PreTrainedTokenizerBase, item: BenchItem, max_new_tokens: int, prompt_format: str = "auto"
) -> int:
    """About the most tokens ``item``'s conversation reaches (what the KV cache holds at the end of its last
    turn): its history and all its turns rendered in ``prompt_format`` as one user message (a template may refuse
    two user messages in a row), plus per turn a full reply and ``turn_overhead`` tokens. A token-ids item: its
    ids and one reply."""
    if item.input_ids is not None:
        return len(item.input_ids) + max_new_tokens
    asked = [*item.history, {"role": "user", "content": RAW_TURN_SEPARATOR.join(item.turns)}]
    rendered = render(tokenizer, asked, prompt_format).shape[1]
    overhead = turn_overhead(resolve_prompt_format(tokenizer, prompt_format))
    return rendered + (max_new_tokens + overhead) * len(item.turns)


def longest_context(
    tokenizer: PreTrainedTokenizerBase, items: list[BenchItem], max_new_tokens: int, prompt_format: str = "auto"
) -> int:
    return max(context_tokens(tokenizer, item, max_new_tokens, prompt_format) for item in items)


def check_token_ids(tokenizer: PreTrainedTokenizerBase, items: list[BenchItem]) -> None:
    """ValueError naming the first token-ids item with an id past ``tokenizer``'s vocabulary: ids tokenized for
    another model, refused before decoding (the target's embedding would fail on them with no word of the file)."""
    vocab = len(tokenizer)
    for item in items:
        past = [i for i in item.input_ids or [] if i >= vocab]
        if past:
            raise ValueError(
                f"bench item {item.id} ({item.category}): token id {past[0]} is past the target tokenizer's "
                f"{vocab} tokens (ids 0..{vocab - 1}): were its input_ids tokenized for another model?"
            )


def check_positions(
    tokenizer: PreTrainedTokenizerBase,
    items: list[BenchItem],
    max_new_tokens: int,
    tree_tokens: int,
    positions: int,
    prompt_format: str = "auto",
) -> None:
    """ValueError naming the first item whose conversation (``context_tokens`` plus a tree's ``tree_tokens``) can
    run past the target's ``positions`` (max_position_embeddings): refused before decoding, never a report of
    positions the target was not trained for."""
    resolved = resolve_prompt_format(tokenizer, prompt_format)
    for item in items:
        needed = context_tokens(tokenizer, item, max_new_tokens, resolved) + tree_tokens
        if needed > positions:
            raise ValueError(
                f"bench item {item.id} ({item.category}) can reach {needed} tokens (its turns rendered, "
                f"{max_new_tokens} new tokens and {turn_overhead(resolved)} tokens of {resolved} prompt markers a "
                f"turn, {tree_tokens} tree nodes), past the target's {positions} positions: lower --max-new-tokens "
                "or leave the item out"
            )


TURN_OVERHEAD = 16  # role markers around a turn and its reply: 4-10 tokens in the Llama, Qwen and Gemma templates
# Raw text: the blank line between a reply and the next turn (1-2 tokens) and the reply's text re-tokenized,
# which may merge differently across its edges than the tokens the target generated.
RAW_TURN_OVERHEAD = 4
