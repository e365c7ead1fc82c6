"""How a block drafter's training scores its slots (``heads/block.py``): the variable prefix a training block shows,
each scored slot's loss from its head type's terms, and the weighting of the slots into one loss. Every block
drafter (DFlash, DSpark, DFlash-2, Domino) reads these, so each rule is written once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from headstart.heads.losses import dpace_mean, lk_loss

if TYPE_CHECKING:
    from headstart.heads.block_options import BlockOptions

# Variable-prefix training (D2SD, arXiv 2606.04446): a block shows l real tokens with Pr(l) ~ base**l, the prior
# NeMo AutoModel's prefix_weight_base defaults to (below 1: short prefixes, the common case after a rejection, weigh
# most).
PREFIX_PRIOR_BASE = 0.9
MIN_PREFIX = 2  # a prefix of 1 is plain DFlash's block, which every other training step already draws


def draw_prefix_lengths(anchors: torch.Tensor, drafting_slots: int) -> torch.Tensor:
    """[B, N]: a prefix length l in [MIN_PREFIX, drafting_slots] for each block at ``anchors`` [B, N], drawn with
    Pr(l) ~ PREFIX_PRIOR_BASE**l from torch's generator (which the training loop seeds per micro-batch)."""
    low = min(MIN_PREFIX, drafting_slots)
    lengths = torch.arange(low, drafting_slots + 1, device=anchors.device)
    prior = PREFIX_PRIOR_BASE ** lengths.double()
    return lengths[torch.multinomial(prior, anchors.numel(), replacement=True)].view_as(anchors)


def slot_losses(terms: dict[str, torch.Tensor], loss: str | None) -> torch.Tensor:
    """Each scored slot's training loss [R] from its head type's ``slot_terms``: its ``divergence`` (with ``loss:
    lk``, the LK hybrid of its soft cross-entropy and its acceptance, the KL's weight set by the batch's mean
    acceptance) plus its ``auxiliary`` terms."""
    divergence = terms["divergence"]
    if loss == "lk":
        acceptance = terms["acceptance"]
        divergence = lk_loss(terms["soft_ce"], acceptance, acceptance.mean())
    return divergence + terms["auxiliary"] if "auxiliary" in terms else divergence


def weighted_slot_loss(
    per_slot: torch.Tensor,
    rows: tuple[torch.Tensor, ...],
    labelled: torch.Tensor,
    step: torch.Tensor,
    confidence: torch.Tensor,
    options: BlockOptions,
    over_scored_slots: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss, each drafting slot's mean loss [K]) of the scored slots' losses ``per_slot`` [R] (at ``rows`` of
    ``labelled`` [B, N, K]). Slot weights exp(-step / loss_gamma), ``step`` [B, N, K] counting from the first slot
    a block does not show: with ``over_scored_slots`` (a variable prefix, DSpark's cut blocks) the weighted mean over
    every scored slot, as NeMo weighs it; else each position's mean loss weighted by its position's weight (later
    slots are accepted less often), weights normalised to 1. With ``loss_weighting: dpace``, D-PACE's weighted mean
    over every scored slot (heads/losses.py) from the draft's ``confidence`` [R] in each."""
    depth, slot = labelled.shape[-1], rows[2]
    counts = torch.bincount(slot, minlength=depth)
    slot_loss = torch.zeros(depth, device=per_slot.device).index_add(0, slot, per_slot) / counts.clamp(min=1)
    if options.loss_weighting == "dpace":
        return dpace_mean(per_slot, confidence, rows, labelled, options.dpace_alpha), slot_loss
    if over_scored_slots:
        weights = torch.exp(-step[rows].float() / options.loss_gamma)
        return (weights * per_slot).sum() / weights.sum().clamp(min=torch.finfo(torch.float32).tiny), slot_loss
    weights = torch.exp(-torch.arange(depth, device=per_slot.device) / options.loss_gamma)
    return (weights * slot_loss).sum() / weights.sum(), slot_loss
