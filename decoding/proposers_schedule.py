"""Speculation by load: a proposer that drafts as deep as a schedule gives the current batch size.

A schedule (``decoding.tree_config.Schedule``, a tree.json's ``depth_per_batch_size``) gives every batch size a
depth. With n sequences decoding, each drafted tree is cut at the depth it gives n (``tree.capped``: the cut
depends on no token, so sampling stays exact); at depth 0 nobody drafts, which is plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.tree import Tree, capped, empty_tree
from headstart.decoding.tree_config import Schedule, scheduled_depth

if TYPE_CHECKING:  # the verifier's interface; it imports this module to run its schedules
    from headstart.decoding.verify import Proposer, Sampling


class SpeculationByLoad:
    """``proposer`` drafting at the depth ``schedule`` gives ``batch_size()``, the sequences decoding now.

    While that depth is 0 its proposer does not read either: an EAGLE head's forward over every committed row
    would be spent on drafts nobody makes. The rows wait, and the proposer reads them all when drafting resumes.
    """

    def __init__(self, proposer: Proposer, schedule: Schedule, batch_size: Callable[[], int]) -> None:
        self.proposer, self.schedule, self.batch_size = proposer, schedule, batch_size
        self.hidden_layers = proposer.hidden_layers
        self.unread: torch.Tensor | None = None  # target states of the committed rows the proposer has not read

    def depth(self) -> int:
        return scheduled_depth(self.schedule, self.batch_size())

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.proposer.reset(sampling, positions)
        self.unread = None

    def propose(self, tokens: torch.Tensor) -> Tree:
        depth = self.depth()
        if depth == 0:
            return empty_tree(tokens.device)
        return capped(self.proposer.propose(tokens), depth)

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if hidden is not None and self.unread is not None:
            hidden = torch.cat((self.unread, hidden))
        if self.depth() > 0:
            self.proposer.update(tokens, hidden)
            self.unread = None
        else:
            self.unread = hidden
