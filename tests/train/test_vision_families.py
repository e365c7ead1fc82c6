"""More vision-language families end to end, each a tiny random target from transformers' config classes
(scripts/dev/tiny_vl.py): capture of the bundled image chats through the family's processor, an EAGLE-3 head fitting
the shards with its own loss, then image prompts decoding token for token as the target does (vanilla, n-gram and
the head), through the one verification core."""

import copy

import pytest
import torch

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.recipes import image_prompt, read_conversations
from headstart.data_recipes.shards import ShardDataset, pad_collate
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.verify import generate
from headstart.heads import build_head
from headstart.scripts.dev.tiny_vl import BUILDERS
from tests.helpers import REPO, adam_losses

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"


# Qwen3-VL: deepstack, interleaved mrope; Gemma-3: a SigLIP tower, text its processor writes around each image
@pytest.mark.parametrize("family", ["qwen3_vl", "gemma3"])
def test_a_family_captures_trains_and_decodes_image_prompts_identically(family, tmp_path, one_thread):
    path = str(BUILDERS[family](tmp_path / "target", 0))
    config = {
        "target": {"path": path, "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(VL_CHAT), "format": "messages", "max_length": 64, "limit": 4},
        "capture": {"out_dir": str(tmp_path / "shards"), "aux_layers": [1, 2, 3], "store_dtype": "fp32"},
    }
    run_capture(config)
    data = ShardDataset(tmp_path / "shards")
    batch = pad_collate([data[i] for i in range(len(data))])
    assert batch["image_mask"].sum() == 4 * 4 and not batch["loss_mask"][batch["image_mask"].bool()].any()

    target, tokenizer, processor = load_model(path, "cpu", "fp32"), load_tokenizer(path), load_processor(path)
    sharp = copy.deepcopy(target)  # a peaked lm_head: a random target's soft labels are near-uniform
    sharp.lm_head.weight.data *= 30
    torch.manual_seed(0)
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3], "ttt_steps": 2}, sharp)
    losses = adam_losses(head, batch, 8)
    assert losses[-1] < 0.9 * losses[0], losses

    head.eval()
    with torch.no_grad():
        for _, messages in read_conversations(str(VL_CHAT), "messages", limit=1):
            ids, vision = image_prompt(processor, tokenizer, messages[:1])
            reference = sharp.generate(ids, **vision, do_sample=False, max_new_tokens=10, pad_token_id=0)
            for proposer in (Vanilla(), NGram(k=3), Eagle(head, top_k=3, depth=3, total_tokens=8)):
                out, _ = generate(sharp, proposer, ids, 10, vision=vision)
                assert torch.equal(out, reference), type(proposer).__name__
