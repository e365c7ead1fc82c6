"""Speedup models, pure arithmetic on measured rates and costs (measuring them is ``eval.timing``'s and
``eval.run``'s job): the chain model the acceptance report predicts with, and the tree model the tuner
(``eval.autotune``) searches with.

Tree model: a node at depth d reached by ranks (r_1..r_d) is accepted with probability prod_i p[i][r_i]
(``core.acceptance``), so a tree's expected tokens per step is 1 + the sum of its nodes' values; the best
n-node tree of depth <= D is the n most valuable nodes (a node is worth no more than its parent, so they
form a tree). Expected tokens/s at batch B is B * tau / (verify_B(n) + B * draft(tree)), drafting being
per sequence.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from headstart.core.acceptance import chain_tau, expected_tau, path_acceptance
from headstart.decoding.tree import Tree
from headstart.decoding.tree_config import EAGLE_DEFAULT, TreeSpec, chain_choices

# ------------------------------------------------------------------------------------------ chain model


def predicted_speedup(alpha: float, c: float, k: int) -> float:
    """Expected speedup of drafting k tokens per step: (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)).

    Leviathan et al. (2023), chain view: each drafted token is accepted independently with probability
    alpha given its parent was, so one target forward commits 1 + alpha + ... + alpha^k tokens on average
    (the bonus included), and a step costs k draft calls of c target forwards each plus the forward
    itself. A tree is seen as its chain of depths, alpha as the rate at which depth d is accepted once
    depth d - 1 was, so the branching only shows up as a higher alpha.
    """
    return chain_tau([alpha] * k) / (k * c + 1)


# ------------------------------------------------------------------------------------------- tree model


@dataclass
class Costs:
    """Measured (or synthetic) step costs in milliseconds; curves are interpolated linearly between points."""

    nodes: list[int]  # tree sizes the verify curve was measured at (root excluded), ascending
    verify_ms: dict[int, list[float]]  # batch size -> verify step cost at each of ``nodes``
    widths: list[int]  # expanded-node counts the level curve was measured at, ascending
    level_ms: list[float]  # one drafting level expanding that many nodes
    base_ms: float  # per speculative step and sequence: the head reading the accepted rows, the root's children

    def verify(self, n: int, batch: int = 1) -> float:
        return _interp(n, self.nodes, self.verify_ms[batch])

    def draft(self, tree: TreeSpec) -> float:
        return self.base_ms + sum(_interp(w, self.widths, self.level_ms) for w in tree.level_widths())

    def step(self, tree: TreeSpec, batch: int = 1) -> float:
        """Milliseconds per decoding step of ``batch`` sequences (vanilla: the empty tree, no drafting)."""
        if tree.total_tokens == 0:
            return self.verify(0, batch)
        return self.verify(tree.total_tokens, batch) + batch * self.draft(tree)


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past the last point."""
    if len(xs) == 1:
        return ys[0]
    i = max(1, min(len(xs) - 1, next((j for j, v in enumerate(xs) if v >= x), len(xs) - 1)))
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def tree_tau(rank_probs: Sequence[Sequence[float]], tree: Tree) -> float:
    """``expected_tau`` of a greedily drafted tree: a node's rank is its index among its siblings (they are
    stored best first, and pruning keeps a better sibling whenever it keeps a worse one)."""
    children = tree.children()
    paths: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(tree.parents.tolist()):
        paths[node] = paths[parent] + [children[parent + 1].index(node)]
    return expected_tau(rank_probs, [paths[i] for i in range(len(tree))])


def best_shape(rank_probs: Sequence[Sequence[float]], nodes: int, max_depth: int) -> list[list[int]]:
    """The ``nodes`` most valuable rank paths of depth <= ``max_depth``: the tree of that size and depth
    bound with the highest expected tau (values never grow down a path, so the set is a tree).

    Best-first from the root's children; ties go to the shallower, then lower-ranked path, so a node
    always comes after its parent.
    """
    width = max((len(p) for p in rank_probs), default=0)
    heap = [(-path_acceptance(rank_probs, [r]), 1, [r]) for r in range(width)]
    heapq.heapify(heap)
    chosen: list[list[int]] = []
    while heap and len(chosen) < nodes:
        neg_value, depth, path = heapq.heappop(heap)
        if neg_value == 0:  # the model gives it no chance: drafting it only costs
            break
        chosen.append(path)
        if depth < max_depth:
            for r in range(width):
                child = path + [r]
                heapq.heappush(heap, (-path_acceptance(rank_probs, child), depth + 1, child))
    return chosen


@dataclass
class Choice:
    tree: TreeSpec
    tau: float
    tokens_per_s: float


def predict(costs: Costs, rank_probs: Sequence[Sequence[float]], tree: TreeSpec, batch: int = 1) -> Choice:
    """Model tau and tokens/s of a static tree (vanilla: the empty one)."""
    tau = expected_tau(rank_probs, tree.choices or [])
    return Choice(tree, tau, 1e3 * batch * tau / costs.step(tree, batch))


def tune(
    costs: Costs, rank_probs: Sequence[Sequence[float]], max_nodes: int, max_depth: int, batch: int = 1
) -> tuple[Choice, Choice, list[Choice]]:
    """(the tree with the highest expected tokens/s at ``batch``, vanilla, every tree considered).

    Candidates: for each node budget n <= ``max_nodes`` and depth bound D <= ``max_depth``, the best
    n-node tree of depth <= D (a deeper bound is not always better: every level costs a draft call).
    Speculation pays off where the best tree beats vanilla; the tree is returned either way, so a
    config always names one (a head the model sees no acceptance for gets the one-node tree).
    """
    seen, candidates = set(), []
    for depth in range(1, max_depth + 1):
        for n in range(1, max_nodes + 1):
            choices = best_shape(rank_probs, n, depth)
            key = tuple(map(tuple, choices))
            if len(choices) < n or key in seen:
                continue
            seen.add(key)
            candidates.append(predict(costs, rank_probs, TreeSpec.static(choices), batch))
    candidates = candidates or [predict(costs, rank_probs, TreeSpec.static([[0]]), batch)]
    vanilla = predict(costs, rank_probs, TreeSpec.static([]), batch)
    return max(candidates, key=lambda c: c.tokens_per_s), vanilla, candidates


def batch_table(
    costs: Costs,
    rank_probs: Sequence[Sequence[float]],
    max_nodes: int,
    max_depth: int,
    batches: Sequence[int],
    chosen: TreeSpec,
) -> dict[int, dict]:
    """Per batch size: the best tree (name, config, tau, tokens/s), vanilla's tokens/s, whether to speculate,
    and the two speculation lengths to use there: ``depth``, the deepest level of ``chosen`` worth verifying
    (``capped_tokens_per_s``), and ``chain_k``, the best chain length (vLLM's num_speculative_tokens)."""
    table = {}
    for b in batches:
        best, vanilla, _ = tune(costs, rank_probs, max_nodes, max_depth, b)
        depth, capped_rate = best_cap(costs, rank_probs, chosen, b)
        chain_k = max(range(max_depth + 1), key=lambda k: predict(costs, rank_probs, chain_spec(k), b).tokens_per_s)
        table[b] = {"tree": best.tree.name, "config": best.tree.config(), "tau": best.tau,
                    "tokens_per_s": best.tokens_per_s, "vanilla_tokens_per_s": vanilla.tokens_per_s,
                    "speculate": best.tokens_per_s > vanilla.tokens_per_s, "depth": depth,
                    "capped_tokens_per_s": capped_rate, "chain_k": chain_k}  # fmt: skip
    return table


def chain_spec(k: int) -> TreeSpec:
    return TreeSpec.static(chain_choices(k))


def best_cap(costs: Costs, rank_probs: Sequence[Sequence[float]], tree: TreeSpec, batch: int) -> tuple[int, float]:
    """(depth, expected tokens/s): the depth to cut ``tree`` at when ``batch`` sequences decode together (0: plain
    decoding). ``decoding.verify.generate_batch`` cuts a drafted tree rather than drafting less, so every cut but
    0 pays the whole tree's drafting; it saves verification, which grows with batch x nodes."""
    rates = {0: predict(costs, rank_probs, TreeSpec.static([]), batch).tokens_per_s}
    for depth in range(1, tree.depth + 1):
        cut = tree.capped(depth)
        ms = costs.verify(cut.total_tokens, batch) + batch * costs.draft(tree)
        rates[depth] = 1e3 * batch * expected_tau(rank_probs, cut.choices or []) / ms
    depth = max(rates, key=lambda d: rates[d])
    return depth, rates[depth]


# ------------------------------------------------------------------------------------- adaptive depth


@dataclass
class ConfidenceStep:
    """One calibration step: the rank-0 chain's cumulative draft log-probability at each depth, and the rank
    path the target accepted (``eval.tune_runs.CombRecorder``)."""

    chain_logq: list[float]
    accepted_ranks: list[int]


def adaptive_rate(costs: Costs, tree: TreeSpec, steps: Sequence[ConfidenceStep], min_confidence: float) -> float:
    """Tokens/s of ``tree`` drafted with ``min_confidence`` (``decoding.tree.confident``) replayed on recorded steps:
    a step drafts below depth d only while the rank-0 chain's depth-d confidence reaches the threshold (the
    likeliest node of a greedy tree's level is nearly always on that chain), accepts the longest prefix of
    the target's rank path that the cut tree holds, and costs the cut tree's drafting and verification."""
    paths = {tuple(c) for c in tree.choices or []}
    tokens = ms = 0.0
    for step in steps:
        depth = tree.depth
        for d in range(1, tree.depth):
            if min_confidence > 0 and (d > len(step.chain_logq) or step.chain_logq[d - 1] < math.log(min_confidence)):
                depth = d
                break
        accepted = 0
        while accepted < min(depth, len(step.accepted_ranks)) and tuple(step.accepted_ranks[: accepted + 1]) in paths:
            accepted += 1
        tokens += 1 + accepted
        ms += costs.step(tree.capped(depth))
    return 1e3 * tokens / ms if ms else 0.0


def fit_confidence(
    costs: Costs, tree: TreeSpec, steps: Sequence[ConfidenceStep], candidates: int = 24
) -> tuple[float, float, float]:
    """(threshold, its tokens/s, fixed depth's tokens/s) on the recorded ``steps``: of 0 (fixed depth) and up to
    ``candidates`` thresholds between neighbouring recorded confidences (geometric means, so that no recorded
    value sits on a threshold), the one that replays fastest (``adaptive_rate``)."""
    values = sorted({v for step in steps for v in step.chain_logq[: max(tree.depth - 1, 0)] if math.isfinite(v)})
    picked = values[:: max(1, len(values) // candidates)]
    thresholds = [math.exp((a + b) / 2) for a, b in zip(picked, picked[1:])]
    rates = {t: adaptive_rate(costs, tree, steps, t) for t in [0.0, *thresholds]}
    best = max(rates, key=lambda t: rates[t])  # the first of equals: 0 (fixed depth) unless a threshold gains
    return best, rates[best], rates[0.0]


def grid(
    chosen: TreeSpec, rank_probs: Sequence[Sequence[float]], max_depth: int, dynamic: bool = True
) -> list[TreeSpec]:
    """The alternatives measured beside the choice: vanilla, chains, other tuned sizes, and dynamic trees for a
    head that drafts them (not P-EAGLE's or DFlash's one forward)."""
    trees = [TreeSpec.static([]), chosen]
    trees += [TreeSpec.static(chain_choices(d)) for d in (2, 4, 6, 8) if d <= max_depth]
    for n in (6, 12, 24, 48):
        shape = best_shape(rank_probs, n, max_depth)
        if len(shape) == n:
            trees.append(TreeSpec.static(shape))
    if dynamic:
        trees += [TreeSpec.from_config(EAGLE_DEFAULT), TreeSpec.dynamic(5, 8, 48), TreeSpec.dynamic(6, 2, 10)]
    unique: dict[str, TreeSpec] = {}
    for tree in trees:
        unique.setdefault(json.dumps(tree.config()), tree)
    return list(unique.values())


# --------------------------------------------------------------------------------- acceptance statistics


@dataclass
class RankCounts:
    """Per depth d: steps that tried depth d on the rank-0 chain, and hits per rank there."""

    tried: list[int] = field(default_factory=list)
    hits: list[list[int]] = field(default_factory=list)

    def record(self, depth: int, width: int, accepted_ranks: list[int]) -> None:
        """One comb step whose accepted path has these ranks (rank 0 down to its last node)."""
        while len(self.tried) < depth:
            self.tried.append(0)
            self.hits.append([0] * width)
        for d, rank in enumerate(accepted_ranks):
            self.tried[d] += 1
            self.hits[d][rank] += 1
        if len(accepted_ranks) < depth and (not accepted_ranks or accepted_ranks[-1] == 0):
            self.tried[len(accepted_ranks)] += 1  # the next depth was tried and no candidate matched

    def rank_probs(self) -> list[list[float]]:
        """p[d][r]; depths never tried are left out (the model then gives them nothing)."""
        return [[h / t for h in hits] for t, hits in zip(self.tried, self.hits) if t]
