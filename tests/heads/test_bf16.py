"""Every drafter in bf16, as a GPU runs it (eval --dtype bf16, DeepSpeed's bf16 training casts the whole head): the
loss and its gradients are finite, and greedy drafting through the bf16 target gives the bf16 target's own greedy
output. The CPU computes bf16 too, so a dtype mixed up inside a head fails here, not first on a lent GPU (DSpark's
confidence head once met fp32 inputs there)."""

import pytest
import torch

from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.methods import proposer_for
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import generate
from headstart.heads import build_head
from tests.block_drafters import block_batch, prompts
from tests.helpers import LAYER_IDS, WIDE, greedy_reference, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED = {"layer_ids": LAYER_IDS}
BLOCK = FUSED | {"num_layers": 2, "block_size": 4}
HEADS = {
    "eagle": {"type": "eagle"},
    "eagle3": {"type": "eagle3", **FUSED, "draft_vocab_size": 200},
    "eagle3.1": {"type": "eagle3", **FUSED, "fc_norm": True, "norm_output": True, "norm_before_fc": True},
    "peagle": {"type": "eagle3", **FUSED, "parallel_drafting": True},
    "medusa": {"type": "medusa", "num_heads": 3},
    "dflash": {"type": "dflash", **BLOCK, "draft_vocab_size": 200},
    "dflash-dpace": {"type": "dflash", **BLOCK, "loss_weighting": "dpace"},
    "dspark": {"type": "dspark", **BLOCK, "markov_rank": 16},
    "dflash2": {"type": "dflash2", **BLOCK, "selector_rank": 16, "selector_top_k": 4},
    "domino": {"type": "domino", **BLOCK, "gru_hidden_dim": 16, "emb_dim": 8},
}
CHOICES = [[0], [1], [0, 0], [0, 0, 0]]  # a branch and a chain of 3: within every head's drafted depth


@pytest.fixture(scope="module")
def bf16_target():
    model = tiny_llama(**WIDE)
    model.lm_head.weight.data *= 20  # peaked, as test_dflash's: drafts get accepted, so accepted paths are walked
    return model.requires_grad_(False).to(torch.bfloat16)


def bf16_head(target, settings: dict):
    torch.manual_seed(2)
    head = build_head(settings, target)
    with torch.no_grad():
        for p in head.parameters():  # every weight away from its init (zeroed biases, identity kernels, unit norms)
            p.add_(torch.randn_like(p) * 0.05)
    return head.to(torch.bfloat16)


@pytest.mark.parametrize("name", HEADS)
def test_a_bf16_head_trains_and_decodes_as_the_bf16_target(bf16_target, name):
    head = bf16_head(bf16_target, HEADS[name])
    assert all(p.dtype == torch.bfloat16 for p in head.parameters())
    loss, metrics = head.loss(block_batch(bf16_target, head))  # the states from the bf16 target
    loss.backward()
    assert torch.isfinite(loss) and loss > 0, name
    assert all(torch.isfinite(v).all() for v in metrics.values()), name
    grads = [p.grad for p in head.parameters() if p.requires_grad]
    assert any(g is not None and g.abs().sum() > 0 for g in grads)
    assert all(g is None or (g.dtype == torch.bfloat16 and torch.isfinite(g).all()) for g in grads)
    head.eval()
    for prompt in prompts():
        drafter = head_proposer(head.config)
        proposer = proposer_for(head, TreeSpec.static(CHOICES)) if drafter.tunable else drafter(head, CHOICES)
        out, _ = generate(bf16_target, proposer, prompt, 12, eos_token_id=bf16_target.config.eos_token_id)
        assert torch.equal(out, greedy_reference(bf16_target, prompt, 12)), (name, prompt.tolist())
