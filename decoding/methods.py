"""The proposer of every decoding method: one place that turns a method name, the tree to draft (the tree flags, or a
tuned tree.json, both a ``TreeSpec``) and the models (a draft model, the target, trained heads) into the
``Proposer`` the verification core drives.

Used by the evaluation harness (``eval.acceptance``, ``eval.autotune``), export checks and training's measured
acceptance (``train.measured``): every consumer decodes a method the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import torch
from pydantic import Field
from transformers import PreTrainedModel

from headstart.core.settings import Count, Float, Section
from headstart.decoding.head_proposers import head_proposer, proposer_of
from headstart.decoding.proposers import DraftModel, NGram, ProposerWrapper, SelfSpec, Vanilla, early_exit
from headstart.decoding.proposers_heads import DraftSource, tree_depth_bound
from headstart.decoding.proposers_lookup import Lookahead, Suffix
from headstart.decoding.target_cache import recurrent_target, why_chains
from headstart.decoding.tree import Tree, first_chain, is_chain
from headstart.decoding.tree_config import TREE_SHAPES, TreeShape, TreeSpec, check_tree_vocab, load_tree
from headstart.decoding.verify import Proposer
from headstart.heads import DraftHead, HeadConfig, HeadFolder, draftings

log = logging.getLogger(__name__)

# The methods that draft without a trained head; each registered head type adds its own (``head_methods``).
MODEL_METHODS = ("vanilla", "ngram", "suffix", "lookahead", "draft_model", "self_spec")


def head_methods() -> tuple[str, ...]:
    """The methods that draft with a trained head: every registered head type's (``heads.draftings``)."""
    return tuple(draftings())


def all_methods() -> tuple[str, ...]:
    """Every decoding method, those without a head first."""
    return MODEL_METHODS + head_methods()


class TreeSettings(Section):
    """The tree flags of the commands that decode (``eval.acceptance``'s section is made of these): declared
    once, here, with their defaults; the drafters get them as a ``TreeSpec`` (``tree_spec``)."""

    tree: str | None = Field(
        None,
        description="static: chains (Medusa: its fixed tree); dynamic: EAGLE-2 trees for draft_model, self_spec and "
        "EAGLE (n-gram and DFlash stay chains, Medusa a fixed tree); a tree.json FILE (eval.autotune): the tree of "
        "EAGLE and DFlash methods (DFlash: static ones), or of draft_model / self_spec (with its exit layer) when "
        "tuned for them; null: chains for ngram/draft_model/self_spec/DFlash, EAGLE and DFlash a head folder's "
        "tree.json, else EAGLE dynamic; suffix and lookahead draft their own trees",
    )
    top_k_draft: Count = Field(8, description="children per node in dynamic trees")
    depth: Count = Field(5, description="draft length / tree depth (suffix: the most nodes it drafts)")
    total_tokens: Count = Field(48, description="tree nodes kept (dynamic and Medusa trees)")
    exit_layer: Count | None = Field(
        None, description="self_spec: the target's first N layers (with its final norm and lm_head) draft; null: half"
    )
    min_confidence: Float = Field(
        0.0,
        ge=0,
        le=1,
        description="adaptive depth: stop drafting below the first level whose best path is estimated to pass "
        "verification with less than this chance (EAGLE, draft_model, self_spec: the draft's own probability; "
        "DSpark: its confidence head); 0: the full depth; a tree.json carries its own",
    )

    def tree_shape(self) -> TreeShape | None:
        """The shape ``tree`` names, if it names one (else each method's usual, or a tree.json's)."""
        return next((shape for shape in TREE_SHAPES if shape == self.tree), None)

    def tree_file(self) -> Path | None:
        """The tree.json ``tree`` names, if it names one."""
        return Path(self.tree) if self.tree is not None and self.tree not in TREE_SHAPES else None

    def tree_spec(self) -> TreeSpec:
        """The flags as the tree the methods draft when no tree.json says otherwise: ``shape`` None (each method's
        usual: chains for ngram, draft_model, self_spec and DFlash, Medusa's fixed tree, EAGLE's dynamic tree),
        "static" (chains; Medusa its fixed tree) or "dynamic" (EAGLE-2 trees for draft_model, self_spec and EAGLE
        too; DFlash stays a chain); ``file``: the tree.json --tree names. suffix drafts a tree of at most ``depth``
        nodes, lookahead its window and pool n-grams (own sizes)."""
        return TreeSpec(
            shape=self.tree_shape(),
            depth=self.depth,
            top_k=self.top_k_draft,
            total_tokens=self.total_tokens,
            min_confidence=self.min_confidence,
            exit_layer=self.exit_layer,
            file=self.tree_file(),
        )


def build_proposer(
    method: str,
    flags: TreeSpec,
    draft: PreTrainedModel | None = None,
    heads: dict[str, DraftHead] | None = None,
    tuned: TreeSpec | None = None,
    target: PreTrainedModel | None = None,
) -> Proposer:
    """The proposer of ``method`` (``all_methods()``): ``draft`` for draft_model, ``target`` for self_spec,
    ``heads[method]`` for the head methods; an EAGLE, DFlash, draft_model or self_spec method drafts the ``tuned``
    tree (a tree.json's; self_spec's names its exit layer) when given, else the tree ``flags``
    (``TreeSettings.tree_spec``).

    On a recurrent ``target`` (linear attention, Mamba: ``decoding.target_cache``) every method drafts chains: the
    verifier cannot run a tree's siblings through the recurrence in one forward."""
    if method not in all_methods():
        raise ValueError(f"unknown method {method!r}; known: {list(all_methods())}")
    # DraftModel crops its drafter's cache after every step, which a recurrent layer's state cannot undo.
    if method == "draft_model" and draft is not None and recurrent_target(draft):
        raise ValueError(f"draft_model crops its draft's cache, but {why_chains(draft)}")
    depth = drafted_depth(method, flags, heads, tuned)
    if target is None or not recurrent_target(target) or method == "vanilla":
        return _build(method, flags, draft, heads, tuned, target)
    if method == "self_spec":
        raise ValueError(f"self_spec drafts with the target's layers and crops their cache, but {why_chains(target)}")
    log.warning("%s drafts chains of %d (its tree settings are set aside): %s", method, depth, why_chains(target))
    chains = flags.model_copy(update={"shape": "static"})
    return ChainOnly(_build(method, chains, draft, heads, None, target))


def drafted_depth(method: str, flags: TreeSpec, heads: dict[str, DraftHead] | None, tuned: TreeSpec | None) -> int:
    """How deep ``method`` drafts under the tree ``flags``: their depth, or its head's limit where that is less (a
    block drafter's slots), said once here where the flags asked for more (a tuned tree is its own depth)."""
    if tuned is not None or heads is None or method not in heads:
        return flags.depth
    depth = tree_depth_bound(heads[method], flags.depth)
    if depth < flags.depth:
        log.warning(
            "%s drafts at most %d tokens a step (its head's limit): depth %d is cut to it", method, depth, flags.depth
        )
    return depth


def _build(
    method: str,
    flags: TreeSpec,
    draft: PreTrainedModel | None,
    heads: dict[str, DraftHead] | None,
    tuned: TreeSpec | None,
    target: PreTrainedModel | None,
) -> Proposer:
    if method == "vanilla":
        return Vanilla()
    if method == "ngram":
        return NGram(k=flags.depth)
    if method == "suffix":
        return Suffix(k=flags.depth)
    if method == "lookahead":
        return Lookahead()
    if method in ("draft_model", "self_spec"):
        drafter = draft if method == "draft_model" else target
        if drafter is None:
            raise ValueError(f"the {method} method needs a {'draft' if method == 'draft_model' else 'target'} model")
        if tuned is not None:  # tuned by eval.autotune --draft / --self-spec (which names the exit layer)
            source = drafter if method == "draft_model" else early_exit(drafter, self_spec_exit_layer(tuned))
            return proposer_for(source, tuned)
        model = (
            partial(DraftModel, drafter) if method == "draft_model" else partial(SelfSpec, drafter, flags.exit_layer)
        )
        if flags.shape == "dynamic":
            return model(
                k=flags.depth, top_k=flags.top_k, total_tokens=flags.total_tokens, min_confidence=flags.min_confidence
            )
        return model(k=flags.depth, min_confidence=flags.min_confidence)
    if heads is None or method not in heads:
        raise ValueError(f"the {method} method needs its head")
    head = heads[method]
    proposer = proposer_of(method)
    if tuned is not None and proposer.tunable:  # a tuned tree.json (Medusa drafts its own fixed tree)
        return proposer_for(head, tuned)
    if flags.min_confidence > 0 and not proposer.adapts_depth(head):
        raise ValueError(
            f"min_confidence (adaptive depth) needs a drafter that drafts level by level or estimates acceptance "
            f"itself; {method} drafts every depth in one forward"
        )
    return proposer.for_flags(head, flags)


def self_spec_exit_layer(tree: TreeSpec) -> int:
    """The target layers a self_spec tree.json drafts with: it names them (eval.autotune --self-spec writes it)."""
    if tree.exit_layer is None:
        raise ValueError(f"{tree.file or 'tree config'}: a self_spec tree needs its 'exit_layer' (eval.autotune "
                         "--self-spec writes it)")  # fmt: skip
    return tree.exit_layer


class ChainOnly(ProposerWrapper):
    """A proposer whose trees are cut to their chain of first children (``tree.first_chain``), for targets that
    verify chains only. Static flags already make most methods draft chains; suffix, lookahead and Medusa draw
    their own trees. Lookahead then learns from no verified window (its tree gets no target argmax)."""

    def propose(self, tokens: torch.Tensor) -> Tree:
        tree = self.proposer.propose(tokens)
        return tree if is_chain(tree) else first_chain(tree)


def proposer_for(source: DraftSource, tree: TreeSpec) -> Proposer:
    """The one rule for how a head (or a draft model: ``DraftModel``, the target's early exit) drafts ``tree``;
    vanilla for the empty tree. P-EAGLE and DFlash draft every depth in one forward, so they fill static
    shapes only, at a fixed depth."""
    if not tree.total_tokens:
        return Vanilla()
    if isinstance(source, DraftHead):
        return head_proposer(source.config).for_tree(source, tree)
    if tree.shape == "static":
        return DraftModel(source, choices=tree.choices, min_confidence=tree.min_confidence)
    return DraftModel(source, tree.depth, tree.top_k, tree.total_tokens, min_confidence=tree.min_confidence)


def draft_vocab_size(config: HeadConfig) -> int:
    """The tokens a head drafts from: its reduced draft vocabulary, else the target's; from its config alone."""
    return min(config.options.draft_vocab() or config.vocab_size, config.vocab_size)


def tuned_trees(heads: dict[str, HeadFolder], flags: TreeSpec, wanted: Sequence[str] = ()) -> dict[str, TreeSpec]:
    """Head method that drafts tuned trees -> the tree.json it decodes with: the flags' ``file`` when given, else its
    head folder's tree.json (as ``eval.autotune --write-head`` leaves it); a ``shape`` in the flags and methods
    without one get none. A tree.json tuned for a draft model or self-speculation (its ``method``) goes to that one
    of the ``wanted`` methods."""
    found = {}
    if flags.file is not None:
        tuned = load_tree(flags.file)
        if tuned.method in ("draft_model", "self_spec") and tuned.method in wanted:
            if tuned.method == "self_spec":
                self_spec_exit_layer(tuned)  # refused here, before any model loads
            found[tuned.method] = tuned
    for method, head in heads.items():
        path = flags.file or Path(head.path) / "tree.json"
        tunable = proposer_of(method).tunable
        if tunable and flags.shape is None and path.is_file():
            found[method] = load_tree(path)
            check_tuned_for(found[method], method, path)
            # From the head's config: a head folder's own tree.json fails here, before any model loads.
            check_tree_vocab(found[method], draft_vocab_size(head.config), str(path), f"the head {head.path}")
    return found


def check_tuned_for(tree: TreeSpec, method: str, path: Path) -> None:
    """Refuse a tree.json tuned for another drafter (its ``method``): its shape and schedule were measured for that
    drafter's acceptance and cost, not this one's. A tree.json that names no drafter is taken as it is."""
    if tree.method is not None and tree.method != method:
        raise ValueError(
            f"{path} was tuned for {tree.method}, not {method}: tune one for it (python -m eval.autotune) or draft "
            "in a shape of the flags (--tree static or dynamic)"
        )
