"""Images in conversations: the content parts that hold them, where each is read from, and the checks a bad one
fails (missing, outside the folders it may come from, not an image), as a bad record naming the image.

A user turn's content is a string or a list of parts, as the HF chat templates and the OpenAI API write them:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": REF}`` or ``{"type": "image_url", "image_url":
{"url": REF}}``; a LLaVA-style record (``data.format: sharegpt``) names its images in an ``image`` field (one
path or a list) and marks where each goes with ``<image>`` in the human turns. Every image becomes the part
``{"type": "image", "image": REF}``; ``load_images`` then replaces each REF by the decoded image.

REF is a path, relative to the data file's folder (or absolute), which must lie inside that folder or the
folder ``data.image_dir`` names (a record must not make the capture read any file it can name), or an inline
``data:image/...;base64,...`` string, or an image already decoded (a hub dataset's ``datasets.Image`` column).
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from headstart.data_recipes.errors import DataError

LLAVA_MARKER = "<image>"  # where a LLaVA-style record's image goes in a human turn
INLINE_PREFIX = "data:image/"


def image_part(ref: Any) -> dict[str, Any]:
    return {"type": "image", "image": ref}


def content_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as the recipes keep it: a string, or a list of text and image parts (``image_part``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise DataError(f"{where}: content is {type(content).__name__}, expected a string or a list of parts")
    return [_part(part, f"{where}.content[{i}]") for i, part in enumerate(content)]


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image" and part.get("image") is not None:
        return image_part(part["image"])
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if isinstance(url, str):
            return image_part(url)
    raise DataError(f"{where}: not a text or image part: {str(part)[:80]}")


def llava_turn(text: str, images: Iterator[Any]) -> str | list[dict[str, Any]]:
    """A LLaVA-style human turn: each ``<image>`` marker replaced by the record's next image part."""
    if LLAVA_MARKER not in text:
        return text
    pieces = text.split(LLAVA_MARKER)
    parts: list[dict[str, Any]] = []
    for k, piece in enumerate(pieces):
        if k:
            try:
                parts.append(image_part(next(images)))
            except StopIteration:
                raise DataError(f"more {LLAVA_MARKER} markers than images in the record's 'image' field") from None
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    return parts


def text_of(content: str | list[dict[str, Any]]) -> str:
    """The text of a content: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content if part["type"] == "text")


def image_refs(messages: list[dict[str, Any]]) -> list[Any]:
    """Every image of the conversation, in the order the chat template renders them."""
    return [
        part["image"]
        for message in messages
        if not isinstance(message["content"], str)
        for part in message["content"]
        if part["type"] == "image"
    ]


def load_images(messages: list[dict[str, Any]], root: Path | None, image_dir: str | None) -> list[Image.Image]:
    """Decode each image of ``messages`` (``read_image``) and put it in its part; returns them in order.

    ``root`` is the data file's folder (None for a hub dataset, whose images come decoded)."""
    images = []
    for message in messages:
        if isinstance(message["content"], str):
            continue
        for part in message["content"]:
            if part["type"] == "image":
                part["image"] = read_image(part["image"], root, image_dir)
                images.append(part["image"])
    return images


def read_image(ref: Any, root: Path | None, image_dir: str | None) -> Image.Image:
    """One image, decoded to RGB; DataError naming it when it is missing, outside the allowed folders, or not an
    image."""
    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if not isinstance(ref, str):
        raise DataError(f"image {str(ref)[:60]!r}: expected a path or a data:image/...;base64 string")
    if ref.startswith(INLINE_PREFIX):
        return _decode(_inline_bytes(ref), "an inline image")
    path = _allowed_path(ref, root, image_dir)
    if not path.is_file():
        raise DataError(f"image {ref!r}: no such file ({path})")
    return _decode(path.read_bytes(), f"image {ref!r} ({path})")


def _allowed_path(ref: str, root: Path | None, image_dir: str | None) -> Path:
    folders = [folder.resolve() for folder in (root, Path(image_dir) if image_dir else None) if folder is not None]
    if not folders:
        raise DataError(f"image {ref!r}: a path needs a folder to lie in: name it in data.image_dir")
    inside = [path for folder in folders if folder in (path := (folder / ref).resolve()).parents]
    if inside:  # the first folder that holds the file, else the first the path would lie in (to name it missing)
        return next((path for path in inside if path.is_file()), inside[0])
    names = " or ".join(str(folder) for folder in folders)
    raise DataError(f"image {ref!r} lies outside {names}: images are read only from there (data.image_dir)")


def _inline_bytes(ref: str) -> bytes:
    header, _, payload = ref.partition(",")
    if not header.endswith(";base64"):
        raise DataError(f"inline image {ref[:40]!r}...: expected data:image/<type>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as err:
        raise DataError(f"inline image {ref[:40]!r}...: not base64 ({err})") from None


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")  # reads every pixel: a truncated file fails here, not in the capture
    except (UnidentifiedImageError, OSError) as err:
        raise DataError(f"{what} is not a readable image ({err})") from None
