"""Decoding image prompts through the one verification core: the target reads the images in its prefill, the steps
are text, and the output is the target's own greedy output (vanilla, n-gram and an EAGLE-3 head)."""

import pytest
import torch

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.data_recipes.recipes import image_prompt, read_conversations
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_heads import Eagle
from headstart.decoding.verify import generate, generate_batch
from headstart.heads import build_head
from tests.helpers import REPO

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"


@pytest.fixture(scope="module")
def llava(tiny_llava_dir):
    path = str(tiny_llava_dir)
    return load_model(path, "cpu", "fp32"), load_tokenizer(path), load_processor(path)


def prompts(tokenizer, processor, count=3):
    """The bundled questions with their images, asked without their answers."""
    conversations = read_conversations(str(VL_CHAT), "messages", limit=count)
    return [image_prompt(processor, tokenizer, messages[:1]) for _, messages in conversations]


def proposers(target):
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3], "draft_vocab_size": 200}, target)
    for p in head.parameters():  # random weights: drafts mostly rejected, the rollback paths run
        p.data.normal_(0, 0.1)
    return {"vanilla": Vanilla(), "ngram": NGram(k=3), "eagle3": Eagle(head, top_k=3, depth=3, total_tokens=8)}


@torch.no_grad()
def test_image_prompts_decode_to_the_targets_own_greedy_output(llava, one_thread):
    target, tokenizer, processor = llava
    for ids, vision in prompts(tokenizer, processor):
        assert (ids == processor.image_token_id).sum() == 4
        reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=12, pad_token_id=0)
        # Without the image the target says something else: the prefill must have read it.
        blind = target.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert not torch.equal(blind, reference)
        for name, proposer in proposers(target).items():
            out, stats = generate(target, proposer, ids, 12, vision=vision)
            assert torch.equal(out, reference), name
            assert sum(stats.accepted_lengths) >= 12  # the last step may commit past the budget (cut)


def test_a_prompt_with_images_decodes_alone(llava):
    target, tokenizer, processor = llava
    (ids, vision), (other, _) = prompts(tokenizer, processor, count=2)
    with pytest.raises(ValueError, match="a prompt with images decodes alone, not in a batch of 2"):
        generate_batch(target, [Vanilla(), Vanilla()], [ids, other], 4, vision=vision)
