"""An EAGLE-3 head for a vision-language target, end to end: capture with the images, a few training steps on
the shards (the draft text-only, image rows context only), then decoding image prompts with it, token for token
the target's own greedy output."""

import json

import pytest
import torch

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.recipes import image_prompt, read_conversations
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import generate
from headstart.heads import load_head
from headstart.train import eagle
from tests.helpers import REPO, head_weights, records, run_here

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"


@pytest.mark.slow  # capture, DeepSpeed training and decoding in one: 30 s on idle cores, minutes on shared ones
@pytest.mark.parametrize("family", ["tiny_llava_dir", "tiny_qwen_vl_dir"])  # Qwen2.5-VL: mrope, its processor
def test_a_head_trained_on_image_shards_decodes_image_prompts_losslessly(family, request, tmp_path, monkeypatch):
    torch.set_num_threads(1)  # tiny matmuls (the one_thread fixture's setting, for the recipe run here too)
    target_dir = request.getfixturevalue(family)
    config = {
        "target": {"path": str(target_dir), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(VL_CHAT), "format": "messages", "max_length": 64, "limit": 12},
        "capture": {"out_dir": str(tmp_path / "shards"), "aux_layers": [1, 2, 3], "store_dtype": "fp32"},
        "head": {"type": "eagle3", "ttt_steps": 2},
        "train": {
            "out_dir": str(tmp_path / "run"),
            "seed": 3,
            "batch_size": 4,
            "micro_batch_size": 2,
            "max_steps": 4,
            "lr": 1e-2,
            "warmup_steps": 1,
            "heldout_samples": 4,
            "eval_every": 2,
        },
    }
    run_capture({key: config[key] for key in ("target", "data", "capture")})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    run_here(monkeypatch, eagle, path)
    steps = [row for row in records(tmp_path / "run") if "loss" in row]
    assert len(steps) == 4 and all(torch.isfinite(torch.tensor(row["loss"])) for row in steps)
    assert head_weights(tmp_path / "run")  # a head was saved, from the trained weights

    target, tokenizer = load_model(str(target_dir), "cpu", "fp32"), load_tokenizer(str(target_dir))
    processor = load_processor(str(target_dir))
    head = load_head(tmp_path / "run" / "head", target, tokenizer)
    text_family = {"tiny_llava_dir": "llama", "tiny_qwen_vl_dir": "qwen2_5_vl_text"}[family]
    assert head.config.arch.family == text_family and head.config.target_hidden_size == 64  # the text model's
    with torch.no_grad():
        for _, messages in read_conversations(str(VL_CHAT), "messages", limit=2):
            ids, vision = image_prompt(processor, tokenizer, messages[:1])
            reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=10, pad_token_id=0)
            out, _ = generate(target, Eagle(head, top_k=3, depth=3, total_tokens=8), ids, 10, vision=vision)
            assert torch.equal(out, reference)
