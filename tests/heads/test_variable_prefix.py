"""``head.loss: variable_prefix`` (D2SD's VP-Drafter training, arXiv 2606.04446) for the block drafters: blocks
that show a prefix of real tokens, drawn from the truncated geometric prior, scored after it."""

import pytest
import torch

from headstart.heads import build_head
from headstart.heads.block_training import MIN_PREFIX, PREFIX_PRIOR_BASE
from tests.block_drafters import block_batch
from tests.heads.test_dflash import dflash_head
from tests.helpers import chi_square_critical

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = [1, 3, 4]


def test_prefix_lengths_follow_the_truncated_geometric_prior_in_training_only(peaked_wide_llama):
    head = dflash_head(peaked_wide_llama, block_size=6, loss="variable_prefix")  # 5 drafting slots: l in 2..5
    anchors = torch.zeros(40, 100, dtype=torch.long)
    torch.manual_seed(0)
    counts = torch.bincount(head.train().shown_prefix(anchors, 5).flatten(), minlength=6)[MIN_PREFIX:].double()
    prior = PREFIX_PRIOR_BASE ** torch.arange(MIN_PREFIX, 6, dtype=torch.double)
    expected = prior / prior.sum() * anchors.numel()
    assert counts.sum() == anchors.numel()
    assert ((counts - expected) ** 2 / expected).sum() < chi_square_critical(len(counts) - 1)
    assert head.eval().shown_prefix(anchors, 5).eq(1).all()  # held out: the anchor alone, as served
    assert dflash_head(peaked_wide_llama).train().shown_prefix(anchors, 5).eq(1).all()  # the plain loss


def test_a_block_shows_its_prefix_and_is_scored_after_it_as_a_served_block_would_be(peaked_wide_llama):
    head = dflash_head(peaked_wide_llama, loss="variable_prefix", num_anchors=6).train()
    batch = block_batch(peaked_wide_llama, head, gap=False)
    torch.manual_seed(4)
    with torch.no_grad():
        states = head.block_states(batch)
    anchors = states.label_at[..., 0] - 1  # DFlash: slot 1 drafts the token after the anchor
    prefix = states.label_at[..., 0] - anchors - states.step[..., 0]
    assert (
        prefix.min() >= MIN_PREFIX
        and prefix.max() <= head.config.options.block_size - 1
        and prefix.unique().numel() > 1
    )
    assert torch.equal(states.labelled & (states.step < 0), torch.zeros_like(states.labelled))  # shown: not scored
    ids, size, checked = batch["input_ids"], head.config.options.block_size, 0
    for b in range(len(ids)):
        for n in range(anchors.shape[1]):
            a, shown = anchors[b, n].item(), prefix[b, n].item()
            if a + size > int(batch["attention_mask"][b].sum()):
                continue  # a block reaching past the sample: its tail is masked, not shown
            # The served block after an accepted prefix: those tokens, then masks, over the context before a.
            block = torch.cat((ids[b, a : a + shown], torch.full((size - shown,), head.mask_token_id)))
            with torch.no_grad():
                context = head.context_kv(batch["aux_hidden"][b : b + 1, :a], torch.arange(a)[None])
                alone = head(block[None], torch.arange(a, a + size)[None], context)[0, 1:]
            torch.testing.assert_close(states.hidden[b, n], alone, atol=1e-4, rtol=1e-4)
            checked += 1
    assert checked >= 4


SETTINGS = {
    "dflash": {"type": "dflash", "block_size": 5, "num_layers": 1},
    "dspark": {"type": "dspark", "block_size": 4, "markov_rank": 8},
    "dflash2": {"type": "dflash2", "block_size": 5, "selector_rank": 8, "selector_top_k": 4},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_variable_prefix_training_lowers_the_served_blocks_loss(peaked_wide_llama, name):
    torch.manual_seed(1)
    head = build_head(
        SETTINGS[name] | {"layer_ids": LAYERS, "num_anchors": 16, "loss": "variable_prefix"}, peaked_wide_llama
    )
    batch = block_batch(peaked_wide_llama, head, gap=False)
    with torch.no_grad():
        before, _ = head.eval().loss(batch)  # the anchor-only blocks serving drafts
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    head.train()
    for _ in range(20):
        optimizer.zero_grad()
        loss, metrics = head.loss(batch)
        loss.backward()
        optimizer.step()
    assert all(torch.isfinite(v) for v in metrics.values())
    with torch.no_grad():
        after, _ = head.eval().loss(batch)
    assert after < 0.8 * before
