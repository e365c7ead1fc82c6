"""Eval with image prompts: the bundled image bench (assets/data/vl/bench.jsonl, held-out images) read through a
vision-language target's processor, and ``eval.acceptance --bench`` decoding it with vanilla, n-gram and an EAGLE-3
head through the one verification core, greedy-identical; bad images and text targets refused by name."""

import json

import pytest
import torch

from headstart.core.models import load_processor, load_tokenizer
from headstart.data_recipes.bench import load_bench, turn_prompt, with_image_prompts
from headstart.data_recipes.errors import DataError
from headstart.eval import acceptance
from headstart.heads import build_head
from tests.helpers import REPO, one_image_prompt, write_jsonl

BENCH = REPO / "assets" / "data" / "vl" / "bench.jsonl"


def test_an_image_bench_item_is_the_processors_prompt(tiny_qwen_vl):
    _, tokenizer, processor = tiny_qwen_vl
    items = load_bench(BENCH)
    assert (
        len(items) == 8
        and items[0].category == "shape"
        and items[0].turns == ["What shape is in the picture, and what colour is it?"]
    )
    with pytest.raises(ValueError, match=r"bench.jsonl:1 holds images: its prompt is the processor's"):
        turn_prompt(tokenizer, items[0], [])
    item = with_image_prompts(items, processor, tokenizer)[0]
    ids, vision = one_image_prompt(processor, "held-shape-12.png", items[0].turns[0])
    assert torch.equal(turn_prompt(tokenizer, item, []), ids) and (ids == processor.image_token_id).sum() == 4
    assert item.vision is not None and torch.equal(item.vision["pixel_values"], vision["pixel_values"])


def test_bad_images_and_text_targets_are_refused_by_name(tiny_qwen_vl, tiny_target_dir, tmp_path):
    _, tokenizer, processor = tiny_qwen_vl
    parts = [{"type": "image", "image": "../outside.png"}, {"type": "text", "text": "What is it?"}]
    write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": parts}]}])
    items = load_bench(tmp_path / "b.jsonl")
    with pytest.raises(DataError, match=r"b.jsonl:1: image '../outside.png' lies outside"):
        with_image_prompts(items, processor, tokenizer)
    text = load_tokenizer(str(tiny_target_dir))
    with pytest.raises(ValueError, match=r"b.jsonl:1: a prompt with images needs a vision-language target"):
        with_image_prompts(items, load_processor(str(tiny_target_dir)), text)


def test_eval_acceptance_decodes_an_image_bench_greedy_identically(
    tiny_qwen_vl_dir, tiny_qwen_vl, tmp_path, one_thread
):
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, tiny_qwen_vl[0])
    for p in head.parameters():  # random weights: drafts mostly rejected, the rollback paths run
        p.data.normal_(0, 0.1)
    head.save_pretrained(tmp_path / "head")
    argv = ["--target", str(tiny_qwen_vl_dir), "--head", str(tmp_path / "head"), "--bench", str(BENCH)]
    argv += ["--method", "vanilla,ngram,eagle3", "--limit", "3", "--max-new-tokens", "8", "--device", "cpu"]
    report = acceptance.main([*argv, "--out", str(tmp_path / "out")])
    assert report["prompts"] == 3 and set(report["methods"]["vanilla"]["per_category"]) == {"shape", "chart", "text"}
    for name, entry in report["methods"].items():
        assert entry["greedy_identical"] is True and entry["new_tokens"] == 3 * 8, name
    assert json.loads((tmp_path / "out" / "report.json").read_text())["prompts"] == 3
