"""The feature drafters' proposers: heads that draft from the target's features.

- ``Eagle``: EAGLE-1/2 and EAGLE-3 heads (and a target's MTP layer) drafting a dynamic EAGLE-2 tree, level by
  level, or a fixed shape.
- ``PEagle``: a P-EAGLE head (EAGLE-3 with ``parallel_drafting``) drafting every depth in one forward, handed
  over as a chain or as a static tree of each depth's top candidates (``per_depth_tree``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.head_proposers import head_proposer
from headstart.decoding.proposers import draft_logq
from headstart.decoding.proposers_heads import HeadProposer, per_depth_tree
from headstart.decoding.tree import Tree, dynamic_tree, empty_tree, shaped_tree
from headstart.decoding.tree_config import TreeSpec, chain_choices
from headstart.decoding.verify import Proposer, Sampling
from headstart.heads import DraftHead, KVCache
from headstart.heads.base import FeatureDrafter
from headstart.heads.eagle3 import Eagle3Head


class Eagle(HeadProposer):
    """EAGLE-1/2 or EAGLE-3 head drafting a dynamic EAGLE-2 tree, or a fixed shape when ``choices`` is given
    (Medusa-style paths, e.g. a tuned tree from ``eval.autotune``).

    The head pairs the target's feature at position i with the token at i + 1. ``update`` reads the
    pairs the last verification committed (the root and accepted rows' features, with the tokens that
    followed them, the last being the new pending root) into the head's own cache; the last pair's
    output is the root of the next tree. Drafted slots are cropped at the next ``update``. With
    ``min_confidence`` drafting stops at the first level whose best node is less likely than that
    (``decoding.tree.confident``; ``eval.autotune`` fits it).
    """

    title = "EAGLE"
    level_by_level = True

    def __init__(
        self,
        head: DraftHead,
        top_k: int = 8,
        depth: int = 5,
        total_tokens: int = 48,
        choices: Sequence[Sequence[int]] | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        self.check_head(head)
        self.head, self.top_k, self.depth, self.total_tokens = cast(FeatureDrafter, head), top_k, depth, total_tokens
        self.min_confidence = min_confidence
        self.choices = [list(c) for c in choices] if choices is not None else None
        self.hidden_layers = head.hidden_layers

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.sampling, self.cache, self.committed, self.positions = sampling, KVCache(), 0, positions
        self.root: tuple[torch.Tensor, torch.Tensor] | None = None  # (log-probs, feature) below the pending root

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.cache.crop(self.committed)
        if hidden is None or len(hidden) == 0:
            return
        m = len(hidden)
        positions = self.positions.rows(self.committed, m, tokens.device)[None]
        features = self.head.first_features(hidden)[None]
        logp, out = self.head.draft_step(tokens[None, -m:], features, positions, self.cache)
        self.committed += m
        self.root = (logp[0, -1], out[0, -1:])

    def propose(self, tokens: torch.Tensor) -> Tree:
        if self.root is None:  # a one-token prompt: no target feature yet
            return empty_tree(tokens.device)
        logp, feature = self.root
        # Row s + 1: the output feature of drafted slot s; row 0: the root's.
        self.slot_features: list[torch.Tensor] = [feature]
        root_logq, sample = self._logq(logp), not self.sampling.greedy
        if self.choices is not None:
            return shaped_tree(root_logq, self._expand, self.choices, sample, self.min_confidence)
        return dynamic_tree(
            root_logq, self._expand, self.top_k, self.depth, self.total_tokens, sample, self.min_confidence
        )

    def _expand(
        self, tokens: torch.Tensor, parent_slots: torch.Tensor, depth: int, visible: torch.Tensor
    ) -> torch.Tensor:
        prefix = torch.ones(len(tokens), self.committed, dtype=torch.bool, device=tokens.device)
        features = torch.cat(self.slot_features)[parent_slots + 1]
        positions = torch.full((1, len(tokens)), self.positions.at(self.committed - 1 + depth), device=tokens.device)
        mask = torch.cat((prefix, visible), 1)[None, None]
        logp, out = self.head.draft_step(tokens[None], features[None], positions, self.cache, mask)
        self.slot_features.append(out[0])
        return self._logq(logp[0])

    def _logq(self, logp: torch.Tensor) -> torch.Tensor:
        # The head already gives log-probs: greedy drafting ranks them as they are.
        return logp if self.sampling.greedy else draft_logq(logp, self.sampling)

    @classmethod
    def served_chain(cls, head: DraftHead, k: int) -> Proposer:
        return cls(head, top_k=1, depth=k, total_tokens=k)

    @classmethod
    def for_flags(cls, head: DraftHead, flags: TreeSpec) -> Proposer:
        chain = flags.shape == "static"  # a chain of depth: the one-wide dynamic tree (as served_chain drafts it)
        top_k, total_tokens = (1, flags.depth) if chain else (flags.top_k, flags.total_tokens)
        return cls(head, top_k, flags.depth, total_tokens, min_confidence=flags.min_confidence)

    @classmethod
    def for_tree(cls, head: DraftHead, tree: TreeSpec) -> Proposer:
        if tree.shape == "static":
            return cls(head, choices=tree.choices, min_confidence=tree.min_confidence)
        return cls(head, tree.top_k, tree.depth, tree.total_tokens, min_confidence=tree.min_confidence)


class PEagle(HeadProposer):
    """P-EAGLE: an EAGLE-3 head trained with ``parallel_drafting`` drafts all its depths in ONE forward, as
    vLLM's parallel drafting does (heads/eagle3.py): the pairs the last verification committed (the last
    one holding the pending root, whose output drafts depth 1), then depth - 1 mask slots at the following
    positions (their outputs draft depths 2..). That forward runs in ``update``; the mask slots leave the
    cache at the next one. A depth's draft does not depend on the tokens above it, so the drafts go out as
    a chain of ``depth`` or as a static tree of each depth's top candidates (``choices``, e.g. a tuned
    tree.json). Depths past the head's ``ttt_steps`` were never trained.
    """

    title = "P-EAGLE"

    def __init__(self, head: DraftHead, depth: int = 3, choices: Sequence[Sequence[int]] | None = None) -> None:
        if not issubclass(type(self), head_proposer(head.config)):
            raise ValueError(
                f"P-EAGLE drafting needs an EAGLE-3 head trained with parallel_drafting; this is a {head.config.type} "
                "head without it (draft it with the eagle3/eagle method)"
            )
        self.head = cast(Eagle3Head, head)
        self.choices = [list(c) for c in choices] if choices is not None else chain_choices(depth)
        self.hidden_layers = head.hidden_layers

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.sampling, self.cache, self.committed, self.positions = sampling, KVCache(), 0, positions
        self.logp: torch.Tensor | None = None  # per depth: the draft's log-probs

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.cache.crop(self.committed)
        if hidden is None or len(hidden) == 0:
            return
        m, masks = len(hidden), max(len(c) for c in self.choices) - 1
        mask_ids, mask_features = self.head.mask_slots(1, masks)
        ids = torch.cat((tokens[None, -m:], mask_ids), 1)
        features = torch.cat((self.head.first_features(hidden)[None], mask_features), 1)
        positions = self.positions.rows(self.committed, m + masks, tokens.device)[None]
        logp, _ = self.head.draft_step(ids, features, positions, self.cache)
        self.committed += m
        self.logp = logp[0, m - 1 :]  # depth 1 (the pending root's pair), then the mask slots'

    def propose(self, tokens: torch.Tensor) -> Tree:
        if self.logp is None:  # a one-token prompt: no target feature yet
            return empty_tree(tokens.device)
        return per_depth_tree(self.logp, self.choices, self.sampling)

    @classmethod
    def served_chain(cls, head: DraftHead, k: int) -> Proposer:
        return cls(head, depth=k)  # vLLM's parallel drafting: k depths from one forward

    @classmethod
    def for_flags(cls, head: DraftHead, flags: TreeSpec) -> Proposer:
        return cls.served_chain(head, flags.depth)

    @classmethod
    def shaped(cls, head: DraftHead, choices: list[list[int]]) -> Proposer:
        return cls(head, choices=choices)
