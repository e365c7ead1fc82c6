"""Conversations with images: both record layouts, the target's processor, placeholders never in the loss, and a
bad image refused by name."""

import base64
import json
import shutil

import pytest
import torch
from PIL import Image

from headstart.core.errors import DataError
from headstart.core.models import load_processor, load_tokenizer
from headstart.data_recipes.recipes import expand_loss_mask, load_samples
from tests.helpers import REPO, TARGET, world_of_one, write_jsonl

VL_DATA = REPO / "assets" / "data" / "vl"


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    return load_tokenizer(str(tiny_llava_dir)), load_processor(str(tiny_llava_dir))


def chat(image, question="What is it?", answer="A red circle."):
    parts = [{"type": "image", "image": image}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def samples_of(path, llava, fmt="messages", **kwargs):
    tokenizer, processor = llava
    return load_samples(str(path), fmt, tokenizer, 96, processor=processor, **kwargs)[0]


def test_both_layouts_give_the_same_samples_with_placeholders_out_of_the_loss(llava):
    tokenizer, processor = llava
    chats, llavas = samples_of(VL_DATA / "chat.jsonl", llava), samples_of(VL_DATA / "llava.jsonl", llava, "sharegpt")
    assert len(chats) == len(llavas) == 36
    for a, b in zip(chats, llavas):
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)
        torch.testing.assert_close(a.vision["pixel_values"], b.vision["pixel_values"], rtol=0, atol=0)
    first = chats[0]
    image_rows = [k for k, token in enumerate(first.input_ids) if token == processor.image_token_id]
    assert len(image_rows) == 4  # a 56-pixel image in 28-pixel patches: 2 x 2 placeholders
    assert all(first.loss_mask[k] == 0 for k in image_rows)
    trained = [token for token, keep in zip(first.input_ids, first.loss_mask) if keep]
    assert tokenizer.decode(trained) == "It is a yellow circle.<|im_end|>"
    image = Image.open(VL_DATA / "images" / "shape-00.png").convert("RGB")
    expected = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(first.vision["pixel_values"], expected, rtol=0, atol=0)


def test_an_inline_image_and_an_image_url_part_equal_the_file(llava, tmp_path):
    png = (VL_DATA / "images" / "chart-03.png").read_bytes()
    inline = "data:image/png;base64," + base64.b64encode(png).decode()
    url = chat(None)
    url["messages"][0]["content"][0] = {"type": "image_url", "image_url": {"url": inline}}
    path = write_jsonl(tmp_path / "d.jsonl", [chat(str(VL_DATA / "images" / "chart-03.png")), chat(inline), url])
    by_path, by_inline, by_url = samples_of(path, llava, image_dir=str(VL_DATA))
    for other in (by_inline, by_url):
        assert other.input_ids == by_path.input_ids
        torch.testing.assert_close(other.vision["pixel_values"], by_path.vision["pixel_values"], rtol=0, atol=0)


@pytest.mark.parametrize(
    "image, words",
    [
        ("missing.png", r"d\.jsonl:2: image 'missing\.png': no such file"),
        ("../outside.png", r"d\.jsonl:2: image '\.\./outside\.png' lies outside .*data\.image_dir"),
        ("broken.png", r"d\.jsonl:2: image 'broken\.png' .* is not a readable image"),
        ("data:image/png;base64,@@@", r"d\.jsonl:2: inline image .* not base64"),
    ],
)
def test_a_bad_image_is_a_bad_record_named_by_file_line_and_image(llava, tmp_path, image, words):
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(VL_DATA / "images" / "shape-00.png", data / "good.png")
    shutil.copy(VL_DATA / "images" / "shape-00.png", tmp_path / "outside.png")
    (data / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    path = write_jsonl(data / "d.jsonl", [chat("good.png"), chat(image)])
    with pytest.raises(DataError, match=words):
        samples_of(path, llava)
    tokenizer, processor = llava
    kept, report = load_samples(str(path), "messages", tokenizer, 96, on_error="skip", processor=processor)
    assert len(kept) == 1 and report.skipped == 1 and report.skipped_locations == [f"{path}:2"]


def test_a_folder_named_in_image_dir_may_hold_the_images(llava, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat("images/text-01.png")])
    with pytest.raises(DataError, match="no such file"):
        samples_of(path, llava)
    assert len(samples_of(path, llava, image_dir=str(VL_DATA))) == 1


def test_images_need_a_vision_language_target_and_stay_in_user_turns(llava, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(str(VL_DATA / "images" / "text-01.png"))])
    with pytest.raises(DataError, match=r"d\.jsonl:1: the conversation holds 1 image\(s\), but the target is a text"):
        load_samples(str(path), "messages", load_tokenizer(str(TARGET)), 96, image_dir=str(VL_DATA))
    answer = chat("x.png")
    answer["messages"][1]["content"] = [{"type": "text", "text": "no"}]
    path = write_jsonl(tmp_path / "e.jsonl", [answer])
    with pytest.raises(DataError, match=r"message 1 \(assistant\): only a user turn's content may be a list"):
        samples_of(path, llava)


def test_llava_records_place_images_at_their_markers_and_count_them(llava, tmp_path):
    image = str(VL_DATA / "images" / "shape-01.png")
    turns = [{"from": "human", "value": "Look: <image> and <image>"}, {"from": "gpt", "value": "Two squares."}]
    rows = [{"image": [image, image], "conversations": turns}, {"image": [image], "conversations": turns}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d\.jsonl:2: more <image> markers than images"):
        samples_of(path, llava, "sharegpt", image_dir=str(VL_DATA))
    two = samples_of(path, llava, "sharegpt", image_dir=str(VL_DATA), limit=1)[0]
    _, processor = llava
    assert two.input_ids.count(processor.image_token_id) == 8 and two.vision["pixel_values"].shape[0] == 2


def test_an_over_long_conversation_with_images_is_never_split_nor_cut_through_an_image(llava, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [chat(str(VL_DATA / "images" / "shape-00.png"), answer="word " * 60)])
    tokenizer, processor = llava
    common = dict(processor=processor, image_dir=str(VL_DATA))
    with pytest.raises(DataError, match="split would part its turns from its images"):
        load_samples(str(path), "messages", tokenizer, 40, over_length="split", **common)
    with pytest.raises(DataError, match="would cut an image's placeholder tokens"):
        load_samples(str(path), "messages", tokenizer, 6, **common)
    (cut,) = load_samples(str(path), "messages", tokenizer, 40, **common)[0]
    assert len(cut.input_ids) == 40 and cut.vision["pixel_values"].shape[0] == 1


def test_the_loss_mask_follows_the_placeholders_and_refuses_other_differences():
    assert expand_loss_mask([5, 9, 6, 7], [0, 0, 1, 1], [5, 9, 9, 9, 6, 7], image_token=9) == [0, 0, 0, 0, 1, 1]
    assert expand_loss_mask([9, 9, 7], [0, 0, 1], [9, 9, 9, 9, 7], image_token=9) == [0, 0, 0, 0, 1]
    with pytest.raises(DataError, match="differ from the chat template's at token 2"):
        expand_loss_mask([5, 9, 6], [0, 0, 1], [5, 9, 8], image_token=9)
    with pytest.raises(DataError, match="wrote no image placeholders"):
        expand_loss_mask([5, 9, 6], [0, 0, 1], [5, 6], image_token=9)
    assert json.dumps(expand_loss_mask([], [], [], 9)) == "[]"


def test_regeneration_refuses_conversations_with_images(tiny_llava_dir, tmp_path, monkeypatch):
    from headstart.data_recipes.regenerate import run_regenerate

    world_of_one(monkeypatch)
    config = {
        "target": {"path": str(tiny_llava_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(VL_DATA / "chat.jsonl"), "format": "messages", "limit": 2},
        "regenerate": {"out": str(tmp_path / "regen.jsonl"), "max_new_tokens": 4},
    }
    with pytest.raises(ValueError, match="regeneration asks the target with text only, and these conversations hold"):
        run_regenerate(config)
    assert not (tmp_path / "regen.jsonl").exists()
