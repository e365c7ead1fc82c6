"""D-PACE (arXiv 2605.18810) as the DFlash loss's weighting: the weights against a hand computation of the
definition, gradients only through the cross-entropy, the head's loss block by block, and training with it."""

import json

import pytest
import torch

from headstart.heads.losses import dpace_mean, dpace_weights
from headstart.train import eagle as trainer
from tests.block_drafters import block_drafter_run, features, metrics_lines
from tests.heads.test_dflash import dflash_head
from tests.helpers import world_of_one

pytestmark = pytest.mark.usefixtures("one_thread")


def test_weights_are_suffix_sums_of_smoothed_confidence_products():
    # alpha 0.5: q~ = 0.5 + 0.5 q. Block 1: q = .8 .4 .9 -> q~ = .9 .7 .95, reach .9 .63 .5985, and the
    # weights sum the reach from each position on. Block 2: its middle slot is unscored, a factor 1 adding 0.
    confidence = torch.tensor([[0.8, 0.4, 0.9], [0.8, 0.1, 0.9]], requires_grad=True)
    valid = torch.tensor([[True, True, True], [True, False, True]])
    weights = dpace_weights(confidence, valid, 0.5)
    expected = torch.tensor([[0.9 + 0.63 + 0.5985, 0.63 + 0.5985, 0.5985], [0.9 + 0.855, 0.855, 0.855]])
    torch.testing.assert_close(weights, expected)
    assert not weights.requires_grad  # detached
    # alpha 1 ignores the confidence: weights K, K - 1, ..., 1 (every position reached).
    torch.testing.assert_close(dpace_weights(confidence, valid[:1].expand(2, 3), 1.0), torch.tensor([[3.0, 2, 1]] * 2))


def test_gradients_flow_through_the_cross_entropy_only():
    # The confidence is exp(-loss), as in the paper: were the weights not detached, d loss / d x would gain
    # terms through them. With them detached it is exactly w / sum(w).
    x = torch.tensor([0.2, 0.9, 0.1, 1.5, 0.3], requires_grad=True)
    valid = torch.tensor([[True, True, True], [True, True, False]])
    rows = valid.nonzero(as_tuple=True)
    total = dpace_mean(x, torch.exp(-x), rows, valid, 0.5)
    (grad,) = torch.autograd.grad(total, x)
    confidence = torch.zeros(2, 3)
    confidence[rows] = torch.exp(-x.detach())
    weights = dpace_weights(confidence, valid, 0.5)
    torch.testing.assert_close(grad, weights[rows] / weights[rows].sum())
    torch.testing.assert_close(total, (weights[rows] * x).sum() / weights[rows].sum())
    assert dpace_mean(x[:0], x[:0], (rows[0][:0], rows[1][:0]), valid & False, 0.5).item() == 0  # nothing scored


def hand_loss(head, target, batch):
    """The D-PACE loss recomputed block by block through the drafting path (every candidate an anchor)."""
    ids, attention, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    alpha, size = head.config.options.dpace_alpha, head.config.options.block_size
    numerator, denominator = torch.zeros(()), torch.zeros(())
    for b in range(ids.shape[0]):
        n = int(attention[b].sum())
        for a in range(n - 1):
            if not loss_mask[b, a + 1]:
                continue  # an anchor needs a label right after it
            context = head.context_kv(batch["aux_hidden"][b : b + 1, :a], torch.arange(a)[None])
            logp = head.draft_block(ids[b, a], a, context, size - 1).log_softmax(-1)
            target_logits = target.lm_head(batch["last_hidden"][b, a : a + size - 1])
            # Scored on the target's distribution over the draft vocabulary; off it the draft's probability is 0.
            in_vocab = torch.isfinite(logp[0])
            target_p = target_logits.masked_fill(~in_vocab, float("-inf")).softmax(-1)
            reach, scored = 1.0, []
            for k in range(min(size - 1, n - 1 - a)):
                if not loss_mask[b, a + 1 + k]:
                    continue  # unscored: no factor, no weight
                reach *= alpha + (1 - alpha) * float(logp[k, target_logits[k].argmax()].exp())
                scored.append((-(target_p[k] * logp[k])[in_vocab].sum(), reach))
            for j, (ce, _) in enumerate(scored):
                weight = sum(r for _, r in scored[j:])
                numerator, denominator = numerator + weight * ce, denominator + weight
    return numerator / denominator


@pytest.mark.parametrize("draft_vocab_size", [None, 150])
def test_the_heads_dpace_loss_is_the_hand_computed_one(peaked_wide_llama, draft_vocab_size):
    # Over a reduced draft vocabulary (150 ids of 300) the target's greedy token is off it in some slots.
    options = {"loss_weighting": "dpace", "dpace_alpha": 0.3, "draft_vocab_size": draft_vocab_size}
    head = dflash_head(peaked_wide_llama, num_anchors=64, **options)
    if draft_vocab_size:
        head.set_vocab_mapping(torch.arange(300.0) % 7)  # a draft vocabulary that is not a prefix of the ids
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 300, (2, 14), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 11:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0
    loss_mask[0, 8] = 0  # a gap inside blocks: skipped by the weights, not a break in the chain
    aux, last = features(peaked_wide_llama, ids, head.hidden_layers)
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask, "aux_hidden": aux}
    batch["last_hidden"] = last
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(100):  # fit these blocks a little: confidences far from 0 make the weights differ from alpha**k
        optimizer.zero_grad()
        head.loss(batch)[0].backward()
        optimizer.step()
    optimizer.zero_grad()
    loss, metrics = head.loss(batch)
    with torch.no_grad():
        expected = hand_loss(head, peaked_wide_llama, batch)
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    assert sorted(metrics) == sorted([f"acc_{k}" for k in range(4)] + [f"loss_{k}" for k in range(4)])
    head.config.options.loss_weighting = "decay"  # the same blocks and slot losses, weighted otherwise
    decay_loss, decay_metrics = head.loss(batch)
    head.config.options.loss_weighting = "dpace"
    torch.testing.assert_close(metrics, decay_metrics)  # (anchors drawn in another order: sums in another order)
    assert not torch.isclose(loss, decay_loss, rtol=1e-3)
    loss.backward()  # the draft learns, the frozen target does not
    assert head.fc.weight.grad is not None and peaked_wide_llama.lm_head.weight.grad is None


@pytest.mark.parametrize(
    ("options", "message"),
    [({"loss_weighting": "confidence"}, "loss_weighting"), ({"dpace_alpha": 0}, "dpace_alpha must be > 0"),
     ({"dpace_alpha": 1.5}, "dpace_alpha must be <= 1")],
)  # fmt: skip
def test_other_weightings_and_alphas_outside_0_1_are_refused(peaked_wide_llama, options, message):
    with pytest.raises(ValueError, match=message):
        dflash_head(peaked_wide_llama, **options)


def test_training_with_dpace_runs(tiny_target_dir, gsm8k_file, tmp_path, monkeypatch):
    # train/eagle.py as test_dflash runs it (DeepSpeed, a world of one, online capture), with D-PACE.
    world_of_one(monkeypatch)
    path, out = block_drafter_run(
        tmp_path,
        tiny_target_dir,
        gsm8k_file,
        {"type": "dflash", "block_size": 4, "num_anchors": 8, "loss_weighting": "dpace"},
        save_every=4,
    )
    trainer.main(["--config", str(path)])
    heldout = [r for r in metrics_lines(out) if r["split"] == "heldout"]
    assert [r["step"] for r in heldout] == [2, 4] and heldout[1]["loss"] < heldout[0]["loss"]
    head_config = json.loads((out / "head" / "config.json").read_text())
    assert head_config["loss_weighting"] == "dpace" and head_config["dpace_alpha"] == 0.5
