"""gpt-oss's harmony chat format, and replies that come with their reasoning.

Harmony (the chat template of openai/gpt-oss-20b and -120b) writes every message as
``<|start|>{role}<|channel|>{channel}<|message|>{content}<|end|>``. After the generation prompt
``<|start|>assistant`` the model writes its reasoning as an ``analysis`` message, then, itself,
``<|start|>assistant<|channel|>final<|message|>``, its answer and ``<|return|>``. The template renders an
assistant message's ``thinking`` field as that analysis message only for the conversation's last assistant
turn (earlier turns keep their final answers, closed by ``<|end|>``), so a training sample holds the reasoning
of its last reply. A template is treated as harmony by its text (``is_harmony``), never by a model's name.

A reply's reasoning travels as the assistant message's ``thinking`` (what the template reads; transformers
also accepts ``reasoning_content`` and ``reasoning`` for it): the hf engine cuts it out of the generated
harmony text (``split_reply``), an OpenAI-compatible server (vLLM with gpt-oss's reasoning parser) returns it
beside the content (``served_message``).
"""

from __future__ import annotations

from typing import Any

from headstart.data_recipes.engine_client import EngineError, quote
from headstart.data_recipes.errors import DataError

MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
START = "<|start|>"
FINAL_HEADER = f"{CHANNEL}final{MESSAGE}"
# What ends a harmony message: <|end|> closes one the model goes on after, <|return|> its last one, <|call|> a
# tool call (which a reply here carries no further).
CLOSERS = ("<|end|>", "<|return|>", "<|call|>")
# The names an OpenAI-compatible server gives a reply's reasoning: vLLM's older and newer, transformers' own.
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def is_harmony(template: str) -> bool:
    """Whether a chat template writes harmony's channels (its text names both of harmony's header tokens)."""
    return CHANNEL in template and MESSAGE in template


def reply_end(text: str, start: int, content: str, index: int) -> int:
    """Where assistant message ``index``'s final content ends in ``text``: right after the first final-channel
    header from ``start`` (the end of its generation prompt) on. The template refuses a ``thinking`` that holds
    that header, so the first one after the prompt is this reply's own, whatever its reasoning says."""
    header = text.find(FINAL_HEADER, start)
    begin = header + len(FINAL_HEADER)
    if header < 0 or not text.startswith(content, begin):
        raise DataError(f"message {index}: the harmony template does not render the final content verbatim")
    return begin + len(content)


def split_reply(generated: str) -> tuple[str, str] | None:
    """``(reasoning, answer)`` of a harmony reply decoded with its special tokens, from the first token after
    the generation prompt on; None when it has no harmony message at all (a target that does not speak it).

    The analysis messages are the reasoning (joined by a blank line where there are several), the final one
    the answer; a reply cut off by ``max_new_tokens`` inside its analysis has an empty answer. Other channels
    (commentary: preambles and tool calls) have no place in a template-rendered turn and are left out.
    """
    if MESSAGE not in generated:
        return None
    reasoning, answer = [], ""
    for part in generated.split(START):
        header, found, body = part.partition(MESSAGE)
        if not found or CHANNEL not in header:
            continue
        channel = header.partition(CHANNEL)[2].split(" ", 1)[0].strip()
        for closer in CLOSERS:
            body = body.split(closer, 1)[0]
        if channel == "analysis":
            reasoning.append(body.strip())
        elif channel == "final":
            answer = body.strip()
    return "\n\n".join(reasoning), answer


def reply_message(content: str, reasoning: str | None) -> dict[str, str]:
    """An assistant message: the reply, with its reasoning as ``thinking`` when there is any."""
    return {"role": "assistant", "content": content, **({"thinking": reasoning} if reasoning else {})}


def without_reasoning(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages with role and content only: a prompt for the next turn. The harmony template drops earlier
    turns' reasoning itself; a server rendering the chat its own way (vLLM's harmony encoder) is not trusted to,
    and the training sample, rendered by the template, has none of it before the last reply."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def served_message(answer: Any, base_url: str, what: str) -> tuple[dict[str, str], str]:
    """The assistant message (``reply_message``) and finish_reason of a ``/chat/completions`` answer, checked as
    ``ChatServer.complete`` checks a reply: the content a non-empty string, unless the answer carries reasoning:
    a reply cut off inside its reasoning has none (vLLM answers null), and keeps what it reasoned."""
    try:
        choice = answer["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        content = message["content"]
    except (KeyError, IndexError, TypeError):
        raise EngineError(f"{base_url}: {what}: not an answer of POST /chat/completions: {quote(answer)}") from None
    reasoning = next((message[k] for k in REASONING_KEYS if isinstance(message.get(k), str) and message[k].strip()), "")
    if content is None and reasoning:
        content = ""
    if not isinstance(content, str) or not (content.strip() or reasoning):
        raise EngineError(f"{base_url}: {what}: the reply is {quote(content)}, not a non-empty string")
    # Stripped as the hf engine strips what it decodes.
    return reply_message(content.strip(), reasoning.strip()), finish_reason
