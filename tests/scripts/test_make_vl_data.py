"""The bundled image dataset (assets/data/vl) is what its script draws, byte for byte, and small."""

import json

from PIL import Image

from headstart.scripts.dev.make_vl_data import COLOURS, make
from tests.helpers import REPO

BUNDLED = REPO / "assets" / "data" / "vl"


def test_the_bundled_images_and_records_are_the_scripts_output(tmp_path):
    paths = make(tmp_path, per_kind=12)
    assert len(paths) == 36 + 8  # the training records' images, then the bench's held-out ones
    for name in [*paths, "chat.jsonl", "llava.jsonl", "bench.jsonl"]:
        assert (tmp_path / name).read_bytes() == (BUNDLED / name).read_bytes(), name
    assert sum((BUNDLED / path).stat().st_size for path in paths) < 40_000  # tens of KB in the repository


def test_the_bench_asks_of_images_training_never_shows():
    trained = {json.loads(line)["image"] for line in (BUNDLED / "llava.jsonl").read_text().splitlines()}
    bench = [json.loads(line) for line in (BUNDLED / "bench.jsonl").read_text().splitlines()]
    asked = [record["messages"][0]["content"][0]["image"] for record in bench]
    assert len(set(asked)) == 8 and not trained & set(asked)
    assert {record["category"] for record in bench} == {"shape", "chart", "text"}


def test_both_layouts_ask_the_same_questions_of_the_same_images():
    chats = [json.loads(line) for line in (BUNDLED / "chat.jsonl").read_text().splitlines()]
    llavas = [json.loads(line) for line in (BUNDLED / "llava.jsonl").read_text().splitlines()]
    for chat, llava in zip(chats, llavas, strict=True):
        image, question = chat["messages"][0]["content"]
        assert image == {"type": "image", "image": llava["image"]}
        assert llava["conversations"][0]["value"] == f"<image>\n{question['text']}"
        assert chat["messages"][1]["content"] == llava["conversations"][1]["value"]


def test_a_charts_answer_names_the_bar_with_the_most_pixels():
    for line in (BUNDLED / "llava.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "chart" not in record["image"]:
            continue
        pixels = list(Image.open(BUNDLED / record["image"]).get_flattened_data())
        tallest = max(("red", "blue", "green"), key=lambda name: pixels.count(COLOURS[name]))
        assert record["conversations"][1]["value"] == f"The {tallest} bar."
