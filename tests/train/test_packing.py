"""Packed rows (``train.pack``): a micro-batch's samples end to end in one row, with no padding, train every head
exactly as the same samples padded into a batch: each sample attends, is positioned and is scored within itself."""

import pytest
import torch
from safetensors.torch import load_file

import headstart.core.memory as memory
from headstart.core.config_files import ConfigError, load_config
from headstart.data_recipes.shards import pack_collate, pad_collate
from headstart.heads import build_head
from headstart.heads.sparse_attention import ttt_attention
from headstart.train import eagle
from headstart.train.train_config import resolve_config
from tests.heads.test_long_sequences import HEADS, loss_and_grads
from tests.helpers import make_batch, records, run_here

pytestmark = pytest.mark.usefixtures("one_thread")


LENGTHS = (9, 14, 6)
EVERY_HEAD = HEADS | {"eagle": {"type": "eagle"}, "medusa": {"type": "medusa", "num_heads": 3}}


def samples(target):
    """Three samples of different lengths, each with its own hidden states (a causal target's states of a row's
    first n tokens are those of the n tokens alone) and prompt tokens out of the loss."""
    batch = make_batch(target, batch=len(LENGTHS), seq=max(LENGTHS), seed=5)
    out = []
    for i, n in enumerate(LENGTHS):
        sample = {key: batch[key][i, :n] for key in ("input_ids", "loss_mask", "last_hidden", "aux_hidden")}
        sample["loss_mask"] = sample["loss_mask"].long()
        sample["loss_mask"][: i + 1] = 0
        out.append(sample | {"sample_id": torch.tensor(i)})
    return out


def test_a_packed_row_holds_the_samples_end_to_end_each_from_position_zero(peaked_tiny_llama):
    batch = pack_collate(samples(peaked_tiny_llama))
    assert batch["input_ids"].shape == (1, sum(LENGTHS)) and batch["aux_hidden"].shape[:2] == (1, sum(LENGTHS))
    assert batch["position_ids"][0].tolist() == [*range(9), *range(14), *range(6)]
    assert batch["segment_ids"][0].tolist() == [0] * 9 + [1] * 14 + [2] * 6
    assert batch["sample_id"].tolist() == [0, 1, 2] and bool(batch["attention_mask"].all())
    padded = pad_collate(samples(peaked_tiny_llama))
    assert torch.equal(batch["input_ids"][0], padded["input_ids"][padded["attention_mask"].bool()])


# EAGLE-1 and Medusa score the whole row at once: no chunked path to run them on.
CASES = [(name, False) for name in sorted(EVERY_HEAD)] + [(name, True) for name in sorted(HEADS)]


@pytest.mark.parametrize(("name", "chunks"), CASES, ids=[f"{n}-{'chunks' if c else 'whole'}" for n, c in CASES])
def test_every_head_trains_on_a_packed_row_as_on_the_samples_padded(peaked_tiny_llama, name, chunks, monkeypatch):
    torch.manual_seed(3)
    options = EVERY_HEAD[name] | ({"num_anchors": 64} if "block_size" in EVERY_HEAD[name] else {})
    head = build_head(options, peaked_tiny_llama)  # num_anchors past every row: each run drafts from every candidate
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    if chunks:  # the sparse attention and the losses' logits in many chunks, the steps recomputed
        monkeypatch.setattr(memory, "SCORE_BUDGET", 2000)
        head.checkpoint_steps = True
    padded_loss, padded_metrics, padded_grads = loss_and_grads(head, pad_collate(samples(peaked_tiny_llama)))
    packed_loss, packed_metrics, packed_grads = loss_and_grads(head, pack_collate(samples(peaked_tiny_llama)))
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-6)
    for key, value in padded_metrics.items():
        torch.testing.assert_close(packed_metrics[key], value, rtol=1e-5, atol=1e-6, msg=key)
    assert padded_grads and packed_grads.keys() == padded_grads.keys()
    for key, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_a_packed_row_without_its_sample_boundaries_trains_differently(peaked_tiny_llama):
    # The test above would pass for a head that ignored segment_ids only if nothing crossed samples: it does.
    head = build_head(HEADS["eagle3"], peaked_tiny_llama)
    batch = pack_collate(samples(peaked_tiny_llama))
    torch.manual_seed(0)
    with_boundaries = head.loss(batch)[0]
    del batch["segment_ids"], batch["position_ids"]
    assert not torch.allclose(head.loss(batch)[0], with_boundaries)


def test_training_from_shards_packed_trains_the_head_padding_trains(make_config, monkeypatch):
    # EAGLE-3's loss and gradients are the same packed or padded (above): so are three AdamW steps of real training,
    # two samples a micro-batch, with held-out evaluation.
    heads, losses = {}, {}
    for pack in (False, True):
        config, out = make_config("eagle3", name=f"pack-{pack}", max_steps=3, eval_every=3, pack=pack)
        run_here(monkeypatch, eagle, config)
        heads[pack], losses[pack] = load_file(str(out / "head" / "model.safetensors")), records(out)
    assert [r["step"] for r in losses[True]] == [1, 2, 3]
    for a, b in zip(losses[False], losses[True], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    for key, tensor in heads[False].items():
        torch.testing.assert_close(heads[True][key], tensor, rtol=1e-3, atol=1e-5, msg=key)


def test_packing_with_the_targets_forward_in_the_step_is_refused_naming_why(make_config):
    config, _ = make_config("eagle3", pack=True, online_capture=True)
    with pytest.raises(
        ConfigError, match="train.pack lays a micro-batch's samples end to end in one row, and the target"
    ):
        resolve_config(load_config(config), "eagle")


@pytest.mark.parametrize("budget", [None, 300], ids=["dense-mask", "chunks"])
def test_ttt_attention_keeps_each_sample_of_packed_rows_to_itself(budget):
    # Two packed rows with different boundaries, each sample's scores dense or in chunks: they equal each sample
    # attended on its own, in values and gradients.
    torch.manual_seed(0)
    segments = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    keys = [torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3)]
    values = [torch.randn(2, 2, 16, 8, requires_grad=True) for _ in range(3)]
    packed = ttt_attention(q, keys, values, budget=budget, segments=segments)
    alone = torch.zeros_like(packed)
    for row in range(2):
        for sample in segments[row].unique():
            at = (segments[row] == sample).nonzero()[:, 0]
            part = [t[row : row + 1, :, at] for t in (q, *keys, *values)]
            alone[row : row + 1, :, at] = ttt_attention(part[0], part[1:4], part[4:])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(packed)
    grads = torch.autograd.grad((packed * weights).sum(), [q, *keys, *values])
    for got, want in zip(grads, torch.autograd.grad((alone * weights).sum(), [q, *keys, *values]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    one_row = ttt_attention(q[:1], [k[:1] for k in keys], [v[:1] for v in values], budget, segments[:1])
    torch.testing.assert_close(one_row, alone[:1], rtol=1e-5, atol=1e-6)  # one row alone: the same
