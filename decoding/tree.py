"""Draft trees: what every proposer hands the verifier, and the attention layout that verifies them.

A tree hangs below the ROOT, the newest committed token (the "pending" one, whose KV is not yet in the
target's cache). Nodes are stored in topological order (a parent before its children) and siblings in
the order they were drawn: the sampling verifier walks them in that order. A chain is a tree whose
node i has parent i - 1; the empty tree is plain autoregressive decoding.

Draft distributions, for lossless sampling: ``dists`` [g, V] holds each sibling group's draft
probabilities ONCE (the distribution a parent's children were drawn from, without replacement, in
their stored order) and ``dist_index`` [n] points every node to its group's row. ``dists=None`` means
the tokens are deterministic proposals (n-gram lookup, greedy top-k): each is a point mass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch

# Medusa's default 63-node tree for Vicuna-7B (medusa/model/medusa_choices.py, ``mc_sim_7b_63``): a path
# [i, j] is the j-th candidate of head 2 below the i-th candidate of head 1.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5],
    [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9],
    [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1],
    [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0],
    [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]  # fmt: skip
# A small default for tiny heads: 2 candidates at depth 1, then narrowing.
SMALL_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]


@dataclass
class Tree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, index of the parent node; -1 = child of the root
    depths: torch.Tensor  # [n] long, 1 for children of the root
    draft_logprobs: torch.Tensor  # [n] float, log q(token | parent)
    dists: torch.Tensor | None = None  # [g, V] draft probabilities per sibling group; None = point masses
    dist_index: torch.Tensor | None = None  # [n] row of ``dists`` each node was drawn from
    # A drafter with its own acceptance estimate (DSpark's confidence head): [n] the log-probability it gives that
    # the target accepts the path to each node. Adaptive depth reads it in place of the draft's own path logq.
    survival: torch.Tensor | None = None
    # The drafter's own reader of what the target scored on this tree, not only on the accepted path (lookahead
    # decoding learns from every row): the decoding loop hands it the target's argmax [n + 1] at [root, nodes...]
    # once the tree is verified. A tree cut or rebuilt from this one is another draft, without it.
    on_target_argmax: Callable[[torch.Tensor], None] | None = field(default=None, repr=False, compare=False)
    _ancestors: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return self.tokens.numel()

    def ancestors(self) -> torch.Tensor:
        """Bool [n, n]: [i, j] when node j is node i or one of its ancestors (computed once: the attention
        mask and the acceptance both need it)."""
        if self._ancestors is None:
            n = len(self)
            eye = torch.eye(n, dtype=torch.bool, device=self.tokens.device)
            anc = eye
            has_parent = (self.parents >= 0)[:, None]
            for _ in range(int(self.depths.max()) - 1 if n else 0):
                anc = eye | (anc[self.parents.clamp(min=0)] & has_parent)
            self._ancestors = anc
        return self._ancestors

    def sibling_dist(self, node: int) -> torch.Tensor | None:
        """The draft distribution [V] ``node`` was drawn from; None for point masses."""
        if self.dists is None:
            return None
        if self.dist_index is None:
            raise ValueError("a tree with draft distributions needs dist_index: each node's row of dists")
        return self.dists[self.dist_index[node]]

    def children(self) -> list[list[int]]:
        """Children of the root (entry 0) and of every node i (entry i + 1), in their stored order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i)
        return kids


def is_chain(tree: Tree) -> bool:
    """Whether node i's parent is node i - 1 for every node (the empty tree is a chain)."""
    return bool((tree.parents == torch.arange(len(tree), device=tree.parents.device) - 1).all())


def first_chain(tree: Tree) -> Tree:
    """The chain of first children from the root down: each kept node is the first one drawn from its sibling
    group, so it keeps its group's distribution and the chain verifies as losslessly as the tree did."""
    children, node, nodes = tree.children(), -1, []
    while children[node + 1]:
        node = children[node + 1][0]
        nodes.append(node)
    index = torch.tensor(nodes, dtype=torch.long, device=tree.tokens.device)
    steps = torch.arange(len(nodes), device=tree.tokens.device)
    dist_index = None if tree.dist_index is None else tree.dist_index[index]
    return Tree(tree.tokens[index], steps - 1, steps + 1, tree.draft_logprobs[index], tree.dists, dist_index)


def empty_tree(device: torch.device) -> Tree:
    none = torch.empty(0, dtype=torch.long, device=device)
    return Tree(none, none, none, torch.empty(0, device=device))


def chain(tokens: torch.Tensor, dists: torch.Tensor | None = None) -> Tree:
    """A chain of ``tokens`` [k]; ``dists`` [k, V] when token i was sampled from row i."""
    k = tokens.numel()
    steps = torch.arange(k, device=tokens.device)
    if dists is None:
        return Tree(tokens, steps - 1, steps + 1, torch.zeros(k, device=tokens.device))
    return Tree(tokens, steps - 1, steps + 1, dists[steps, tokens].log(), dists, steps)


def tree_from_parents(
    tokens: Sequence[int],
    parents: Sequence[int],
    device: torch.device,
    on_target_argmax: Callable[[torch.Tensor], None] | None = None,
) -> Tree:
    """A tree of deterministic proposals (point masses) from each node's token and parent (-1 = the root),
    a parent before its children; ``on_target_argmax`` as ``Tree``'s."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)

    def longs(values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return Tree(
        longs(tokens), longs(parents), longs(depths), torch.zeros(len(tokens), device=device),
        on_target_argmax=on_target_argmax,
    )  # fmt: skip


@lru_cache(maxsize=16)
def _static_shape(choices: tuple[tuple[int, ...], ...]) -> tuple[list[int], list[int], list[int]]:
    """(parents, depths, candidate rank) of a Medusa choice list, sorted by depth then path."""
    paths = sorted(choices, key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(paths)}
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
    if missing:
        raise ValueError(f"tree choices {missing} lack their parent path")
    parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
    return parents, [len(p) for p in paths], [p[-1] for p in paths]


def static_tree(choices: Sequence[Sequence[int]], candidates: torch.Tensor, dists: torch.Tensor | None = None) -> Tree:
    """A Medusa tree: path [.., j] at depth d holds ``candidates[d - 1, j]`` ([D, K] per-depth candidate lists).

    ``dists`` [D, V]: the per-depth draft distributions, given when the candidates were sampled (without
    replacement, in rank order); every node at depth d was drawn from row d - 1.
    """
    parents, depths, ranks = _static_shape(tuple(tuple(c) for c in choices))
    device = candidates.device
    depths_t = torch.tensor(depths, device=device)
    tokens = candidates[depths_t - 1, torch.tensor(ranks, device=device)]
    rows = depths_t - 1
    logprobs = torch.zeros(len(depths), device=device) if dists is None else dists[rows, tokens].log()
    return Tree(
        tokens, torch.tensor(parents, device=device), depths_t, logprobs, dists, rows if dists is not None else None
    )


# expand(tokens [k], parent_slots [k], depth, visible [k, E]) -> draft log-probs [k, V] of the k frontier
# nodes. Frontier nodes take cache slots E - k .. E - 1 of the drafter (after its committed prefix);
# parent_slots index the earlier slots (-1 = the root); visible[i, s] is True when slot s holds node i
# itself or one of its ancestors (the drafter's tree attention mask over its drafted slots).
Expand = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def pick_children(scores: torch.Tensor, logq: torch.Tensor, k: int, sample: bool) -> tuple[torch.Tensor, ...]:
    """Top-k children of each row by score (greedy), or k draws without replacement (Gumbel-top-k).

    Returns (token ids [r, k], their scores [r, k]). Sampled scores are Kool et al.'s top-down
    stochastic beam search keys: a child's key is a Gumbel, truncated at its parent's key, whose value
    given the earlier siblings does not depend on which token it is. Ranking, frontier choice and
    pruning on these keys therefore never select a node for being a particular token, which keeps the
    sibling-by-sibling rejection sampling in ``verify`` exact.
    """
    if not sample:
        top = (scores[:, None] + logq).topk(k, dim=-1)
        return top.indices, top.values
    perturbed = scores[:, None] + logq - torch.empty_like(logq).exponential_().log()
    z = perturbed.max(-1, keepdim=True).values
    gap = perturbed - z  # <= 0; log(1 - exp(gap)) written stably
    log1mexp = torch.where(gap > -math.log(2), torch.log(-torch.expm1(gap)), torch.log1p(-torch.exp(gap)))
    v = scores[:, None] - perturbed + log1mexp
    keys = scores[:, None] - v.clamp(min=0) - torch.log1p(torch.exp(-v.abs()))
    keys = keys.masked_fill(perturbed == -math.inf, -math.inf)  # never drawable (also avoids -inf - -inf)
    top = perturbed.topk(k, dim=-1)
    return top.indices, keys.gather(-1, top.indices)


class DraftSlots:
    """The drafter's cache slots for expanded tree nodes, and which of them each new slot may attend to.

    Expanded nodes take the drafter's slots in expansion order, after its committed prefix. Row s + 1 of
    ``anc`` lists the slots that are slot s or its ancestors; row 0 (the root) sees none of them.
    """

    def __init__(self, device: torch.device) -> None:
        self.slot_of = torch.empty(0, dtype=torch.long, device=device)  # per tree node; -1 = not expanded
        self.anc = torch.zeros(1, 0, dtype=torch.bool, device=device)

    def add_nodes(self, count: int) -> None:
        self.slot_of = torch.cat((self.slot_of, self.slot_of.new_full((count,), -1)))

    def expand(self, frontier: torch.Tensor, parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Give the ``frontier`` nodes the next slots: (their parents' slots [k], -1 = root; visible [k, E])."""
        e, k = self.anc.shape[1], len(frontier)
        parent = parents[frontier]
        parent_slots = torch.where(parent >= 0, self.slot_of[parent.clamp(min=0)], -1)
        own = torch.cat((self.anc[parent_slots + 1], torch.eye(k, dtype=torch.bool, device=frontier.device)), 1)
        self.anc = torch.cat((torch.cat((self.anc, self.anc.new_zeros(e + 1, k)), 1), own))
        self.slot_of[frontier] = torch.arange(e, e + k, device=frontier.device)
        return parent_slots, own


def kept_parents(keep: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The parents of the ``keep`` nodes (an ancestor-closed set), as indices among the kept nodes (-1: root)."""
    new_index = keep.long().cumsum(0) - 1
    kept = parents[keep]
    return torch.where(kept >= 0, new_index[kept.clamp(min=0)], -1)


def _kept_tree(
    keep: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    logq_rows: list[torch.Tensor],
    dist_index: torch.Tensor,
    sample: bool,
) -> Tree:
    """The Tree of the ``keep`` nodes (ancestor-closed, in topological order), parents renumbered."""
    kept_tokens, kept_index = tokens[keep], dist_index[keep]
    logq = torch.cat(logq_rows)
    return Tree(
        kept_tokens,
        kept_parents(keep, parents),
        depths[keep],
        logq[kept_index, kept_tokens],
        logq.exp() if sample else None,  # greedy trees are point masses: no [g, V] exp per step
        kept_index if sample else None,
    )


def dynamic_tree(
    root_logq: torch.Tensor,
    expand: Expand,
    top_k: int,
    depth: int,
    total_tokens: int,
    sample: bool = False,
    min_confidence: float = 0.0,
) -> Tree:
    """EAGLE-2's dynamic tree from the root's draft log-probs [V].

    Each level gives every frontier node its top_k children by cumulative draft log-probability (or
    k sampled children, see ``pick_children``); the top_k best new nodes form the next frontier, for
    ``depth`` levels, or fewer where the frontier is not confident enough (``confident``). The best
    ``total_tokens`` nodes overall are kept, with their ancestors, in topological order. With ``sample``
    every node's sibling group keeps the distribution it was drawn from.
    """
    device = root_logq.device
    kids, scores = pick_children(torch.zeros(1, device=device), root_logq[None], top_k, sample)
    tokens, scores = kids[0], scores[0]
    parents = torch.full((top_k,), -1, device=device)
    depths = torch.ones(top_k, dtype=torch.long, device=device)
    logq_rows, dist_index = [root_logq[None]], torch.zeros(top_k, dtype=torch.long, device=device)
    path_logq = root_logq[tokens]
    frontier = torch.arange(top_k, device=device)
    slots = DraftSlots(device)
    slots.add_nodes(top_k)
    for level in range(2, depth + 1):
        if not confident(path_logq[frontier], min_confidence):
            break
        k = len(frontier)
        parent_slots, visible = slots.expand(frontier, parents)
        logq = expand(tokens[frontier], parent_slots, level - 1, visible)
        kids, kid_scores = pick_children(scores[frontier], logq, top_k, sample)
        n = len(tokens)
        tokens, scores = torch.cat((tokens, kids.flatten())), torch.cat((scores, kid_scores.flatten()))
        path_logq = torch.cat((path_logq, (path_logq[frontier, None] + logq.gather(1, kids)).flatten()))
        parents = torch.cat((parents, frontier.repeat_interleave(top_k)))
        depths = torch.cat((depths, torch.full((kids.numel(),), level, device=device)))
        group = sum(len(rows) for rows in logq_rows) + torch.arange(k, device=device).repeat_interleave(top_k)
        dist_index = torch.cat((dist_index, group))
        logq_rows.append(logq)
        slots.add_nodes(kids.numel())
        frontier = n + kid_scores.flatten().topk(top_k).indices
    finite = scores.isfinite()
    keep = torch.zeros(len(tokens), dtype=torch.bool, device=device)
    keep[scores.masked_fill(~finite, -math.inf).topk(min(total_tokens, len(tokens))).indices] = True
    keep &= finite  # a token the drafter gives probability 0 was never drawn
    for _ in range(int(depths.max()) - 1):  # a kept node keeps its ancestors
        keep[parents[keep & (parents >= 0)]] = True
    return _kept_tree(keep, tokens, parents, depths, logq_rows, dist_index, sample)


@dataclass(frozen=True)
class _Level:
    nodes: torch.Tensor  # the level's nodes (tree order)
    frontier: torch.Tensor  # their distinct parents, ascending: the nodes expanded to draft them
    row: torch.Tensor  # per node: its parent's row in ``frontier``
    rank: torch.Tensor  # per node: its candidate rank among its parent's children
    width: int  # candidates to pick per expanded node


@lru_cache(maxsize=16)
def _levels(
    choices: tuple[tuple[int, ...], ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[_Level]]:
    """(parents, depths, levels) of a choice list, in ``_static_shape``'s node order; built once per shape,
    as every drafting step of a run reuses them."""
    parents, depths, ranks = _static_shape(choices)
    levels = []
    for depth in range(1, max(depths) + 1):
        nodes = [i for i, d in enumerate(depths) if d == depth]
        frontier = sorted({parents[i] for i in nodes})
        row = [frontier.index(parents[i]) for i in nodes]
        rank = [ranks[i] for i in nodes]
        node_ids, frontier_ids, rows, ranks_ = (torch.tensor(x, device=device) for x in (nodes, frontier, row, rank))
        levels.append(_Level(node_ids, frontier_ids, rows, ranks_, max(rank) + 1))
    return torch.tensor(parents, device=device), torch.tensor(depths, device=device), levels


def shaped_tree(
    root_logq: torch.Tensor,
    expand: Expand,
    choices: Sequence[Sequence[int]],
    sample: bool = False,
    min_confidence: float = 0.0,
) -> Tree:
    """A tree of fixed shape (Medusa-style ``choices``: path [i, j] = the j-th child of the i-th child of
    the root) drafted level by level by an autoregressive drafter: each level expands only the nodes the
    shape gives children, and node [.., j] holds its parent's j-th best (or j-th sampled) candidate.
    Drafting stops early, the shape cut at that depth, where the nodes to expand are not ``confident``.

    Ranks follow the cumulative scores of ``pick_children``, as in ``dynamic_tree``, so a shape that
    ``dynamic_tree`` would also build gets the same tokens. A node the drafter gives probability 0 is
    dropped with its subtree.
    """
    device = root_logq.device
    parents, depths, levels = _levels(tuple(tuple(c) for c in choices), device)
    n = len(parents)
    tokens = torch.zeros(n, dtype=torch.long, device=device)
    scores = torch.zeros(n, device=device)
    path_logq = torch.zeros(n, device=device)
    dist_index = torch.zeros(n, dtype=torch.long, device=device)
    logq_rows = [root_logq[None]]
    slots = DraftSlots(device)
    slots.add_nodes(n)
    drafted = 0  # the depth drafted so far
    for depth, level in enumerate(levels, 1):
        nodes, frontier, row, rank = level.nodes, level.frontier, level.row, level.rank
        if depth == 1:
            logq, parent_scores = root_logq[None], torch.zeros(1, device=device)
            parent_logq = parent_scores
        else:
            if not confident(path_logq[frontier], min_confidence):
                break
            parent_slots, visible = slots.expand(frontier, parents)
            logq, parent_scores = expand(tokens[frontier], parent_slots, depth - 1, visible), scores[frontier]
            parent_logq = path_logq[frontier]
            logq_rows.append(logq)
        kids, kid_scores = pick_children(parent_scores, logq, level.width, sample)
        tokens[nodes], scores[nodes] = kids[row, rank], kid_scores[row, rank]
        path_logq[nodes] = parent_logq[row] + logq[row, tokens[nodes]]
        dist_index[nodes] = sum(len(rows) for rows in logq_rows) - len(logq) + row
        drafted = depth
    # Scores are cumulative (keys truncated at the parent's), so a dropped node's subtree is dropped too.
    keep = scores.isfinite() & (depths <= drafted)
    return _kept_tree(keep, tokens, parents, depths, logq_rows, dist_index, sample)


def confident(path_logq: torch.Tensor, min_confidence: float) -> bool:
    """Whether to draft below nodes whose cumulative draft log-probabilities are ``path_logq``: when the
    likeliest of them reaches ``min_confidence`` (0: always). That product of draft probabilities estimates
    the chance the target accepts the path (EAGLE-2's observation), so a level below an unlikely frontier
    mostly costs drafting and verification for nothing. The decision reads only the draft's own
    probabilities, never the target's, so sampled runs stay lossless (a draft that stops early is still a
    draft)."""
    return min_confidence <= 0 or float(path_logq.max()) >= math.log(min_confidence)


def capped(tree: Tree, depth: int) -> Tree:
    """``tree`` without its nodes deeper than ``depth`` (the tree itself when none is). The cut depends on
    no token, so the verifier's sibling-by-sibling sampling stays exact on what is left."""
    if not len(tree) or int(tree.depths.max()) <= depth:
        return tree
    keep = tree.depths <= depth
    return Tree(
        tree.tokens[keep],
        kept_parents(keep, tree.parents),
        tree.depths[keep],
        tree.draft_logprobs[keep],
        tree.dists,
        None if tree.dist_index is None else tree.dist_index[keep],
        survival=None if tree.survival is None else tree.survival[keep],
    )


def confident_depth(tree: Tree, level_logq: torch.Tensor, min_confidence: float) -> Tree:
    """``tree`` cut below its first level whose nodes are not ``confident`` by ``level_logq`` [n] (each node's
    estimate that the target accepts its path): the rule ``shaped_tree`` applies while drafting, applied to a
    tree drafted whole. The cut below level d depends only on tokens at depths <= d, never on the nodes it drops,
    so sampled runs stay lossless."""
    if min_confidence <= 0 or not len(tree):
        return tree
    for depth in range(1, int(tree.depths.max())):
        if not confident(level_logq[tree.depths == depth], min_confidence):
            return capped(tree, depth)
    return tree


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool [q, k] or [B, q, k] (True = attend) -> the additive float [1 or B, 1, q, k] mask HF models take.

    The finite minimum rather than -inf: a query that sees nothing (padding) gets a uniform softmax, not NaN.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask.view(-1, 1, *allowed.shape[-2:])


def tree_batch_inputs(
    valid: torch.Tensor, trees: list[Tree], dtype: torch.dtype, queries: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [B, n + 1], additive mask [B, 1, n + 1, P + n + 1], position ids [B, n + 1]) of the queries
    [root, nodes..., padding] of every sequence, n the largest tree or ``queries`` - 1 if more; ``valid``
    [B, P] marks each sequence's committed cache slots. Input ids hold the tree tokens; the caller fills in the
    roots (column 0).

    A query sees its sequence's valid slots and root; a node also sees its ancestors and itself; padding
    queries see only the root (their outputs are ignored, their keys never visible). A root sits at its
    sequence's committed length, a node ``depth`` positions further.
    """
    batch, prefix = valid.shape
    n, device = max(max(len(t) for t in trees), queries - 1), valid.device
    ids = torch.zeros(batch, n + 1, dtype=torch.long, device=device)
    allowed = torch.zeros(batch, n + 1, prefix + n + 1, dtype=torch.bool, device=device)
    allowed[:, :, :prefix] = valid[:, None]
    allowed[:, :, prefix] = True
    depths = torch.zeros(batch, n + 1, dtype=torch.long, device=device)
    for b, tree in enumerate(trees):
        m = len(tree)
        ids[b, 1 : m + 1] = tree.tokens
        allowed[b, 1 : m + 1, prefix + 1 : prefix + m + 1] = tree.ancestors()
        depths[b, 1 : m + 1] = tree.depths
    positions = valid.sum(1, keepdim=True) + depths  # a sequence's root sits at its committed length
    return ids, additive_mask(allowed, dtype), positions
