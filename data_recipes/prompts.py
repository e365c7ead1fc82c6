"""How a prompt becomes the target's input tokens: through its chat template, or as raw text.

Two prompt formats, one rule each:

- ``chat``: the messages through the tokenizer's chat template with the generation prompt, so the target is
  asked exactly as a chat API would ask it (the template writes its own special tokens, a BOS included);
- ``raw``: what a completion API (vLLM's ``/v1/completions``) feeds the target: the text through the tokenizer
  with its own special tokens (its BOS, where the tokenizer adds one). Messages are joined as one text, each
  message's content after the one before it with ``RAW_TURN_SEPARATOR`` between them, so a later turn reads
  as the target's own continuation of the earlier ones (no role markers: a base model has none).

``auto`` (the default everywhere) is ``chat`` when the tokenizer has a chat template and ``raw`` when it has
none (a base model, a code-completion model, an instruct checkpoint shipped without one). A target with a
template can still be prompted raw.

Raw text is also what ``data.format: text`` trains on (``raw_ids``), and a text's prompt for regeneration and
for training's measured acceptance is its first ``TEXT_PROMPT_FRACTION`` of tokens (``text_prompt_length``).

Chat templates that write today's date (gpt-oss's "Current date:", Llama-3.1's "Today Date:", both through
transformers' ``strftime_now``) are rendered on ``TEMPLATE_DATE`` instead (``chat_template``, ``chat_text``):
otherwise a recipe's token ids, and the shards captured from them, change at midnight while every hash that
should tell (the tokenizer's, the capture's fingerprint) stays the same.
"""

from __future__ import annotations

import json
import re
from datetime import date
from typing import Any, Literal, cast, get_args

import torch
from transformers import PreTrainedTokenizerBase

PromptFormat = Literal["auto", "chat", "raw"]
# The --prompt-format flag of every command that decodes bench prompts; each resolves it once (resolve_prompt_format).
PROMPT_FORMAT_HELP = (
    "chat: the target's chat template; raw: the text as a completion API tokenizes it; "
    "auto: chat where the tokenizer has a template, else raw"
)
PROMPT_FORMATS: tuple[str, ...] = get_args(PromptFormat)
RAW_TURN_SEPARATOR = "\n\n"
TEXT_PROMPT_FRACTION = 0.5  # a text's prompt: its first half of tokens; the target continues the rest
# The day every chat template that reads the clock renders: fixed, so the same data gives the same ids any day.
# Changing it changes those templates' samples (and the regenerated prompts): it is part of the recipe.
TEMPLATE_DATE = date(2025, 1, 1)
# A call with a literal format, the only kind the pinned template answers (a computed one is refused when rendered).
_STRFTIME_CALL = re.compile(r"""strftime_now\(\s*(["'])(.*?)\1\s*\)""")


def has_chat_template(tokenizer: PreTrainedTokenizerBase) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's chat template, its clock pinned to ``TEMPLATE_DATE`` where it reads one.

    transformers gives templates ``strftime_now`` (today's date) as a global, and a callable passed as a
    render argument reaches the template as a placeholder string, so the override is in the template itself:
    a macro of that name, defined first, shadows the global everywhere in the template, answering each format
    the template writes with ``TEMPLATE_DATE`` in it. Other templates come back unchanged (their cache entry
    and everything else stay as they were).
    """
    template = tokenizer.get_chat_template()
    if "strftime_now" not in template:
        return template
    table = json.dumps({fmt: TEMPLATE_DATE.strftime(fmt) for _, fmt in _STRFTIME_CALL.findall(template)})
    refusal = json.dumps(f"headstart pins the chat template's date to {TEMPLATE_DATE}: strftime_now(") + " + format"
    macro = (
        "{%- macro strftime_now(format) -%}"
        f"{{{{- {table}[format] if format in {table} else raise_exception({refusal} + ') has no literal format') -}}}}"
        "{%- endmacro -%}"
    )
    return macro + template


def chat_text(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], add_generation_prompt: bool = False
) -> str:
    """``messages`` rendered by the target's chat template (``chat_template``: its date pinned), as text."""
    template = chat_template(tokenizer)
    return cast(
        str,
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=template
        ),
    )


def resolve_prompt_format(tokenizer: PreTrainedTokenizerBase, requested: str) -> Literal["chat", "raw"]:
    """``requested`` (``PROMPT_FORMATS``) made concrete for ``tokenizer``: ``auto`` follows the template;
    ``chat`` without a template is refused naming the way out."""
    if requested not in PROMPT_FORMATS:
        raise ValueError(f"unknown prompt format {requested!r}; known: {', '.join(PROMPT_FORMATS)}")
    if requested == "raw" or (requested == "auto" and not has_chat_template(tokenizer)):
        return "raw"
    if not has_chat_template(tokenizer):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no chat template to render chat prompts with (a base "
            "model?): use the raw prompt format (--prompt-format raw, or auto)"
        )
    return "chat"


def raw_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` as a completion API tokenizes a prompt: with the tokenizer's own special tokens."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def raw_text(messages: list[dict[str, str]]) -> str:
    """The messages' contents as one text, each after the one before it (``RAW_TURN_SEPARATOR`` between)."""
    return RAW_TURN_SEPARATOR.join(message["content"] for message in messages)


def render(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], prompt_format: str = "auto"
) -> torch.Tensor:
    """Token ids [1, S] of ``messages`` in ``prompt_format``, ready for the target's reply (or continuation)."""
    if resolve_prompt_format(tokenizer, prompt_format) == "raw":
        return torch.tensor([raw_ids(tokenizer, raw_text(messages))])
    text = chat_text(tokenizer, messages, add_generation_prompt=True)
    # The template already writes every special token it wants (a BOS included).
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def text_prompt_length(tokens: int) -> int:
    """How many of a text's ``tokens`` are its prompt: the first ``TEXT_PROMPT_FRACTION``, at least one, and at
    least one left to continue (a text of one token is all prompt)."""
    return max(1, min(tokens - 1, int(tokens * TEXT_PROMPT_FRACTION)))


def data_prompt_format(data_format: str) -> Literal["chat", "raw"]:
    """How samples of ``data.format`` reached the target: raw for ``text``, its chat template for the rest. A head
    records it (``HeadConfig.prompt_format``): its prompts are rendered the same way when it is measured or served."""
    return "raw" if data_format == "text" else "chat"
