"""The trained heads' drafters, each a ``HeadProposer`` registered for a head type's drafting method
(``head_proposers``):

- ``Eagle``: EAGLE-1/2 and EAGLE-3 heads drafting a dynamic EAGLE-2 tree from the target's features.
- ``PEagle``: a P-EAGLE head (EAGLE-3 with ``parallel_drafting``) drafting every depth in one forward, handed
  over as a chain or as a static tree of each depth's top candidates.
- ``Medusa``: Medusa heads filling a static tree from their per-head candidates.
- ``DFlash``: a DFlash block drafter: one forward drafts every depth at once, handed over as a chain or as
  a static tree of each depth's top candidates.

and what a head (or a draft model) drafts with by default, as ``eval.autotune`` tunes it (``head_drafter``).
Greedy runs propose top-k tokens; sampling runs draw from the draft's q and hand it to the verifier
(``decoding.proposers``, whose ``draft_logq`` they share).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, cast

import torch
from transformers import PreTrainedModel

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.head_proposers import head_proposer, head_types_of
from headstart.decoding.proposers import DraftModel, draft_logq
from headstart.decoding.tree import (
    MC_SIM_7B_63,
    SMALL_CHOICES,
    Tree,
    dynamic_tree,
    empty_tree,
    pick_children,
    shaped_tree,
    static_tree,
)
from headstart.decoding.tree_config import TreeSpec, chain_choices
from headstart.decoding.verify import Proposer, Sampling, probabilities
from headstart.heads import DraftHead, KVCache, drafting_of
from headstart.heads.base import FeatureDrafter
from headstart.heads.block import BlockDrafter
from headstart.heads.domino import DominoHead
from headstart.heads.eagle3 import Eagle3Head
from headstart.heads.medusa import MedusaHead

# BlockWalk.walk's step: (the expanded nodes' tokens [k], their parents' slots [k], level) -> logits [k, V].
WalkStep = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


class HeadProposer:
    """A proposer that drafts with a trained head, registered for a drafting method (``head_proposers``). Built
    in its default shape (``cls(head)``), from the tree flags (``for_flags``: a ``TreeSpec``) or from a tuned tree
    (``for_tree``)."""

    title: ClassVar[str]  # "EAGLE drafting needs ..."
    level_by_level: ClassVar[bool] = False  # each tree level costs a draft forward (then stopping early pays)
    tunable: ClassVar[bool] = True  # drafts the shape a tree.json gives (eval.autotune tunes it)

    hidden_layers: tuple[int, ...]
    choices: Any  # the static shape it drafts (Eagle: None for its dynamic tree)

    def __init__(self, head: DraftHead) -> None:
        raise NotImplementedError

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        raise NotImplementedError

    def propose(self, tokens: torch.Tensor) -> Tree:
        raise NotImplementedError

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        raise NotImplementedError

    @classmethod
    def served_chain(cls, head: DraftHead, k: int) -> Proposer:
        """What an engine serving the head with ``num_speculative_tokens: k`` drafts (served parity)."""
        raise NotImplementedError(f"no engine serves {cls.title} drafting")

    @classmethod
    def for_flags(cls, head: DraftHead, flags: TreeSpec) -> Proposer:
        """Its usual drafting at the flags' sizes: their ``min_confidence`` only where it ``adapts_depth``."""
        raise NotImplementedError

    @classmethod
    def max_depth(cls, head: DraftHead) -> int | None:
        """The deepest tree it can draft (None: no bound of its own)."""
        return None

    @classmethod
    def adapts_depth(cls, head: DraftHead) -> bool:
        """Whether it drafts with ``min_confidence`` (stopping below a level it doubts): level-by-level drafters."""
        return cls.level_by_level

    @classmethod
    def for_tree(cls, head: DraftHead, tree: TreeSpec) -> Proposer:
        """Every depth from one forward (the default): static shapes only, at a fixed depth."""
        if not cls.tunable:
            raise ValueError(f"{cls.title} drafts its own fixed tree, not a tuned one")
        if tree.shape != "static":
            title = drafting_of(head.config).title
            raise ValueError(
                f"{title} drafts static shapes only (every depth from one forward), not a {tree.shape} tree"
            )
        if tree.min_confidence > 0:
            raise ValueError(
                "adaptive depth (min_confidence) needs a drafter that drafts level by level; "
                f"{drafting_of(head.config).method} drafts every depth in one forward"
            )
        return cls.shaped(head, tree.choices or [])

    @classmethod
    def shaped(cls, head: DraftHead, choices: list[list[int]]) -> Proposer:
        """This proposer drafting the static shape ``choices``."""
        raise NotImplementedError

    @classmethod
    def check_head(cls, head: DraftHead) -> None:
        """ValueError unless ``head``'s type drafts with this proposer (in any of its draftings)."""
        kinds = head_types_of(cls)
        if head.config.type in kinds:
            return
        article = "an" if kinds and kinds[0][0] in "aeiou" else "a"
        named = " or ".join(kinds) if len(kinds) < 3 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
        raise ValueError(f"{cls.title} drafting needs {article} {named} head, not a {head.config.type} head")


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


def per_depth_tree(logp: torch.Tensor, choices: list[list[int]], sampling: Sampling) -> Tree:
    """The static tree ``choices`` from draft log-probs per depth [D, V] that do not depend on the tokens
    above (Medusa's heads, P-EAGLE's parallel depths). Greedy and typical-acceptance runs take each depth's
    top candidates; exact sampling draws them without replacement from each depth's q, shared by every
    parent, and hands the q over (the verifier's rejection sampling needs it to stay lossless)."""
    width = max(c[-1] for c in choices) + 1
    if sampling.greedy or sampling.acceptance == "typical":
        return static_tree(choices, logp.topk(width, dim=-1).indices)
    q = probabilities(logp, sampling)
    candidates, _ = pick_children(torch.zeros(len(q), device=q.device), q.log(), width, True)
    return static_tree(choices, candidates, q)


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
    of the path to it, the block's newest token then each drafted ancestor in turn (vLLM drafts the greedy walk).
    Each expanded node's state is its parent's advanced by its own token, kept in expansion order."""

    title = "Domino"

    def walk(self, hidden: torch.Tensor, root: torch.Tensor) -> tuple[torch.Tensor, WalkStep]:
        head = cast(DominoHead, self.head)
        states = head.prefix_states(root.view(1, 1))[0]  # row 0: the root's; row s + 1: expansion slot s's

        def after(parents: torch.Tensor, parent_slots: torch.Tensor, level: int) -> torch.Tensor:
            nonlocal states
            own = head.prefix_states(parents[:, None], states[parent_slots + 1])[:, 0]
            states = torch.cat((states, own))
            return head.corrected_logits(hidden[level].expand(len(parents), -1), own)

        return head.corrected_logits(hidden[0], states[0]), after


Drafter = HeadProposer | DraftModel  # a proposer that takes a tree shape (``choices``)
# What ``eval.autotune`` tunes a tree for: a head, or a draft model (a small LM, or the target's early exit).
DraftSource = DraftHead | PreTrainedModel


def head_drafter(source: DraftSource) -> Drafter:
    """The proposer a head or draft model drafts with, in its default shape; ``eval.autotune`` sets its
    ``choices``."""
    if not isinstance(source, DraftHead):
        return DraftModel(source, choices=[[0]])
    proposer = head_proposer(source.config)
    if not proposer.tunable:
        raise ValueError(
            f"{proposer.title} drafts its own fixed tree: there is no tree to tune for a {source.config.type} head"
        )
    return proposer(source)


def tree_depth_bound(source: DraftSource, max_depth: int) -> int:
    """The deepest tree to tune for ``source``: ``max_depth``, or less where its proposer drafts no deeper (DFlash:
    its block's mask slots)."""
    if isinstance(source, DraftHead):
        bound = head_proposer(source.config).max_depth(source)
        return max_depth if bound is None else min(max_depth, bound)
    return max_depth


def adapts_depth(source: DraftSource) -> bool:
    """Whether drafting can stop where the drafter doubts (``min_confidence``): it drafts level by level, or it
    estimates acceptance itself (DSpark's confidence head: a shorter draft costs less verification)."""
    if not isinstance(source, DraftHead):
        return True
    return head_proposer(source.config).adapts_depth(source)


def drafts_level_by_level(source: DraftSource) -> bool:
    """Whether each tree level costs a draft forward (EAGLE heads, draft models): then stopping early saves
    drafting, and dynamic trees can be drafted. P-EAGLE, DFlash and Medusa draft every depth at once."""
    return not isinstance(source, DraftHead) or head_proposer(source.config).level_by_level
