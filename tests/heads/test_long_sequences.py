"""Long-sequence training: the sparse training-time-test attention and the chunked block attention equal their
dense-mask forms in values and gradients; every head's loss and gradients are the same computed whole or in
chunks (recomputed in backward), with the steps' activations kept or recomputed; 20 training steps on the new path
follow the dense path's losses."""

import pytest
import torch
import torch.nn.functional as F

import headstart.core.memory as memory
from headstart.heads import build_head
from headstart.heads.layers import StepKVCache
from headstart.heads.sparse_attention import block_attention, query_chunk, ttt_attention, ttt_step_mask
from tests.helpers import LAYER_IDS, make_batch, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")
HEADS = {
    "eagle3": {"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 4, "draft_vocab_size": 120},
    "peagle": {"type": "eagle3", "layer_ids": LAYER_IDS, "ttt_steps": 3, "parallel_drafting": True},
    "dflash": {"type": "dflash", "layer_ids": LAYER_IDS, "block_size": 4, "num_anchors": 8, "draft_vocab_size": 120},
    "dflash-dpace": {"type": "dflash", "layer_ids": LAYER_IDS, "block_size": 3, "loss_weighting": "dpace"},
    "dspark": {"type": "dspark", "layer_ids": LAYER_IDS, "block_size": 3, "markov_rank": 8},
    "dflash2": {"type": "dflash2", "layer_ids": LAYER_IDS, "block_size": 4, "selector_rank": 8, "selector_top_k": 4},
}


def dense_step_attention(self, q, k, v):
    """StepKVCache.attend as it was: one SDPA over every step's keys with ``ttt_step_mask``, the reference."""
    self.keys.append(k)
    self.values.append(v)
    mask = ttt_step_mask(q.shape[2], len(self.keys) - 1, q.device)
    keys, values = torch.cat(self.keys, 2), torch.cat(self.values, 2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("budget", [None, 8000, 300], ids=["dense", "one-chunk", "chunks"])
def test_ttt_attention_equals_the_dense_mask_in_values_and_gradients(budget):
    gen = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, seq, dim = 2, 6, 2, 23, 8
    for step in range(4):
        q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=torch.float64).requires_grad_()
        keys = [torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(step + 1)]
        values = [torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=torch.float64) for _ in range(step + 1)]
        for t in keys + values:
            t.requires_grad_()
        mask = ttt_step_mask(seq, step)
        dense = F.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
        )
        sparse_out = ttt_attention(q, keys, values, budget=budget)
        torch.testing.assert_close(sparse_out, dense, rtol=1e-12, atol=1e-12)
        weights = torch.randn(dense.shape, generator=gen, dtype=torch.float64)
        inputs = [q, *keys, *values]
        for mine, theirs in zip(
            torch.autograd.grad((sparse_out * weights).sum(), inputs),
            torch.autograd.grad((dense * weights).sum(), inputs),
        ):
            torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_ttt_attention_equals_the_exact_path_in_values_and_gradients(dtype):
    # train.attention: fused. The causal part by the fused kernel (its log-sum-exp's gradient attached by a second
    # pass), the diagonal keys merged by log-sum-exp; packed rows sample by sample as the exact path.
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, seq, dim = 2, 6, 2, 29, 8
    tolerance = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    segments = torch.tensor([[0] * 12 + [1] * 17, [0] * 29])
    for step in range(4):
        q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=dtype).requires_grad_()
        keys = [torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype) for _ in range(step + 1)]
        values = [torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=dtype) for _ in range(step + 1)]
        inputs = [q, *keys, *values]
        for t in inputs:
            t.requires_grad_()
        weights = torch.randn(q.shape, generator=gen, dtype=dtype)
        for packed in (None, segments):
            exact = ttt_attention(q, keys, values, budget=300, segments=packed)
            fused = ttt_attention(q, keys, values, segments=packed, fused=True)
            torch.testing.assert_close(fused, exact, **tolerance)
            for mine, theirs in zip(
                torch.autograd.grad((fused * weights).sum(), inputs),
                torch.autograd.grad((exact * weights).sum(), inputs),
                strict=True,
            ):
                torch.testing.assert_close(mine, theirs, **tolerance)


def test_a_gpu_takes_chunks_sixteen_times_a_cpus_and_the_estimate_counts_them():
    # 1,024 queries x 1,031 keys x 32 heads: a CPU's 2^24 scores take 508 queries a chunk, a GPU's 2^28 all of them
    # (a GPU launching kernels for small chunks trains several times slower: docs/BENCHMARKS.md).
    cpu, gpu = torch.device("cpu"), torch.device("cuda")  # only the type is read: no GPU needed
    assert memory.score_budget(cpu) == 1 << 24 and memory.score_budget(gpu) == 1 << 28
    assert query_chunk(1024, 1031, 32, cpu) == 508 and query_chunk(1024, 1031, 32, gpu) == 1024
    assert query_chunk(1024, 1031, 32, gpu, budget=1031 * 32) == 1  # an explicit budget wins, at least one query
    config = tiny_llama().config
    estimate = {d: memory.head_activations(config, 4096, 3, 7, 256, torch.float32, device=d) for d in (cpu, gpu)}
    assert (
        4096 * (config.vocab_size + 256) < 1 << 24
    )  # the logits' chunk is their whole on both: only attention's grows
    assert estimate[gpu] - estimate[cpu] == 3 * 4 * ((1 << 28) - (1 << 24))  # fp32 scores, softmax and gradient


def test_chunked_block_attention_equals_one_chunk_in_values_and_gradients(monkeypatch):
    # test_dflash checks one chunk against the dense mask; here many chunks of blocks against one.
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, blocks, size, ctx, dim = 2, 4, 2, 6, 3, 11, 8
    q = torch.randn(batch, heads, blocks * size, dim, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(batch, kv_heads, blocks * size, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    ck, cv = (torch.randn(batch, kv_heads, ctx, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    for t in (k, v, ck, cv):
        t.requires_grad_()
    visible = torch.arange(ctx) < torch.randint(1, ctx, (batch, blocks), generator=gen)[..., None]
    results = []
    for budget in (1 << 24, 2 * 2 * size * (ctx + size)):  # one chunk, then one block per chunk
        monkeypatch.setattr(memory, "SCORE_BUDGET", budget)
        out = block_attention(q, k, v, ck, cv, visible, True)
        results.append((out, torch.autograd.grad(out.square().sum(), [q, k, v, ck, cv])))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-12, atol=1e-12)
    for mine, theirs in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)


def padded_batch(target):
    batch = make_batch(target, batch=2, seq=24, seed=2)
    batch["attention_mask"][1, 17:] = 0  # right padding, as training collates
    batch["loss_mask"][:, :3] = 0
    batch["loss_mask"][1, 17:] = 0
    return batch


def loss_and_grads(head, batch):
    head.zero_grad()
    torch.manual_seed(0)  # the block drafters' anchors: the same blocks in every run
    loss, metrics = head.loss(batch)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in head.named_parameters() if p.grad is not None}
    return loss.detach(), metrics, grads


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_heads_loss_and_gradients_are_the_same_whole_or_in_recomputed_chunks(
    peaked_tiny_llama, name, monkeypatch
):
    torch.manual_seed(3)
    head = build_head(HEADS[name], peaked_tiny_llama)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # no zero-initialised part: every gradient path carries something
    batch = padded_batch(peaked_tiny_llama)
    runs = []
    if name in ("eagle3", "peagle"):  # the dense-mask attention of before, kept as the reference
        with monkeypatch.context() as patch:
            patch.setattr(StepKVCache, "attend", dense_step_attention)
            runs.append(loss_and_grads(head, batch))
    runs.append(loss_and_grads(head, batch))  # one chunk, activations kept
    head.checkpoint_steps = True
    monkeypatch.setattr(memory, "SCORE_BUDGET", 2000)  # many chunks of attention and of logits
    runs.append(loss_and_grads(head, batch))
    head.fused_attention = True  # train.attention: fused (only training-time test reads it)
    runs.append(loss_and_grads(head, batch))
    reference = runs[0]
    assert reference[2], "no gradient at all"
    for loss, metrics, grads in runs[1:]:
        torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
        assert metrics.keys() == reference[1].keys()
        for key, value in metrics.items():
            torch.testing.assert_close(value, reference[1][key], rtol=1e-5, atol=1e-6)
        assert grads.keys() == reference[2].keys()
        for key, grad in grads.items():
            torch.testing.assert_close(grad, reference[2][key], rtol=1e-4, atol=1e-6, msg=key)


def test_twenty_training_steps_on_the_new_path_follow_the_dense_path(peaked_tiny_llama, monkeypatch):
    batches = [padded_batch(peaked_tiny_llama)] + [
        make_batch(peaked_tiny_llama, batch=2, seq=24, seed=s) for s in range(4, 7)
    ]

    def train(dense: bool) -> list[float]:
        torch.manual_seed(5)
        head = build_head(HEADS["eagle3"], peaked_tiny_llama)
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
        losses = []
        with monkeypatch.context() as patch:
            if dense:
                patch.setattr(StepKVCache, "attend", dense_step_attention)
            else:
                patch.setattr(memory, "SCORE_BUDGET", 2000)
                head.checkpoint_steps = True
            for step in range(20):
                optimizer.zero_grad()
                loss, _ = head.loss(batches[step % len(batches)])
                loss.backward()
                optimizer.step()
                losses.append(float(loss))
        return losses

    dense, new = train(True), train(False)
    assert new == pytest.approx(dense, rel=1e-4)
    assert sum(new[-4:]) < 0.95 * sum(new[:4]), new  # it learns (the same four batches, first and last)
