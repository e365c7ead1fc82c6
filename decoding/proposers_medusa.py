"""Medusa's proposer: its heads' per-depth candidates filling a static tree (``per_depth_tree``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.proposers_heads import HeadProposer, per_depth_tree
from headstart.decoding.tree import MC_SIM_7B_63, SMALL_CHOICES, Tree, empty_tree
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import Proposer, Sampling
from headstart.heads import DraftHead
from headstart.heads.medusa import MedusaHead


class Medusa(HeadProposer):
    """Medusa heads on the target's last hidden state, filling a static tree (``choices``).

    The newest cached row is the token before the pending root, so head j's guess is the token at depth
    j + 1 below the root. Greedy and typical-acceptance runs take each head's top candidates; exact
    sampling draws them without replacement from each head's q.
    """

    title = "Medusa"
    tunable = False  # its heads' fixed tree (MC_SIM_7B_63), cut to the flags' depth and size

    def __init__(self, head: DraftHead, choices: Sequence[Sequence[int]] = SMALL_CHOICES) -> None:
        self.check_head(head)
        self.head, self.choices = cast(MedusaHead, head), [list(c) for c in choices]
        self.depth = max(len(c) for c in self.choices)
        heads = head.config.trained_depth
        if self.depth > heads:
            raise ValueError(f"tree depth {self.depth} needs more than the head's {heads} heads")
        self.hidden_layers = head.hidden_layers

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.sampling = sampling
        self.last_hidden: torch.Tensor | None = None

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if hidden is not None and len(hidden):
            self.last_hidden = hidden[-1:]

    def propose(self, tokens: torch.Tensor) -> Tree:
        if self.last_hidden is None:
            return empty_tree(tokens.device)
        return per_depth_tree(self.head.draft(self.last_hidden)[0, : self.depth], self.choices, self.sampling)

    @classmethod
    def for_flags(cls, head: DraftHead, flags: TreeSpec) -> Proposer:
        depth = min(flags.depth, head.config.trained_depth)
        # MC_SIM_7B_63 lists paths by how often they are accepted, parents first: a prefix is a smaller tree.
        return cls(head, [c for c in MC_SIM_7B_63 if len(c) <= depth][: flags.total_tokens])
