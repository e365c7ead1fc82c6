"""The bundled image dataset, drawn here (nothing downloaded): shapes, bar charts and rendered words, each with a
question and its answer, under ``assets/data/vl/``.

    python -m scripts.dev.make_vl_data [--out assets/data/vl] [--per-kind 12]

writes ``images/*.png`` and the same questions in two record layouts the data recipes read:
``chat.jsonl`` (``data.format: messages``, the user turn's content a list of HF/OpenAI parts with
``{"type": "image", "image": "images/....png"}``) and ``llava.jsonl`` (``data.format: sharegpt`` with LLaVA's
``image`` field and the ``<image>`` marker in the human turn), and ``bench.jsonl``, a bench of held-out images
(``images/held-*.png``, none of them in the training records) for ``eval.acceptance --bench``: chat records with a
category, the answer as the trailing assistant message the bench drops. Paths are relative to the JSONL file's folder.
Deterministic: the same seed writes the same bytes. The images and questions are this project's own, generated
by this script, under the repository's licence (Apache-2.0; ``assets/data/vl/LICENSE``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

from PIL import Image, ImageDraw

SIDE = 56  # pixels: small enough for the tiny targets' image processors, large enough to draw on
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("circle", "square", "triangle")
WORDS = ("cat", "sun", "map", "box", "pen", "cup", "owl", "key", "jam", "fig", "hat", "ink")
BACKGROUND = (255, 255, 255)
BENCH_SIZE = 8  # held-out questions in bench.jsonl

Question = tuple[Image.Image, str, str]  # (image, question, answer)


def shape_question(rng: random.Random, index: int) -> Question:
    shape, colour = SHAPES[index % len(SHAPES)], rng.choice(sorted(COLOURS))
    image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    box = (10, 10, SIDE - 10, SIDE - 10)
    if shape == "circle":
        draw.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        draw.rectangle(box, fill=COLOURS[colour])
    else:
        draw.polygon([(SIDE // 2, 8), (SIDE - 8, SIDE - 8), (8, SIDE - 8)], fill=COLOURS[colour])
    return image, "What shape is in the picture, and what colour is it?", f"It is a {colour} {shape}."


def chart_question(rng: random.Random, index: int) -> Question:
    names = sorted(COLOURS)[:3]
    heights = rng.sample(range(8, SIDE - 8), len(names))
    image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    width = SIDE // (2 * len(names))
    for k, (name, height) in enumerate(zip(names, heights)):
        left = width // 2 + 2 * width * k
        draw.rectangle((left, SIDE - 4 - height, left + width, SIDE - 4), fill=COLOURS[name])
    tallest = names[heights.index(max(heights))]
    return image, "This bar chart has red, blue and green bars. Which bar is the tallest?", f"The {tallest} bar."


def text_question(rng: random.Random, index: int) -> Question:
    word = WORDS[index % len(WORDS)]
    image = Image.new("RGB", (SIDE, SIDE), BACKGROUND)
    ImageDraw.Draw(image).text((rng.randrange(4, 20), rng.randrange(8, 36)), word, fill=(0, 0, 0))
    return image, "What word is written in the image?", f'The word is "{word}".'


KINDS: dict[str, Callable[[random.Random, int], Question]] = {
    "shape": shape_question,
    "chart": chart_question,
    "text": text_question,
}


def chat_record(image: str, question: str, answer: str) -> dict:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def llava_record(image: str, question: str, answer: str) -> dict:
    turns = [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": answer}]
    return {"image": image, "conversations": turns}


def make(out: Path, per_kind: int, seed: int = 0) -> list[str]:
    """Draw ``per_kind`` images of each kind under ``out/images`` and write both record files, then the bench's
    held-out images and records; returns the images' relative paths."""
    rng = random.Random(seed)
    (out / "images").mkdir(parents=True, exist_ok=True)
    chats, llavas, paths = [], [], []
    for kind, draw in KINDS.items():
        for index in range(per_kind):
            image, question, answer = draw(rng, index)
            path = f"images/{kind}-{index:02d}.png"
            image.save(out / path, optimize=True)
            chats.append(chat_record(path, question, answer))
            llavas.append(llava_record(path, question, answer))
            paths.append(path)
    bench, held = bench_records(out, rng, BENCH_SIZE, per_kind)
    for name, rows in (("chat.jsonl", chats), ("llava.jsonl", llavas), ("bench.jsonl", bench)):
        (out / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return paths + held


def bench_records(out: Path, rng: random.Random, count: int, first: int) -> tuple[list[dict], list[str]]:
    """``count`` held-out questions, the kinds in turn, drawn past the training set's ``first`` of each kind: (the
    bench's chat records, each with its kind as category, the images' relative paths)."""
    kinds = list(KINDS.items())
    records, paths = [], []
    for k in range(count):
        (kind, draw), index = kinds[k % len(kinds)], first + k // len(kinds)
        image, question, answer = draw(rng, index)
        path = f"images/held-{kind}-{index:02d}.png"
        image.save(out / path, optimize=True)
        records.append({"category": kind, **chat_record(path, question, answer)})
        paths.append(path)
    return records, paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="assets/data/vl")
    parser.add_argument("--per-kind", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = make(Path(args.out), args.per_kind, args.seed)
    print(f"{args.out}: {len(paths)} images, chat.jsonl, llava.jsonl and bench.jsonl")


if __name__ == "__main__":
    main()
