"""Attention that computes only the scores a query can see, in chunks of queries recomputed in backward, so that
training memory grows linearly with the sequence length.

- ``ttt_attention``: training-time test's step j (EAGLE-3, P-EAGLE). Query i sees step 0's keys 0..i (the true
  prefix) and, at each step 1..j, only the key its own chain wrote there: S causal keys plus j diagonal ones, where
  the dense form (``ttt_step_mask``, still used where its scores fit one chunk) scores all (j + 1) S keys.
- ``block_attention``: N blocks of a block drafter (DFlash and its kin), each over the context before it and
  itself, a chunk of blocks at a time.
- ``chunked``: any computation split along its queries (or rows), each chunk recomputed in backward (the
  losses' logits over the vocabulary too).

Each chunk is one exact softmax over the keys it sees (the causal and the diagonal scores concatenated: their
log-sum-exp merge, done by the softmax itself), so values and gradients are the dense form's up to float
rounding; only one chunk's scores live at a time, forward or backward (``torch.utils.checkpoint``).

A packed row (``train.pack``: several samples end to end, ``segment_ids`` naming them) attends within each sample:
training-time test runs each row sample by sample (``segment_bounds``), and one row's blocks of a block drafter are
grouped by the context they see (``context_windows``; several rows: their ``context_visible`` mask), so a packed
row costs what its samples would unpacked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from headstart.core.memory import score_budget

# Scores held at once per chunk: core.memory.score_budget(device) elements, all heads and the batch (on a CPU 2^24 fp32
# scores, 64 MB, plus their softmax and gradient in backward); the memory estimate counts them from there.


def query_chunk(queries: int, keys_per_query: int, rows: int, device: torch.device, budget: int | None = None) -> int:
    """How many queries one chunk takes so that its ``rows`` (batch x heads) x queries x keys scores fit ``budget``
    (default ``core.memory.score_budget`` of the ``device`` the scores live on), at least one."""
    budget = score_budget(device) if budget is None else budget
    return max(1, min(queries, budget // max(1, rows * keys_per_query)))


def chunked(attend: Callable[[int, int], Any], queries: int, chunk: int, dim: int = -2) -> Any:
    """``attend(start, end)`` (a tensor, or a dict of tensors, for queries start..end-1) over every chunk of ``chunk``
    queries, joined along ``dim``; with more than one chunk, each is recomputed in backward instead of keeping what
    its forward made."""
    if chunk >= queries:
        return attend(0, queries)
    parts = [
        checkpoint(attend, start, min(start + chunk, queries), use_reentrant=False)
        for start in range(0, queries, chunk)
    ]
    if isinstance(parts[0], dict):
        return {key: torch.cat([part[key] for part in parts], dim) for key in parts[0]}
    return torch.cat(parts, dim=dim)


def ttt_step_mask(seq_len: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool [S, (step+1)*S] (True = attend) for the queries of training-time-test step ``step``.

    Columns are the keys of steps 0..step, S per step. Query i sees step-0 keys k <= i (the true
    prefix, causal) and, at each step 1..step, only the key its own chain wrote there (index i).
    """
    idx = torch.arange(seq_len, device=device)
    causal = idx[None, :] <= idx[:, None]
    own = idx[None, :] == idx[:, None]
    return torch.cat([causal] + [own] * step, dim=1)


def ttt_attention_mask(seq_len: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """The whole step-wise causal mask, bool [steps*S, steps*S]: rows (step j, index i), columns (step m, index k).

    Block (j, m) is causal for m == 0, diagonal for 1 <= m <= j, empty for m > j. Training builds one
    block row at a time (``ttt_step_mask``); this full form is for inspection and tests.
    """
    rows = [ttt_step_mask(seq_len, j, device) for j in range(steps)]
    return torch.cat([F.pad(r, (0, steps * seq_len - r.shape[1]), value=False) for r in rows], dim=0)


def softmax_fp32(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in at least fp32 (bf16 scores lose the small weights), in the scores' dtype."""
    return scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(scores.dtype)


def ttt_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    budget: int | None = None,
    segments: torch.Tensor | None = None,
    fused: bool = False,
) -> torch.Tensor:
    """Training-time-test step j = len(keys) - 1: q [B, heads, S, d]; keys[m], values[m] [B, kv_heads, S, d] of
    steps m = 0..j. Query i attends to keys[0][..., :i + 1, :] and keys[m][..., i, :] for m >= 1 (each key/value
    head serving its group of query heads, as SDPA's ``enable_gqa``). Returns [B, heads, S, d]. Where the dense
    form's (j + 1) S^2 scores fit the budget it runs as it is (``ttt_step_mask``); beyond, sparsely in chunks.
    ``segments`` [B, S] (packed rows' sample of each position): each sample attends on its own, row by row, costing
    what it would unpacked (its own keys of the later steps are its sample's already). ``fused``: by
    ``ttt_attention_fused`` instead, the same values."""
    if segments is not None:
        rows = [(slice(r, r + 1), segments[r]) for r in range(len(q))]
        return torch.cat(
            [_per_sample(q[r], [k[r] for k in keys], [v[r] for v in values], budget, at, fused) for r, at in rows]
        )
    if fused:
        return ttt_attention_fused(q, keys, values)
    batch, heads, seq, dim = q.shape
    if batch * heads * len(keys) * seq * seq <= (score_budget(q.device) if budget is None else budget):
        # Every score of the dense form fits one chunk: SDPA's fused kernel over all the steps' keys with the mask,
        # faster there than the matmuls below and keeping less for backward.
        mask = ttt_step_mask(seq, len(keys) - 1, q.device)
        return F.scaled_dot_product_attention(
            q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
        )
    kv_heads = keys[0].shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, seq, dim)
    prefix_k, prefix_v, own_k, own_v = keys[0], values[0], keys[1:], values[1:]
    scale = 1 / math.sqrt(dim)

    def attend(start: int, end: int) -> torch.Tensor:
        query = grouped[:, :, :, start:end]  # [B, kv, groups, c, d]
        scores = query @ prefix_k[:, :, None, :end].transpose(-1, -2) * scale  # [B, kv, groups, c, end]
        later = torch.arange(end, device=q.device) > torch.arange(start, end, device=q.device)[:, None]
        scores = scores.masked_fill(later, float("-inf"))
        diagonal = [(query * k[:, :, None, start:end]).sum(-1, keepdim=True) * scale for k in own_k]
        probs = softmax_fp32(torch.cat((scores, *diagonal), -1))
        out = probs[..., :end] @ prefix_v[:, :, None, :end]
        for m, v in enumerate(own_v):
            out = out + probs[..., end + m, None] * v[:, :, None, start:end]
        return out

    chunk = query_chunk(seq, seq + len(keys), batch * heads, q.device, budget)
    return chunked(attend, seq, chunk).view(batch, heads, seq, dim)


def ttt_attention_fused(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """``ttt_attention`` (one row of samples, no packing) by the device's fused attention kernel: the causal part
    over step 0's keys with its log-sum-exp (``causal_attention_lse``), merged with the j diagonal scores by
    log-sum-exp. No S x S scores exist in forward or backward, on any device; values and gradients are the exact
    path's up to float rounding (``tests/heads/test_long_sequences.py``)."""
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True, enable_gqa=True)
    batch, heads, seq, dim = q.shape
    kv_heads, scale = keys[0].shape[1], 1 / math.sqrt(dim)
    wide = torch.promote_types(q.dtype, torch.float32)  # the merge's precision: at least fp32, as softmax_fp32
    causal, causal_lse = causal_attention_lse(q, keys[0], values[0], scale)
    grouped = q.view(batch, kv_heads, heads // kv_heads, seq, dim)  # each key/value head serves its group
    diagonal = [(grouped * k[:, :, None]).sum(-1).to(wide).view(batch, heads, seq) * scale for k in keys[1:]]
    lse = torch.logsumexp(torch.stack([causal_lse, *diagonal]), 0)
    out = torch.exp(causal_lse - lse)[..., None] * causal.to(wide)
    for score, v in zip(diagonal, values[1:], strict=True):
        weight = torch.exp(score - lse).view(batch, kv_heads, heads // kv_heads, seq, 1)
        out = out + (weight * v[:, :, None].to(wide)).view(batch, heads, seq, dim)
    return out.to(q.dtype)


def causal_attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of ``q`` [B, heads, S, d] over ``k``, ``v`` [B, kv_heads, S, d] by the fused kernel of
    the device (CUDA: memory-efficient attention, fp32 and bf16; CPU: its flash kernel), and its log-sum-exp per
    query [B, heads, S] in at least fp32.

    The kernels give the log-sum-exp as a value without a gradient. Its gradient (d lse_i / d s_ik = p_ik) is
    attached by a second fused pass, attention over ``k`` as the values, b_i = sum_k p_ik k_k: d lse_i / d q_i =
    scale b_i, and the gradient reaching ``k`` through b's values is scale sum_i g_i p_ik q_i, what lse_i's
    gradient g_i owes it. The added terms are zero in value, exactly (x + x - 2x)."""
    groups = q.shape[1] // k.shape[1]
    k_all, v_all = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # these kernels take no GQA
    if q.device.type == "cuda":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k_all, v_all, None, True, 0.0, True, scale=scale
        )
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k_all, v_all, 0.0, True, scale=scale)
    wide = torch.promote_types(q.dtype, torch.float32)
    lse = lse[..., : q.shape[2]].detach().to(wide)  # CUDA pads it to a multiple of 32 queries
    b = F.scaled_dot_product_attention(q.detach(), k.detach(), k, is_causal=True, enable_gqa=True, scale=scale)
    q_, b_ = q.detach(), b.detach()
    attached = (q * b_).sum(-1) + (q_ * b).sum(-1) - 2 * (q_ * b_).sum(-1)
    return out, lse + scale * attached.to(wide)


def _per_sample(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    budget: int | None,
    segments: torch.Tensor,
    fused: bool,
) -> torch.Tensor:
    """``ttt_attention`` of one batch row (``q`` [1, heads, S, d], its keys and values) a sample (``segments`` [S])
    at a time."""
    bounds = segment_bounds(segments)
    parts = [
        ttt_attention(q[:, :, a:b], [k[:, :, a:b] for k in keys], [v[:, :, a:b] for v in values], budget, fused=fused)
        for a, b in bounds
    ]
    return torch.cat(parts, dim=2)


def segment_bounds(segments: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each run of equal ids in ``segments`` [S] (a packed row's samples, in order)."""
    starts = [0, *(torch.nonzero(segments[1:] != segments[:-1])[:, 0] + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(segments)], strict=True))


def context_windows(visible: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """Blocks grouped by the first context token they see (in a packed row, their sample's first), from ``visible``
    [N, C]: (the group's blocks, that token, one past the last token any of them sees). A block that sees nothing
    joins the group starting at 0."""
    seen, columns = visible.any(1), torch.arange(visible.shape[1], device=visible.device)
    first = torch.where(visible, columns, visible.shape[1]).amin(1).masked_fill(~seen, 0)
    last = torch.where(visible, columns, -1).amax(1)
    windows = []
    for lo in first.unique().tolist():
        chosen = (first == lo).nonzero()[:, 0]
        windows.append((chosen, lo, max(lo, int(last[chosen].max()) + 1)))
    return windows


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_k: torch.Tensor,
    context_v: torch.Tensor,
    context_visible: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """Attention of N blocks of S slots each over the shared context and their own block only.

    q: [batch, heads, N * S, head_dim], blocks laid out one after another; k, v: [batch, kv_heads, N * S,
    head_dim] and context_k, context_v: [batch, kv_heads, C, head_dim], each key/value head serving its group
    of query heads (as ``repeat_interleave`` would pair them, without the copies); ``context_visible``
    [batch, N, C] says which context tokens each block sees (None: all). One softmax over (context, own
    block), without an [N * S, N * S] score matrix: many blocks per sequence cost N * S * (C + S), computed a
    chunk of blocks at a time and recomputed in backward where one chunk cannot take them all
    (``heads.sparse_attention.chunked``: memory linear in the context).
    """
    batch, heads, n, dim = q.shape
    if context_visible is not None and batch == 1 and len(windows := context_windows(context_visible[0])) > 1:
        # A packed row (train.pack): the blocks of each sample over that sample's context only, costing what they
        # would unpacked instead of every block scoring the whole row.
        size, out = n // context_visible.shape[1], torch.empty_like(q)
        for chosen, lo, hi in windows:
            rows = (chosen[:, None] * size + torch.arange(size, device=q.device)).flatten()
            context_kv = context_k[:, :, lo:hi], context_v[:, :, lo:hi]
            visible = context_visible[:, chosen, lo:hi]
            own = q[:, :, rows], k[:, :, rows], v[:, :, rows]
            out[:, :, rows] = block_attention(*own, *context_kv, visible, causal)
        return out
    kv_heads, context = k.shape[1], context_k.shape[2]
    groups, blocks = heads // kv_heads, 1 if context_visible is None else context_visible.shape[1]
    size, scale = n // blocks, 1 / math.sqrt(dim)
    # Per key/value head and block: its query heads' slots, [batch, kv_heads, N, groups * S, head_dim].
    q = q.view(batch, kv_heads, groups, blocks, size, dim).transpose(2, 3).reshape(batch, kv_heads, blocks, -1, dim)
    k_blocks, v_blocks = (t.view(batch, kv_heads, blocks, size, dim) for t in (k, v))
    later = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1).repeat(groups, 1) if causal else None

    def attend(start: int, end: int) -> torch.Tensor:
        query = q[:, :, start:end]
        context_scores = query.flatten(2, 3) @ context_k.transpose(-1, -2) * scale
        context_scores = context_scores.view(batch, kv_heads, end - start, groups * size, context)
        if context_visible is not None:
            context_scores = context_scores.masked_fill(~context_visible[:, None, start:end, None], float("-inf"))
        block_scores = query @ k_blocks[:, :, start:end].transpose(-1, -2) * scale  # [batch, kv, n, groups * S, S]
        if later is not None:
            block_scores = block_scores.masked_fill(later, float("-inf"))
        probs = softmax_fp32(torch.cat((context_scores, block_scores), -1))  # never an empty row
        context_probs, block_probs = probs.split([context, size], dim=-1)
        return (context_probs.flatten(2, 3) @ context_v).view_as(query) + block_probs @ v_blocks[:, :, start:end]

    chunk = query_chunk(blocks, groups * size * (context + size), batch * kv_heads, q.device)
    out = chunked(attend, blocks, chunk, dim=2)
    return out.view(batch, kv_heads, blocks, groups, size, dim).transpose(2, 3).reshape(batch, heads, n, dim)
