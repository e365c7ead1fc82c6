"""Dataset recipes: raw records -> chat messages -> token ids with an assistant-only loss mask.

The conversation is rendered with the target's own chat template, so the draft head trains on exactly
the token sequences the target sees at inference. The loss mask is 1 on the assistant contents and the
end-of-turn token that closes them (the model must learn to stop), 0 on system/user turns and on the
template's own headers. Under gpt-oss's harmony template the model writes its own channel headers after the
generation prompt, so there the mask covers everything from that prompt's end to the turn's closer
(``data_recipes.harmony``).

A conversation with images (``data_recipes.images``) is rendered the same way, each image as the template's one
image marker, and then through the target's processor, which turns each marker into the image's placeholder
tokens and computes the vision inputs (pixel values, image grid, ...): the placeholders are never in the loss.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any, cast

import torch
from jinja2 import TemplateError
from PIL import Image
from transformers import BatchEncoding, PreTrainedTokenizerBase, ProcessorMixin

from headstart.core.vision import TOKEN_KEYS
from headstart.data_recipes.errors import DataError
from headstart.data_recipes.formats import check_messages, get_format
from headstart.data_recipes.harmony import is_harmony, reply_end
from headstart.data_recipes.images import image_refs, load_images
from headstart.data_recipes.prompts import chat_template, chat_text, has_chat_template, raw_ids
from headstart.data_recipes.sources import read_records

# The marker transformers looks for before it can compute ``return_assistant_tokens_mask``.
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
Messages = list[dict[str, Any]]  # {"role", "content": a string or a list of parts (images), "thinking"?}


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]
    source: str  # the record's location, e.g. "data.jsonl:17"
    # A conversation with images: the target's vision inputs from its processor (pixel_values, image_grid_thw, ...),
    # each [1, ...] or the processor's own batch layout; empty for text.
    vision: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RecipeReport:
    read: int = 0
    kept: int = 0
    truncated: int = 0  # kept samples cut to max_length
    split: int = 0  # conversations past max_length cut into several samples (over_length: split)
    dropped_empty_mask: int = 0  # no assistant token left after truncation: nothing to learn from
    skipped: int = 0  # bad records under on_error="skip"
    skipped_locations: list[str | None] = field(default_factory=list)  # the first 20, each also printed with its reason

    def skip(self, err: DataError) -> None:
        self.skipped += 1
        if len(self.skipped_locations) < 20:
            self.skipped_locations.append(err.location)
            print(f"skipping {err}")

    def summary(self) -> str:
        return (
            f"read {self.read}, kept {self.kept}, truncated {self.truncated}, split {self.split}, "
            f"dropped {self.dropped_empty_mask} (no assistant tokens left), skipped {self.skipped} bad records"
        )


def tokenize_messages(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, max_length: int
) -> tuple[list[int], list[int], bool]:
    """Token ids and loss mask of one conversation, cut to ``max_length`` (the head is kept).

    Returns ``(input_ids, loss_mask, truncated)``."""
    input_ids, loss_mask = whole_conversation(tokenizer, messages)
    return input_ids[:max_length], loss_mask[:max_length], len(input_ids) > max_length


def whole_conversation(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one whole conversation. A single ``text`` message is tokenized raw with every
    token in the loss; a chat uses the template's ``{% generation %}`` blocks when it has them, else the
    character spans of the assistant contents in the rendered text.
    """
    if messages[0]["role"] == "text":
        input_ids = raw_ids(tokenizer, messages[0]["content"])
        loss_mask = [1] * len(input_ids)
    elif _GENERATION_BLOCK.search(template := chat_template(tokenizer)):
        # transformers types apply_chat_template's result as any of its forms: return_dict picks this one.
        out = cast(
            BatchEncoding,
            tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=template
            ),
        )
        input_ids, loss_mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        input_ids, loss_mask = _mask_from_spans(tokenizer, messages)
    return input_ids, loss_mask


def with_images(
    processor: ProcessorMixin,
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    images: list[Image.Image],
    input_ids: list[int],
    loss_mask: list[int],
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """A conversation with images through the target's processor: (token ids with each image's placeholders, the
    loss mask 0 on them, the vision inputs). The processor reads the same rendering ``whole_conversation``
    tokenized; its ids must equal those apart from the placeholders, or the record is refused."""
    text = chat_text(tokenizer, messages)
    out = dict(processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False))
    expanded = out.pop("input_ids")[0].tolist()
    out.pop("attention_mask", None)
    mask = expand_loss_mask(input_ids, loss_mask, expanded, image_token_id(processor))
    return expanded, mask, out


def image_prompt(
    processor: ProcessorMixin, tokenizer: PreTrainedTokenizerBase, messages: Messages
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A prompt with images as the target reads it: (token ids [1, S] with the images' placeholders, through the
    chat template with its generation prompt, the vision inputs), the messages' images already decoded
    (``read_conversations``)."""
    text = chat_text(tokenizer, messages, add_generation_prompt=True)
    out = dict(processor(text=[text], images=image_refs(messages), return_tensors="pt", add_special_tokens=False))
    out.pop("attention_mask", None)
    return out.pop("input_ids"), out


def image_token_id(processor: ProcessorMixin) -> int:
    """The placeholder token id the processor writes for each image's features."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        raise ValueError(f"{type(processor).__name__} names no image_token_id: not a vision-language processor")
    return int(token_id)


def expand_loss_mask(input_ids: list[int], loss_mask: list[int], expanded: list[int], image_token: int) -> list[int]:
    """``loss_mask`` of ``input_ids`` (each image the template's one ``image_token``) carried to ``expanded`` (each
    image as the processor writes it: a run of placeholders, and for some families text around them, Gemma-3's
    ``\n\n`` and end marker): the tokens both hold keep their mask, what the processor wrote for an image is 0.
    DataError where the processor dropped an image's marker, or where the two differ anywhere but next to a marker
    or on a token in the loss."""
    mask = [0] * len(expanded)
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, input_ids, expanded, autojunk=False).get_opcodes():
        if tag == "equal":
            mask[j1:j2] = loss_mask[i1:i2]
            continue
        dropped = [k for k in range(i1, i2) if input_ids[k] == image_token]
        if dropped:
            raise DataError(f"the processor wrote no image placeholders where the template put image {dropped[0]}")
        beside_marker = image_token in input_ids[max(i1 - 1, 0) : i2 + 1] or image_token in expanded[j1:j2]
        if not beside_marker or any(loss_mask[i1:i2]):
            raise DataError(f"the processor's tokens differ from the chat template's at token {i1}, not an image's")
    return mask


def split_at_turns(input_ids: list[int], loss_mask: list[int], max_length: int) -> list[tuple[int, int]]:
    """[start, end) pieces of at most ``max_length`` tokens covering a conversation (``data.over_length: split``),
    each ending where a turn ends if one does within reach: a turn ends where an assistant reply does (the loss
    mask falls from 1 to 0, the next turn's header starting there); a turn longer than ``max_length`` alone is cut
    at ``max_length``."""
    ends = [k for k in range(1, len(input_ids)) if loss_mask[k - 1] and not loss_mask[k]] + [len(input_ids)]
    pieces, start = [], 0
    while start < len(input_ids):
        reach = [end for end in ends if start < end <= start + max_length]
        end = reach[-1] if reach else start + max_length
        pieces.append((start, end))
        start = end
    return pieces


def _mask_from_spans(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> tuple[list[int], list[int]]:
    """Loss mask for templates without generation blocks (Llama-3, Qwen, Mistral, ...).

    A token is masked when its characters lie inside an assistant content; so is the special token that
    starts right where the content ends (``<|im_end|>``, ``<|eot_id|>``, ``</s>``, harmony's ``<|return|>``):
    the end of turn. Under harmony a turn's span starts where its generation prompt ends (``_assistant_spans``).
    """
    text = chat_text(tokenizer, messages)
    # The same call apply_chat_template(tokenize=True) makes: the template writes its own BOS.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    end_of_turn = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special} | {tokenizer.eos_token_id}
    loss_mask = [0] * len(input_ids)
    for begin, end in _assistant_spans(tokenizer, messages, text):
        for k, (start, stop) in enumerate(offsets):
            if begin <= start < stop <= end or (start == end and input_ids[k] in end_of_turn):
                loss_mask[k] = 1
    return input_ids, loss_mask


def _assistant_spans(tokenizer: PreTrainedTokenizerBase, messages: Messages, text: str) -> list[tuple[int, int]]:
    """Character spans ``[begin, end)`` of the assistant contents in ``text``, the rendered conversation.

    Under a harmony template a span is the whole reply the model writes after the generation prompt
    (``<|start|>assistant``): its analysis message, the ``<|start|>assistant<|channel|>final<|message|>``
    header it writes itself, and the final content.
    """
    spans, cursor = [], 0
    harmony = is_harmony(chat_template(tokenizer))
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # The history rendered with a generation prompt ends where turn i's content may start, so a user turn
        # that repeats the answer is never matched. Content can still come later (Qwen3 inserts an empty
        # <think> block first), hence the search. transformers refuses to render an empty history.
        prefix = chat_text(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        start = max(cursor, len(prefix) if text.startswith(prefix) else 0)
        if harmony:
            # The reply is all the model writes after its generation prompt, so that prompt must be where the
            # conversation's rendering has it (a first turn has no history for transformers to render one from).
            if not i or not text.startswith(prefix):
                raise DataError(f"message {i}: harmony: the reply's generation prompt is not the rendering's start")
            cursor = reply_end(text, start, message["content"], i)
            spans.append((start, cursor))
            continue
        content = message["content"]
        begin = text.find(content, start)
        if begin < 0:  # templates such as Llama-3's trim the content
            content = content.strip()
            begin = text.find(content, start)
        if begin < 0:
            raise DataError(f"message {i}: the chat template does not render the assistant content verbatim")
        cursor = begin + len(content)
        spans.append((begin, cursor))
    return spans


def read_conversations(
    source: str,
    format: str,
    on_error: str = "raise",
    split: str = "train",
    limit: int | None = None,
    report: RecipeReport | None = None,
    image_dir: str | None = None,
) -> Iterator[tuple[str, Messages]]:
    """Yield ``(location, messages)`` for every record of ``source`` that maps to a valid conversation, each image
    read and decoded into its part (``data_recipes.images.load_images``: from the data file's folder or
    ``image_dir``).

    A bad record (a bad image too) raises DataError naming its location, or with ``on_error="skip"`` is counted in
    ``report`` (the first ones printed) and passed over. ``limit`` stops after that many conversations.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    to_messages = get_format(format)
    report = RecipeReport() if report is None else report
    path = Path(source).expanduser()
    root = path.parent if path.is_file() else None

    def skip_unreadable(err: DataError) -> None:
        report.read += 1
        report.skip(err)

    count = 0
    for location, record in read_records(source, split, skip_unreadable if on_error == "skip" else None):
        report.read += 1
        try:
            messages = to_messages(record)
            check_messages(messages, plain_text=format == "text")
            load_images(messages, root, image_dir)
        except DataError as err:
            _bad_record(err.at(location), err, on_error, report)
            continue
        yield location, messages
        count += 1
        if limit is not None and count >= limit:
            return


def load_samples(
    source: str,
    format: str,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    on_error: str = "raise",
    split: str = "train",
    limit: int | None = None,
    over_length: str = "truncate",
    processor: ProcessorMixin | None = None,
    image_dir: str | None = None,
) -> tuple[list[Sample], RecipeReport]:
    """Read ``source`` as ``format`` and tokenize every record with the target's chat template.

    ``on_error="raise"`` stops at the first bad record with a DataError naming its location; ``"skip"``
    counts it and goes on. ``limit`` stops once that many samples are kept. A conversation past ``max_length``
    tokens is, by ``over_length`` (``data.over_length``): cut to it (``truncate``), cut into pieces at its turn
    ends (``split``, ``split_at_turns``: each piece a sample, without the context before it), or a bad record
    (``refuse``, under ``on_error``). The report is printed: nothing is truncated, split, dropped or skipped
    silently. Conversations with images go through ``processor``, the vision-language target's (``with_images``);
    without one they are bad records.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    check_template(tokenizer, source, format)
    report = RecipeReport()
    samples = []
    for location, messages in read_conversations(source, format, on_error, split, report=report, image_dir=image_dir):
        try:
            input_ids, loss_mask, vision = tokenized(tokenizer, processor, messages)
            image_token = image_token_id(processor) if vision and processor is not None else None
            pieces = over_length_pieces(input_ids, loss_mask, max_length, over_length, image_token)
        except (DataError, TemplateError) as err:
            # Templates reject what they cannot render (roles, alternation) with jinja's raise_exception.
            message = err.message if isinstance(err, DataError) else f"chat template rejected the conversation: {err}"
            _bad_record(DataError(message, location), err, on_error, report)
            continue
        report.split += len(pieces) > 1
        for start, end in pieces:
            if not any(loss_mask[start:end]):
                report.dropped_empty_mask += 1
                continue
            where = location if len(pieces) == 1 else f"{location} (tokens {start}-{end - 1})"
            kept = {key: value[..., start:end] if key in TOKEN_KEYS else value for key, value in vision.items()}
            samples.append(Sample(input_ids[start:end], loss_mask[start:end], where, kept))
            report.kept += 1
            report.truncated += end < len(input_ids) and len(pieces) == 1  # truncate: the one piece, cut
            if limit is not None and report.kept >= limit:
                break
        if limit is not None and report.kept >= limit:
            break
    print(f"{source}: {report.summary()}")
    return samples, report


def tokenized(
    tokenizer: PreTrainedTokenizerBase, processor: ProcessorMixin | None, messages: Messages
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """(token ids, loss mask, vision inputs) of one whole conversation: ``whole_conversation``, then, when it holds
    images, ``with_images``."""
    images = image_refs(messages)
    if images and processor is None:  # before a text model's template is asked to render image parts
        raise DataError(
            f"the conversation holds {len(images)} image(s), but the target is a text model (no image processor): "
            "use a vision-language target, or data without images"
        )
    input_ids, loss_mask = whole_conversation(tokenizer, messages)
    if not images or processor is None:
        return input_ids, loss_mask, {}
    return with_images(processor, tokenizer, messages, images, input_ids, loss_mask)


def over_length_pieces(
    input_ids: list[int], loss_mask: list[int], max_length: int, rule: str, image_token: int | None = None
) -> list[tuple[int, int]]:
    """The [start, end) samples ``data.over_length`` makes of one conversation (``load_samples``). A conversation with
    images (their placeholders ``image_token``) is never split (a piece after the first would lose the images it
    reads about) nor cut through an image's placeholders (its vision inputs would not match)."""
    if len(input_ids) <= max_length:
        return [(0, len(input_ids))]
    if image_token is not None and (rule == "split" or image_token in input_ids[max_length:]):
        raise DataError(
            f"the conversation with images is {len(input_ids)} tokens, past data.max_length={max_length}, and "
            + (
                "data.over_length split would part its turns from its images"
                if rule == "split"
                else "cutting it there would cut an image's placeholder tokens"
            )
            + ": raise data.max_length"
        )
    if rule == "refuse":
        raise DataError(
            f"the conversation is {len(input_ids)} tokens, past data.max_length={max_length} "
            "(data.over_length: refuse): raise data.max_length, or set data.over_length to split (at turn ends) "
            "or truncate"
        )
    return split_at_turns(input_ids, loss_mask, max_length) if rule == "split" else [(0, max_length)]


def check_template(tokenizer: PreTrainedTokenizerBase, source: str, format: str) -> None:
    """ValueError naming the target and the way out when chats are to be rendered by a tokenizer with no chat
    template (a base model's): before any record is read, not as transformers' traceback at the first one."""
    if format == "text" or has_chat_template(tokenizer):
        return
    raise ValueError(
        f"{source}: data.format {format!r} renders conversations with the target's chat template, but its "
        f"tokenizer ({tokenizer.name_or_path or 'unnamed'}) has none (a base model?): use data.format: text "
        "for raw text, or a target (tokenizer) with a chat template"
    )


def require_samples(samples: list[Sample], report: RecipeReport, source: str, max_length: int) -> None:
    """DataError naming ``source`` when nothing is left to train on, and why (every loss mask empty, say)."""
    if samples:
        return
    if report.dropped_empty_mask:
        raise DataError(
            f"no sample has assistant tokens: the loss mask of all {report.dropped_empty_mask} conversations is empty "
            f"within data.max_length={max_length} tokens, so there is nothing to learn from ({report.summary()}); "
            "check data.format, that the records have assistant turns, and data.max_length",
            source,
        )
    raise DataError(f"no usable samples ({report.summary()})", source)


def _bad_record(err: DataError, cause: Exception, on_error: str, report: RecipeReport) -> None:
    if on_error == "raise":
        raise err from cause
    report.skip(err)
