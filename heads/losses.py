"""What the heads' training losses share: aligning labels with positions, the soft cross-entropy, the LK losses,
D-PACE's weights and the chain acceptance metrics of block drafters."""

from __future__ import annotations

import torch

from headstart.heads.layers import causal_mask, default_positions


def shift_left(x: torch.Tensor, k: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, i + k] at position i along dim 1; the last k positions are ``fill``."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat((x[:, k:], pad), dim=1)


def label_mask(batch: dict[str, torch.Tensor], offset: int) -> torch.Tensor:
    """Bool [B, S]: position i's prediction of token ``input_ids[i + offset]`` is trained.

    A label counts when it exists (i + offset < S), is not padding, and ``loss_mask`` is 1 at the
    label's own position (the data pipeline marks the tokens to learn, e.g. assistant replies); in a packed row
    (``segment_ids``, ``data_recipes.shards.pack_collate``) it must also belong to position i's sample.
    """
    valid = shift_left(batch["loss_mask"].bool() & batch["attention_mask"].bool(), offset, False)
    if "segment_ids" in batch:  # a packed row: the label must be a token of position i's own sample
        segments = batch["segment_ids"]
        valid &= shift_left(segments, offset, -1) == segments
    return valid


def sample_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """Bool [B, 1, S, S] causal attention within each sample of a packed row (``segment_ids``); None (causal over
    the row) where the batch is not packed."""
    if "segment_ids" not in batch:
        return None
    segments = batch["segment_ids"]
    return (causal_mask(segments.shape[1], 0, segments.device) & (segments[:, :, None] == segments[:, None, :]))[
        :, None
    ]


def sample_anchors(candidates: torch.Tensor, count: int, fixed_seed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, N], real [B, N]): up to ``count`` distinct positions per row drawn uniformly from ``candidates``
    [B, S] (a block drafter's blocks); ``real`` is False for the fillers of a row with fewer candidates. Draws from
    torch's generator, or from one seeded 0 (``fixed_seed``)."""
    generator = torch.Generator(candidates.device).manual_seed(0) if fixed_seed else None
    scores = torch.rand(candidates.shape, generator=generator, device=candidates.device)
    top = scores.masked_fill(~candidates, -1.0).topk(min(count, candidates.shape[1]), dim=1)
    return top.indices, top.values >= 0


def same_sample(batch: dict[str, torch.Tensor], anchors: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Bool [B, N, M] (broadcast): whether the row's positions ``at`` [B, N or 1, M] hold tokens of the sample of
    each of ``anchors`` [B, N] in a packed row (``segment_ids``); True (a scalar) where a row is one sample."""
    segments = batch.get("segment_ids")
    if segments is None:
        return torch.ones((), dtype=torch.bool, device=anchors.device)
    return segments.gather(1, at.flatten(1)).view_as(at) == segments.gather(1, anchors)[..., None]


def batch_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rotary positions [B, S] of a training batch: each packed sample's own from 0 (``position_ids``, set by
    ``data_recipes.shards.pack_collate``), else 0.. along the row."""
    return batch["position_ids"] if "position_ids" in batch else default_positions(batch["input_ids"])


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32, or as it is when wider (fp64: a gradient check's)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [...] of ``logits`` [..., V] to the distributions ``target_probs`` [..., V], in fp32.

    (The forward KL plus the target's entropy: the same gradient.)
    """
    return -(target_probs * at_least_fp32(logits).log_softmax(-1)).sum(-1)


# LK (arXiv 2602.23881; SpecForge's ``lk_loss_type: lambda`` and its default kl_decay): the KL term's weight
# exp(-decay x the mean acceptance) falls as the draft's acceptance rises.
LK_KL_DECAY = 1.0


def acceptance_rate(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """The chance [...] that verification accepts a token drafted from softmax(``logits``) [..., V]: sum_v
    min(p_v, q_v), 1 - the total variation distance, in fp32. ``target_probs`` [..., V] are the target's
    probabilities of the draft's tokens; over a reduced draft vocabulary, the target's whole-vocabulary
    probabilities of those tokens (``draft_vocab_mass``), not renormalised: a token the draft cannot propose is
    never accepted."""
    return torch.minimum(at_least_fp32(logits).softmax(-1), target_probs).sum(-1)


def draft_vocab_mass(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """[..., 1]: the target's probability mass on a reduced draft vocabulary, from its logits over the whole
    vocabulary [..., V] and over the draft's tokens [..., V_draft]; renormalised draft-vocab probabilities times it
    are the target's own."""
    return (draft_logits.float().logsumexp(-1, keepdim=True) - target_logits.float().logsumexp(-1, keepdim=True)).exp()


def lk_loss(cross_entropy: torch.Tensor, acceptance: torch.Tensor, mean_acceptance: torch.Tensor) -> torch.Tensor:
    """The LK hybrid loss (arXiv 2602.23881) of positions with soft cross-entropies ``cross_entropy`` [...] (the KL
    to the target plus its entropy: the same gradient) and acceptance rates ``acceptance`` [...]:
    lambda x CE + (1 - lambda) x (1 - acceptance), with lambda = exp(-LK_KL_DECAY x ``mean_acceptance``), the
    group's mean acceptance, detached (a schedule, not a thing to optimise). A draft far from the target learns
    mostly from the KL, whose gradient does not vanish where the distributions do not overlap; as its acceptance
    rises, the loss moves to the acceptance rate itself, what decoding gains from. Linear in both terms, so the
    loss of a mean is the mean of the losses."""
    weight = torch.exp(-LK_KL_DECAY * at_least_fp32(mean_acceptance.detach()))
    return weight * cross_entropy + (1 - weight) * (1 - acceptance)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's per-position loss weights [..., K] of a block's K scored positions (arXiv 2605.18810, Eq. 7-8).

    ``confidence`` [..., K] is the draft's probability of the token verification wants at each position, and
    ``valid`` [..., K] bool the positions that are scored. Each confidence is smoothed toward 1,
    ``q~ = alpha + (1 - alpha) * q``, so that a weak early position cannot zero every later weight; the weight
    of position j is the sum over m >= j of the products of q~ over positions 1..m: the chance the chain
    reaches m, summed over the positions m that j's acceptance lets count. Unscored positions multiply by 1 and
    add nothing, so a gap in the labels neither cuts the chain nor earns weight. Detached: the weights say how
    much each position matters, they are not themselves a thing to optimise.
    """
    with torch.no_grad():
        smoothed = torch.where(valid, alpha + (1 - alpha) * confidence.float(), 1.0)
        reach = smoothed.cumprod(-1) * valid
        # Suffix sums: the total minus what comes before j.
        return reach.sum(-1, keepdim=True) - reach.cumsum(-1) + reach


def dpace_mean(
    loss: torch.Tensor, confidence: torch.Tensor, rows: tuple[torch.Tensor, ...], valid: torch.Tensor, alpha: float
) -> torch.Tensor:
    """The D-PACE weighted mean of ``loss`` [R], the positions ``rows`` (an index of ``valid`` [..., K], the
    blocks' scored positions) with their ``confidence`` [R]: sum(w * loss) / sum(w); 0 when nothing is scored."""
    full = torch.zeros(valid.shape, device=loss.device)
    full[rows] = confidence.detach().float()
    weights = dpace_weights(full, valid, alpha)[rows]
    return (weights * loss).sum() / weights.sum().clamp(min=torch.finfo(torch.float32).tiny)


def chain_metrics(
    slot_loss: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
    labelled: torch.Tensor,
    hits: torch.Tensor,
    shown: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``loss_j`` (slot j + 1's mean loss) and ``acc_j``: the rate at which slot j + 1 drafts the target's greedy
    token (``hits`` [R], per scored slot) among blocks whose slots 1..j all did, the chain acceptance rate of
    position j + 1, so ``train.metrics.predicted_tau`` of them is the expected accepted length of these blocks.
    The slots ``shown`` [..., K] (a variable prefix's: the block holds their tokens) count as right."""
    with torch.no_grad():
        agree = torch.zeros_like(labelled) if shown is None else shown.clone()
        agree[rows] = hits
        # Slot j is tried when it is labelled and slots 1..j-1 were all labelled and right.
        right_before = torch.cat((torch.ones_like(agree[..., :1]), agree[..., :-1]), -1).long().cumprod(-1).bool()
        tried = labelled & right_before
        chain = (tried & agree).flatten(0, 1).sum(0) / tried.flatten(0, 1).sum(0).clamp(min=1)
    metrics = {}
    for j in range(labelled.shape[-1]):
        metrics[f"loss_{j}"] = slot_loss[j].detach()
        metrics[f"acc_{j}"] = chain[j]
    return metrics
