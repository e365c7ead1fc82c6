"""Each head's training loss fits one fixed batch (2 x 16 tokens) within 100-150 Adam steps (about 1-2 s each)."""

import pytest
import torch

from headstart.heads import build_head
from tests.helpers import LAYER_IDS, make_batch, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def sharp_target():
    """A random target whose next-token distributions are peaked (a fresh tiny Llama's are near uniform,
    leaving no argmax to learn)."""
    target = tiny_llama()
    target.lm_head.weight.data *= 30
    return target


def fit(head, batch, steps, lr):
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    first = None
    for _ in range(steps):
        loss, metrics = head.loss(batch)
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        loss, metrics = head.loss(batch)
    return first, loss.item(), metrics


def test_eagle_overfits_a_batch():
    target = sharp_target()
    batch = make_batch(target)
    batch["loss_mask"][:, :4] = 0  # prompt tokens: not labels
    first, last, metrics = fit(build_head({"type": "eagle"}, target), batch, steps=150, lr=3e-3)
    # ploss cannot fall below the target's entropy (~2.2 here), so judge the feature regression.
    assert metrics["acc"] > 0.9 and metrics["vloss"] < 0.05, metrics
    assert last < 0.3 * first


def test_eagle3_overfits_a_batch():
    target = sharp_target()
    batch = make_batch(target)
    head = build_head({"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 3}, target)
    first, last, metrics = fit(head, batch, steps=150, lr=3e-3)
    assert metrics["acc_0"] > 0.9 and metrics["acc_2"] > 0.5, metrics
    assert last < 0.5 * first


def test_medusa_overfits_a_batch():
    target = sharp_target()
    batch = make_batch(target)
    first, last, metrics = fit(build_head({"type": "medusa", "num_heads": 2}, target), batch, steps=100, lr=1e-2)
    assert metrics["acc_0"] > 0.9 and metrics["acc_1"] > 0.9, metrics
    assert last < 0.2 * first


def test_peagle_overfits_a_batch_and_learns_its_mask_slots():
    target = sharp_target()
    batch = make_batch(target)
    head = build_head({"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 3, "parallel_drafting": {}}, target)
    start = head.mask_hidden.detach().clone()
    first, last, metrics = fit(head, batch, steps=150, lr=3e-3)
    assert metrics["acc_0"] > 0.9 and metrics["acc_2"] > 0.5, metrics
    assert last < 0.5 * first
    assert (head.mask_hidden - start).abs().max() > 0.05  # the mask slots' learned input trains with the rest
