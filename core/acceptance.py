"""The acceptance-length model: expected tokens one verification step commits, for a chain or a tree.

A draft node is accepted when its parent was and the target picks its token. With p[d][r] the
probability that the target's token at depth d is the drafter's rank-r candidate (given depth d - 1
was accepted), a node reached by ranks (r_1..r_d) is accepted with probability prod_i p[i][r_i]. Siblings
exclude each other (the target picks one token), so a step commits 1 (the target's own bonus token)
plus the sum of its nodes' acceptance probabilities:

    tau = 1 + sum over nodes of prod_i p[i][r_i]

A chain is the tree of rank-0 nodes; with per-depth rates a_1..a_k this is 1 + a_1 + a_1 a_2 + ... +
a_1...a_k. Training predicts it from held-out top-1 accuracies, eval from measured acceptance rates,
and the tree tuner from per-rank rates.
"""

from __future__ import annotations

from collections.abc import Sequence


def path_acceptance(rank_probs: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """P(the node at rank path ``path`` is accepted); a depth or rank without a rate is never accepted."""
    value = 1.0
    for depth, rank in enumerate(path):
        probs = rank_probs[depth] if depth < len(rank_probs) else ()
        value *= probs[rank] if rank < len(probs) else 0.0
    return value


def expected_tau(rank_probs: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens committed per step (bonus included) with a tree of shape ``choices`` (rank paths)."""
    return 1.0 + sum(path_acceptance(rank_probs, c) for c in choices)


def chain_tau(rates: Sequence[float]) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1...a_k: ``expected_tau`` of a k-token chain whose depth j is accepted
    with probability a_j once depth j - 1 was."""
    return expected_tau([[a] for a in rates], [[0] * d for d in range(1, len(rates) + 1)])


def chain_acceptance(proposed_depths: list[int], accepted: list[int]) -> tuple[list[float | None], float]:
    """(acceptance rate per depth, pooled alpha) from each step's tree depth and accepted draft count.

    Depth d is tried in a step whose tree reaches depth d and which accepted depth d - 1; its rate is
    accepted / tried, None when never tried. The pooled alpha (all accepts over all tries) is the
    maximum-likelihood per-token acceptance of the chain model above, truncated at each step's own depth.
    A step that proposed nothing (an n-gram miss) tries nothing, so for such methods the model, which
    drafts k every step, is optimistic.
    """
    depth = max(proposed_depths, default=0)
    tried = [sum(p >= d and a >= d - 1 for p, a in zip(proposed_depths, accepted)) for d in range(1, depth + 1)]
    hits = [sum(a >= d for a in accepted) for d in range(1, depth + 1)]
    by_depth = [h / t if t else None for h, t in zip(hits, tried)]
    return by_depth, sum(hits) / sum(tried) if sum(tried) else 0.0
