"""What every trained head's drafter is, and what a head (or a draft model) drafts with by default.

- ``HeadProposer``: a proposer drafting with a trained head, registered for a head type's drafting method
  (``decoding.head_proposers``). The package's are, by family: the feature drafters ``Eagle`` and ``PEagle``
  (``decoding.proposers_eagle``), ``Medusa`` (``decoding.proposers_medusa``) and the block drafters ``DFlash``,
  ``DFlash2`` and ``Domino`` (``decoding.proposers_block``), ``DSpark`` (``decoding.proposers_dspark``).
- ``per_depth_tree``: the static tree of draft log-probs per depth that do not depend on the tokens above (Medusa's
  heads, P-EAGLE's parallel depths).
- ``head_drafter`` and the rules ``eval.autotune`` tunes by: a head's drafter in its default shape, the deepest tree
  it drafts, whether it adapts its depth, whether it drafts level by level.

Greedy runs propose top-k tokens; sampling runs draw from the draft's q and hand it to the verifier
(``decoding.proposers``, whose ``draft_logq`` they share).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers import PreTrainedModel

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.head_proposers import head_proposer, head_types_of
from headstart.decoding.proposers import DraftModel
from headstart.decoding.tree import Tree, pick_children, static_tree
from headstart.decoding.tree_config import TreeSpec
from headstart.decoding.verify import Proposer, Sampling, probabilities
from headstart.heads import DraftHead, drafting_of


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
