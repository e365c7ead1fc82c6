"""DSpark drafting (``heads/dspark.py``): one forward of the block drafts every slot's base logits, then the
Markov head drafts left to right (each node's logits are its depth's plus the bias of its parent's token), and the
confidence head says how far the draft survives: below ``min_confidence`` drafting stops (``decoding.tree``'s
adaptive-depth rule, with the head's estimate in place of the draft's own probabilities).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from headstart.decoding.proposers_block import BlockWalk
from headstart.decoding.tree import Tree, confident_depth
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import Proposer
from headstart.heads import DraftHead
from headstart.heads.dspark import DSparkHead


class DSpark(BlockWalk):
    """A DSpark head drafting a static tree (a chain by default) from one block of ``drafts`` slots, the anchor's
    slot drafting too (vLLM's ``sample_from_anchor``): node [.., j] at depth d holds its parent's j-th best (or
    j-th sampled) token under depth d's logits plus the Markov bias of the parent's token, as vLLM's DSpark
    speculator drafts its chain. Sampled runs draw every sibling group from that distribution (lossless, as
    ``shaped_tree`` drafts). With ``min_confidence`` > 0 (a head with a confidence head) the tree is cut below the
    first level whose best path the head gives less than that chance of surviving verification."""

    title = "DSpark"

    def __init__(
        self,
        head: DraftHead,
        choices: Sequence[Sequence[int]] | None = None,
        drafts: int | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        super().__init__(head, choices, drafts)
        self.head: DSparkHead = cast(DSparkHead, head)
        if min_confidence > 0 and self.head.confidence_head is None:
            raise ValueError(
                "adaptive depth (min_confidence) for DSpark needs the head's confidence head; this head was "
                "trained without one (head.confidence_head: false)"
            )
        self.min_confidence = min_confidence

    def cut(self, tree: Tree, hidden: torch.Tensor, root: torch.Tensor) -> Tree:
        """Below the first level whose best path the confidence head gives less than ``min_confidence``."""
        if self.head.confidence_head is None:
            return tree
        tree.survival = self.survival(tree, hidden, root)
        return confident_depth(tree, tree.survival, self.min_confidence)

    def survival(self, tree: Tree, hidden: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Log [n]: the confidence head's chance that the target accepts the path to each node, the product of
        its per-slot estimates (each from the slot's output and its previous token, the node's parent's)."""
        previous = torch.where(tree.parents >= 0, tree.tokens[tree.parents.clamp(min=0)], root)
        logit = self.head.confidence_logit(hidden[tree.depths - 1], previous)
        own = torch.nn.functional.logsigmoid(logit)
        path = own.clone()
        for level in range(2, int(tree.depths.max()) + 1):  # parents come before their children
            nodes = (tree.depths == level).nonzero()[:, 0]
            path[nodes] = own[nodes] + path[tree.parents[nodes]]
        return path

    @classmethod
    def adapts_depth(cls, head: DraftHead) -> bool:
        return cast(DSparkHead, head).confidence_head is not None

    @classmethod
    def for_tree(cls, head: DraftHead, tree: TreeSpec) -> Proposer:
        """Static shapes, at a fixed depth or cut by the confidence head (``min_confidence``)."""
        if tree.shape != "static":
            shape = tree.shape
            raise ValueError(f"DSpark drafts static shapes only (every depth from one forward), not a {shape} tree")
        return cls(head, tree.choices or [], min_confidence=tree.min_confidence)
