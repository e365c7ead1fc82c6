"""What the heads' training losses share: aligning labels with positions, and the soft cross-entropy."""

from __future__ import annotations

import torch


def shift_left(x: torch.Tensor, k: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, i + k] at position i along dim 1; the last k positions are ``fill``."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat((x[:, k:], pad), dim=1)


def label_mask(batch: dict[str, torch.Tensor], offset: int) -> torch.Tensor:
    """Bool [B, S]: position i's prediction of token ``input_ids[i + offset]`` is trained.

    A label counts when it exists (i + offset < S), is not padding, and ``loss_mask`` is 1 at the
    label's own position (the data pipeline marks the tokens to learn, e.g. assistant replies).
    """
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    return shift_left(valid, offset, False)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Cross-entropy [...] of ``logits`` [..., V] to the distributions ``target_probs`` [..., V], in fp32.

    (The forward KL plus the target's entropy: the same gradient.)
    """
    return -(target_probs * logits.float().log_softmax(-1)).sum(-1)
