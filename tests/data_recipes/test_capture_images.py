"""Capture from a vision-language target: the states of a forward with the images, the image rows marked in the
shards, text captures unchanged, and a capture killed and resumed ending byte-identical."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from headstart.core.models import load_processor, load_tokenizer
from headstart.data_recipes.capture import capture_shard, run_capture
from headstart.data_recipes.capture_plan import storage_estimate
from headstart.data_recipes.recipes import Sample, load_samples
from headstart.data_recipes.shards import ShardDataset, pack_collate, read_manifest
from headstart.data_recipes.states import VisionRows, forward_states
from tests.helpers import REPO, one_image_prompt, subprocess_env

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"


def vl_config(target, out, limit=8, **capture):
    return {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(VL_CHAT), "format": "messages", "max_length": 64, "limit": limit},
        "capture": {
            "out_dir": str(out),
            "aux_layers": [1, 2, 3],
            "store_dtype": "fp32",
            "shard_samples": 4,
            "batch_tokens": 256,
            **capture,
        },
    }


@pytest.fixture(scope="module")
def vl_captured(tiny_llava_dir, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread, as the one_thread fixture gives a test
    out = tmp_path_factory.mktemp("vl-capture") / "shards"
    try:
        run_capture(vl_config(tiny_llava_dir, out))
    finally:
        torch.set_num_threads(threads)
    return out


@torch.no_grad()
def test_the_states_are_the_targets_with_its_images_and_image_rows_are_marked(vl_captured, tiny_llava_dir):
    model = AutoModelForImageTextToText.from_pretrained(tiny_llava_dir).eval()
    processor, tokenizer = load_processor(str(tiny_llava_dir)), load_tokenizer(str(tiny_llava_dir))
    samples, _ = load_samples(str(VL_CHAT), "messages", tokenizer, 64, processor=processor, limit=8)
    manifest = read_manifest(vl_captured)
    assert manifest["vision"] == {"image_token_id": processor.image_token_id, "positions": "sequence"}
    dataset = ShardDataset(vl_captured)
    for index in (0, 5):
        stored = dataset[index]
        sample = samples[int(stored["sample_id"])]
        ids = torch.tensor([sample.input_ids])
        fresh = model(input_ids=ids, **sample.vision, output_hidden_states=True).hidden_states
        torch.testing.assert_close(stored["aux_hidden"], torch.cat([fresh[i][0] for i in (1, 2, 3)], -1))
        torch.testing.assert_close(stored["last_hidden"], fresh[-1][0])
        image_rows = stored["input_ids"] == processor.image_token_id
        assert image_rows.sum() == 4 and torch.equal(stored["image_mask"].bool(), image_rows)
        assert not (stored["loss_mask"].bool() & image_rows).any()
        # Without the image the same tokens give other states from the image rows on: the images were read.
        text_only = model.model.language_model(input_ids=ids, output_hidden_states=True).hidden_states
        first = int(image_rows.nonzero()[0])
        assert not torch.allclose(text_only[2][0, first:], fresh[2][0, first:])
    assert manifest["bytes"] > 0 and "position_ids" not in dataset.keys  # Llava's rotary counts rows: none stored


def test_the_estimate_counts_the_image_mask_and_packing_keeps_stored_positions(vl_captured):
    manifest = read_manifest(vl_captured)
    vision = VisionRows(manifest["vision"]["image_token_id"], None)  # Llava: no mrope
    estimate = storage_estimate(manifest["tokens"], 64, 3, torch.float32, vision)
    assert estimate - storage_estimate(manifest["tokens"], 64, 3, torch.float32) == manifest["tokens"]
    assert abs(manifest["bytes"] - estimate) < 2048 * len(manifest["shards"])  # headers and metadata apart
    dataset = ShardDataset(vl_captured)
    a, b = dataset[0], dataset[1]
    packed = pack_collate([a | {"position_ids": a["input_ids"] * 0 + 7}, b | {"position_ids": b["input_ids"] * 0}])
    assert packed["position_ids"][0, : len(a["input_ids"])].eq(7).all()
    assert packed["image_mask"].sum() == 8


def test_a_text_capture_holds_no_vision_tensors(tiny_target_dir, gsm8k_file, tmp_path, one_thread):
    config = vl_config(tiny_target_dir, tmp_path / "text", limit=4, aux_layers=[1, 3, 4])
    config["data"] |= {"source": str(gsm8k_file), "format": "gsm8k"}
    run_capture(config)
    assert "vision" not in read_manifest(tmp_path / "text")
    with safe_open(str(tmp_path / "text" / "shard-00000.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "aux_hidden", "input_ids", "last_hidden", "loss_mask", "sample_ids", "sample_offsets"
        ]  # fmt: skip


def test_a_vision_language_capture_killed_and_resumed_is_byte_identical(tiny_llava_dir, tmp_path, one_thread):
    reference = tmp_path / "reference"
    run_capture(vl_config(tiny_llava_dir, reference, limit=12, shard_samples=2))
    names = sorted(p.name for p in reference.glob("*.safetensors")) + ["manifest.json"]
    assert len(names) == 7
    out = tmp_path / "shards"
    config = tmp_path / "capture.json"
    config.write_text(json.dumps(vl_config(tiny_llava_dir, out, limit=12, shard_samples=2)))
    cmd = [sys.executable, "-m", "data_recipes.capture", "--config", str(config)]
    # The caller's PYTHONPATH first: the package under test, wherever it is installed from.
    env = subprocess_env() | {"PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(out.glob("shard-*.safetensors")) and time.time() < deadline:
        time.sleep(0.002)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    written = list(out.glob("shard-*.safetensors"))
    assert 0 < len(written) < 6 and not (out / "manifest.json").exists()
    resumed = subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    assert f"({len(written)} already complete, resuming)" in resumed.stdout
    for name in names:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


@torch.no_grad()
def test_an_mrope_targets_shards_hold_each_rows_draft_position(tiny_qwen_vl, one_thread):
    target, _, processor = tiny_qwen_vl
    ids, vision = one_image_prompt(processor, "chart-02.png", "Which bar is the tallest?")
    answer = processor.tokenizer(" The red bar.<|im_end|>", add_special_tokens=False).input_ids
    full = ids[0].tolist() + answer
    vision["mm_token_type_ids"] = torch.cat(
        (vision["mm_token_type_ids"], torch.zeros(1, len(answer), dtype=torch.int)), 1
    )
    sample = Sample(full, [0] * ids.shape[1] + [1] * len(answer), "chart-02", vision)
    rows = VisionRows.of(target)
    assert rows.mrope and rows.image_token == target.config.image_token_id
    shard = capture_shard(forward_states(target, [1, 2, 3], 256, 0), [sample], [0], 3, torch.float32, 64, rows)
    fresh = target(torch.tensor([full]), **vision, output_hidden_states=True).hidden_states
    torch.testing.assert_close(shard["aux_hidden"], torch.cat([fresh[i][0] for i in (1, 2, 3)], -1))
    image = shard["image_mask"].bool()
    assert image.sum() == 4 and torch.equal(image, torch.tensor(full) == rows.image_token)
    first = int(image.nonzero()[0])
    # The image's rows share one temporal position; the text after it runs 2 behind its row index (a 2 x 2 grid).
    assert shard["position_ids"][first : first + 4].tolist() == [first] * 4
    assert shard["position_ids"][first + 4 :].tolist() == list(range(first + 2, len(full) - 2))
    assert storage_estimate(10, 64, 3, torch.float32, rows) - storage_estimate(10, 64, 3, torch.float32) == 90
