"""Decoding image prompts through the one verification core: the target reads the images in its prefill, the steps
are text, and the output is the target's own greedy output (vanilla, n-gram and an EAGLE-3 head)."""

import pytest
import torch

from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.core.vision import rope_positions
from headstart.data_recipes.recipes import image_prompt, read_conversations
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.proposers_eagle import Eagle
from headstart.decoding.tree import empty_tree
from headstart.decoding.verify import (
    BatchDecoding,
    DecodeState,
    Sampling,
    generate,
    generate_batch,
    prompt_vision,
    verify_batch,
)
from headstart.heads import KVCache, build_head
from tests.helpers import REPO, one_image_prompt

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


# ---- Qwen2.5-VL: 3-D rotary positions (mrope), a text row past an image at its index less what the image's grid saved


@torch.no_grad()
def test_an_mrope_targets_steps_sit_where_its_own_forward_puts_them(tiny_qwen_vl, one_thread):
    target, _, processor = tiny_qwen_vl
    ids, vision = one_image_prompt(processor, "chart-01.png", "Which bar is the tallest?")
    positions, shift = rope_positions(target, ids, vision)
    first = int((vision["mm_token_type_ids"][0] == 1).nonzero()[0])
    # A 56-pixel image: 4 x 4 patches merged 2 x 2, its 4 rows at one temporal position; text goes on 2 further.
    assert shift == -2 and positions[first : first + 4].tolist() == [first] * 4
    assert positions[first + 4] == first + 2 and positions[-1] == len(positions) - 1 + shift
    whole = target(ids, **vision).logits[0, -1]
    for step_shift, close in ((shift, True), (0, False)):
        decoding = BatchDecoding(
            target, [DecodeState(Vanilla(), ids[0], ids.shape[1])], 4, Sampling(), None, None, vision
        )
        assert decoding.position_shift == shift
        root = ids[0, -1:]
        verdict = verify_batch(
            target, decoding.cache, decoding.valid, root, [empty_tree(root.device)], Sampling(), (), step_shift
        )
        assert torch.allclose(verdict.verdicts[0].logits[0], whole, atol=1e-5) == close


@torch.no_grad()
def test_image_prompts_of_an_mrope_target_decode_to_its_own_greedy_output(tiny_qwen_vl, one_thread):
    target, _, processor = tiny_qwen_vl
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, target)
    for name, question in (("shape-02.png", "What shape is it?"), ("text-05.png", "What word is written?")):
        ids, vision = one_image_prompt(processor, name, question)
        reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=12, pad_token_id=0)
        for proposer in (Vanilla(), NGram(k=3), Eagle(head, top_k=3, depth=3, total_tokens=8)):
            out, _ = generate(target, proposer, ids, 12, vision=vision)
            assert torch.equal(out, reference), type(proposer).__name__


@torch.no_grad()
def test_an_mrope_targets_draft_reads_the_prompt_where_its_shards_put_it(tiny_qwen_vl, one_thread):
    """The draft's positions as vLLM hands them (the temporal row) and as capture stores them (``position_ids``):
    the proposer's first draft equals the head's forward at the shard's positions, not at the rows' indices."""
    target, _, processor = tiny_qwen_vl
    head = build_head({"type": "eagle3", "layer_ids": [1, 2, 3]}, target)
    ids, vision = one_image_prompt(processor, "chart-01.png", "Which bar is the tallest?")
    stored, shift = rope_positions(target, ids, vision)  # what capture writes as the shard's position_ids
    proposer = Eagle(head, top_k=1, depth=1, total_tokens=1)
    BatchDecoding(target, [DecodeState(proposer, ids[0], ids.shape[1])], 4, Sampling(), None, None, vision)
    assert proposer.positions.rows(0, ids.shape[1] + 2, ids.device).tolist() == stored.tolist() + [
        ids.shape[1] + shift,
        ids.shape[1] + 1 + shift,
    ]
    states = target(ids[:, :-1], **prompt_vision(target, [ids[0]], vision)[0], output_hidden_states=True)
    hidden = torch.cat([states.hidden_states[i] for i in head.hidden_layers], -1)
    features = head.first_features(hidden)
    for positions, same in ((stored[:-1], True), (torch.arange(ids.shape[1] - 1), False)):
        logp, _ = head.draft_step(ids[:, 1:], features, positions[None], KVCache())
        assert torch.allclose(logp[0, -1], proposer.root[0], atol=1e-5) == same
