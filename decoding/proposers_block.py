"""The block drafters' proposers (``heads/block.py``): one forward of a block drafts every depth at once.

- ``DFlash``: each depth's top candidates (or draws) fill a static tree, a chain by default.
- ``BlockWalk``: a block drafter whose every depth also depends on the token drafted before it, walking the tree
  left to right: ``DFlash2`` (its candidate selector), ``Domino`` (its GRU correction) and DSpark's
  (``decoding.proposers_dspark``, its Markov head and confidence cut).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.proposers import draft_logq
from headstart.decoding.proposers_heads import HeadProposer
from headstart.decoding.tree import Tree, empty_tree, pick_children, shaped_tree, static_tree
from headstart.decoding.tree_config import TreeSpec, chain_choices
from headstart.decoding.verify import Proposer, Sampling
from headstart.heads import DraftHead, KVCache
from headstart.heads.block import BlockDrafter
from headstart.heads.domino import DominoHead

# BlockWalk.walk's step: (the expanded nodes' tokens [k], their parents' slots [k], level) -> logits [k, V].
WalkStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class DFlash(HeadProposer):
    """A DFlash head: one forward of the block [root, mask x ``drafts``] over the target's features of every
    committed token gives a distribution per depth d = 1..drafts, all at once (the block is not causal, so
    no depth waits for another). They fill a static tree, as Medusa's heads do: node [.., j] at depth d
    holds depth d's j-th candidate; the default shape is the chain of every depth's best.

    ``drafts`` is vLLM's ``num_speculative_tokens`` (the served block is exactly this one); it defaults to
    the head's trained depth (block_size - 1), the block the head was trained on, and bounds the tree's depth.
    Greedy runs take each depth's top candidates; sampling runs draw them without replacement from each depth's
    q (lossless, as in ``Medusa``).
    """

    title = "DFlash"

    def __init__(
        self, head: DraftHead, choices: Sequence[Sequence[int]] | None = None, drafts: int | None = None
    ) -> None:
        self.check_head(head)
        self.head = cast(BlockDrafter[Any], head)
        self.drafts = drafts or head.config.trained_depth  # the block's drafting slots
        chain = [[0] * d for d in range(1, self.drafts + 1)]
        self.choices = [list(c) for c in choices] if choices is not None else chain
        self.hidden_layers = head.hidden_layers

    @property
    def choices(self) -> list[list[int]]:
        return self._choices

    @choices.setter
    def choices(self, choices: list[list[int]]) -> None:  # eval.autotune sets its comb here
        depth = max((len(c) for c in choices), default=0)
        if depth > self.drafts:
            raise ValueError(f"tree depth {depth} needs more than the block's {self.drafts} drafting slots")
        self._choices = choices

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.sampling, self.committed, self.positions = sampling, 0, positions
        self.context = [KVCache() for _ in self.head.layers]
        self.context_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # every layer's cached keys and values

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The newly committed rows' features become context: their keys and values in every layer."""
        if hidden is None or len(hidden) == 0:
            return
        positions = self.positions.rows(self.committed, len(hidden), tokens.device)
        new_kv = self.head.context_kv(hidden[None], positions[None])
        self.context_kv = [cache.append(k, v) for cache, (k, v) in zip(self.context, new_kv)]
        self.committed += len(hidden)

    def propose(self, tokens: torch.Tensor) -> Tree:
        if self.committed == 0:  # a one-token prompt: no target feature yet
            return empty_tree(tokens.device)
        logits = self.head.draft_block(tokens[-1], self.positions.at(self.committed), self.context_kv, self.drafts)
        depth = max(len(c) for c in self.choices)
        width = max(c[-1] for c in self.choices) + 1
        logq = draft_logq(logits[:depth], self.sampling)
        if self.sampling.greedy or self.sampling.acceptance == "typical":
            return static_tree(self.choices, logq.topk(width, dim=-1).indices)
        candidates, _ = pick_children(torch.zeros(depth, device=logq.device), logq, width, True)
        return static_tree(self.choices, candidates, logq.exp())

    @classmethod
    def max_depth(cls, head: DraftHead) -> int | None:
        return head.config.trained_depth  # the block's drafting slots

    @classmethod
    def served_chain(cls, head: DraftHead, k: int) -> Proposer:
        return cls(head, drafts=k)  # vLLM's block: the newest token and the slots drafting k tokens

    @classmethod
    def for_flags(cls, head: DraftHead, flags: TreeSpec) -> Proposer:
        """One forward drafts every depth at once: a chain of them (DSpark's cut by its ``min_confidence``)."""
        chain = chain_choices(min(flags.depth, head.config.trained_depth))
        return cls.for_tree(head, TreeSpec.static(chain, flags.min_confidence))

    @classmethod
    def shaped(cls, head: DraftHead, choices: list[list[int]]) -> Proposer:
        return cls(head, choices=choices)


class BlockWalk(DFlash):
    """A block drafter whose every depth also depends on the token drafted before it (DSpark's Markov head,
    DFlash-2's candidate selector): one forward of the block, then the tree left to right, node [.., j] at depth d
    holding its parent's j-th best (or j-th sampled) token under the head's ``walk_logits`` for depth d's slot and
    the parent's token, as vLLM's speculators walk their chains. Sampled runs draw every sibling group from that
    distribution (lossless, as ``shaped_tree`` drafts)."""

    title = "block walk"

    def propose(self, tokens: torch.Tensor) -> Tree:
        if self.committed == 0:  # a one-token prompt: no target feature yet
            return empty_tree(tokens.device)
        root_at, depth = self.positions.at(self.committed), max(len(c) for c in self.choices)
        hidden = self.head.draft_hidden(tokens[-1], root_at, self.context_kv, depth)
        first, after = self.walk(hidden, tokens[-1])
        sample = not (self.sampling.greedy or self.sampling.acceptance == "typical")
        tree = shaped_tree(
            draft_logq(first, self.sampling),
            lambda parents, slots, level, _visible: draft_logq(after(parents, slots, level), self.sampling),
            self.choices,
            sample,
        )
        return self.cut(tree, hidden, tokens[-1]) if len(tree) else tree

    def walk(self, hidden: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, WalkStep]:
        """(depth 1's logits [V] after ``root``, the step that gives the logits [k, V] of depth ``level`` + 1's slot
        after each of ``parents`` [k], the nodes being expanded, whose own parents hold ``parent_slots`` [k]: -1 the
        root, else the expansion they came in, in order). The slots' outputs are ``hidden`` [depth, H]; the head's
        ``walk_logits`` reads each parent's token only."""
        head = self.head

        def after(parents: torch.Tensor, _parent_slots: torch.Tensor, level: int) -> torch.Tensor:
            return head.walk_logits(hidden[level], parents)

        return head.walk_logits(hidden[0], root.view(1))[0], after

    def cut(self, tree: Tree, hidden: torch.Tensor, root: torch.Tensor) -> Tree:
        """The drafted tree, cut where the drafter doubts it (DSpark's confidence head); as drafted by default."""
        return tree


class DFlash2(BlockWalk):
    """A DFlash-2 head (``heads/dflash2.py``): depth d's top-k candidates from the block's slot, ranked by the
    candidate selector given the parent's token (vLLM drafts the greedy walk: the chain of each depth's best)."""

    title = "DFlash-2"


class Domino(BlockWalk):
    """A Domino head (``heads/domino.py``): depth d's logits are its slot's plus the correction from the GRU state
    of the path to it, the block's newest token then each drafted ancestor in turn (vLLM drafts the greedy walk);
    the first ``pure_draft_prefix_len`` depths take the slot's alone. Each expanded node's state is its parent's
    advanced by its own token, kept in expansion order."""

    title = "Domino"

    def walk(self, hidden: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, WalkStep]:
        head = cast(DominoHead, self.head)
        states = head.prefix_states(root.view(1, 1))[0]  # row 0: the root's; row s + 1: expansion slot s's

        def after(parents: torch.Tensor, parent_slots: torch.Tensor, level: int) -> torch.Tensor:
            nonlocal states
            own = head.prefix_states(parents[:, None], states[parent_slots + 1])[:, 0]
            states = torch.cat((states, own))
            return head.draft_logits_at(level, hidden[level].expand(len(parents), -1), own)

        return head.draft_logits_at(0, hidden[0], states[0]), after
