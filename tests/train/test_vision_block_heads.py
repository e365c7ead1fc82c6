"""The DFlash family on a vision-language target's capture: a tiny Qwen2.5-VL's (mrope) shards of the bundled image
chats, a DFlash and a DFlash-2 head fitting them with their own losses (the image rows context only, the rotary
positions the capture's), then decoding image prompts token for token as the target does."""

import copy

import pytest
import torch

from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.recipes import image_prompt, read_conversations
from headstart.data_recipes.shards import ShardDataset, pad_collate
from headstart.decoding.proposers_heads import head_drafter
from headstart.decoding.verify import generate
from headstart.heads import build_head
from tests.helpers import REPO, adam_losses

VL_CHAT = REPO / "assets" / "data" / "vl" / "chat.jsonl"
STEPS = 12


@pytest.fixture(scope="module")
def vl_batch(tiny_qwen_vl_dir, tmp_path_factory):
    """Every sample of a tiny Qwen2.5-VL's capture of 8 image chats, as one padded batch."""
    out = tmp_path_factory.mktemp("vl-shards")
    torch.set_num_threads(1)
    run_capture(
        {
            "target": {"path": str(tiny_qwen_vl_dir), "device": "cpu", "dtype": "fp32"},
            "data": {"source": str(VL_CHAT), "format": "messages", "max_length": 64, "limit": 8},
            "capture": {"out_dir": str(out), "aux_layers": [1, 2, 3], "store_dtype": "fp32"},
        }
    )
    data = ShardDataset(out)
    return pad_collate([data[i] for i in range(len(data))])


@pytest.mark.parametrize("head_type", ["dflash", "dflash2"])
def test_a_block_head_fits_image_shards_and_decodes_image_prompts_losslessly(
    head_type, tiny_qwen_vl, vl_batch, one_thread
):
    target, tokenizer, processor = tiny_qwen_vl
    target = copy.deepcopy(target)  # its lm_head peaked: a random target's soft labels are near-uniform, nothing
    target.lm_head.weight.data *= 30  # to learn (the capture's states are before the lm_head: the same)
    images = vl_batch["image_mask"].bool()
    assert images.sum() == 8 * 4 and not vl_batch["loss_mask"][images].any()  # 4 rows an image, never labels
    # The capture's positions: an image's rows share one, the text after it 2 behind its row index.
    assert (vl_batch["position_ids"][:, -1] < vl_batch["attention_mask"].sum(1) - 1).all()
    torch.manual_seed(0)
    head = build_head({"type": head_type, "layer_ids": [1, 2, 3], "block_size": 4, "num_anchors": 16}, target)
    losses = adam_losses(head, vl_batch, STEPS)
    assert losses[-1] < 0.8 * losses[0], losses
    head.eval()
    with torch.no_grad():
        for _, messages in read_conversations(str(VL_CHAT), "messages", limit=1):
            ids, vision = image_prompt(processor, tokenizer, messages[:1])
            reference = target.generate(ids, **vision, do_sample=False, max_new_tokens=10, pad_token_id=0)
            out, _ = generate(target, head_drafter(head), ids, 10, vision=vision)
            assert torch.equal(out, reference)
