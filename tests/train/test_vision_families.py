"""More vision-language families end to end, each a tiny random target from transformers' config classes
(scripts/dev/tiny_vl.py): capture of the bundled image chats through the family's processor, an EAGLE-3 head fitting
the shards with its own loss, then image prompts decoding token for token as the target does (vanilla, n-gram and
the head), through the one verification core."""

import copy

import pytest
import torch

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.errors import DataError
from headstart.data_recipes.recipes import image_prompt, load_samples, read_conversations
from headstart.data_recipes.shards import ShardDataset, pad_collate
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_heads import Eagle
from headstart.decoding.verify import generate
from headstart.heads import build_head
from headstart.scripts.dev.tiny_vl import BUILDERS
from tests.helpers import REPO

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"


@pytest.mark.parametrize("family", ["qwen3_vl"])
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
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(8):
        loss, _ = head.loss(batch)
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < 0.9 * losses[0], losses

    head.eval()
    with torch.no_grad():
        for _, messages in read_conversations(str(VL_CHAT), "messages", limit=1):
            ids, vision = image_prompt(processor, tokenizer, messages[:1])
            reference = sharp.generate(ids, **vision, do_sample=False, max_new_tokens=10, pad_token_id=0)
            for proposer in (Vanilla(), NGram(k=3), Eagle(head, top_k=3, depth=3, total_tokens=8)):
                out, _ = generate(sharp, proposer, ids, 10, vision=vision)
                assert torch.equal(out, reference), type(proposer).__name__


@torch.no_grad()
def test_gemma3_with_its_vision_tower_decodes_identically_and_says_why_it_captures_nothing(tmp_path, one_thread):
    """Gemma-3's image prompts decode as the target does (its image rows attending both ways in the prefill), but
    its processor writes text around each image that the chat template does not (``\\n\\n`` on both sides, the end
    marker), so capture refuses the record, and the EAGLE heads refuse the multimodal checkpoint by name."""
    path = str(BUILDERS["gemma3"](tmp_path / "target", 0))
    target, tokenizer, processor = load_model(path, "cpu", "fp32"), load_tokenizer(path), load_processor(path)
    (_, messages), *_ = read_conversations(str(VL_CHAT), "messages", limit=1)
    ids, vision = image_prompt(processor, tokenizer, messages[:1])
    assert (ids == target.config.image_token_id).sum() == 4 and vision["token_type_ids"].sum() == 4
    reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=10, pad_token_id=0)
    assert not torch.equal(target.generate(ids, do_sample=False, max_new_tokens=10, pad_token_id=0), reference)
    for proposer in (Vanilla(), NGram(k=3)):
        out, _ = generate(target, proposer, ids, 10, vision=vision)
        assert torch.equal(out, reference), type(proposer).__name__
    with pytest.raises(DataError, match="chat.jsonl:1: the processor wrote no image placeholders where the template"):
        load_samples(str(VL_CHAT), "messages", tokenizer, 96, processor=processor, limit=1)
    with pytest.raises(NotImplementedError, match="multimodal Gemma-3 checkpoint"):
        build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, target)
