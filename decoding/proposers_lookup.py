"""Lookup proposers: drafts looked up in what the sequence (and the target's own guesses) already hold, no draft model.

- ``Suffix``: suffix decoding (SuffixDecoding, vLLM's ``suffix`` method): the longest suffix of the context that
  occurred earlier, and a tree of the continuations that followed it, ranked by how often they did.
- ``Lookahead``: lookahead decoding (Fu et al. 2024): a Jacobi window of guesses, run by the target inside the
  verification forward, fills an n-gram pool; the pool's n-grams that start with the pending root are drafted.

Both propose fixed tokens (point masses, ``dists`` None): greedy runs are the target's own decoding and sampled
runs stay lossless by the verifier's rule for deterministic drafts, as for ``decoding.proposers.NGram``.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable

import torch

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.proposers import Vanilla
from headstart.decoding.tree import Tree, empty_tree, tree_from_parents
from headstart.decoding.verify import Sampling


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of the substring that ends here


class SuffixIndex:
    """Occurrence counts of every substring of at most ``depth`` tokens of a growing text: a suffix trie cut at
    ``depth`` (SuffixDecoding's bounded suffix tree), grown by one token in O(depth).

    ``suffixes`` holds the nodes of the text's suffixes of 1 .. depth - 1 tokens, longest first: appending a
    token extends each of them (and the empty one) by that token.
    """

    def __init__(self, depth: int) -> None:
        self.depth, self.root, self.length = depth, _Node(), 0
        self.suffixes: list[_Node] = []

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            grown = []
            for node in (*self.suffixes, self.root):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                child.count += 1
                grown.append(child)
            self.suffixes = grown[-(self.depth - 1) :] if self.depth > 1 else []
            self.length += 1

    def match(self, max_length: int) -> tuple[_Node, int] | None:
        """(node, length) of the longest suffix of at most ``max_length`` tokens that occurred earlier with a
        token after it, or None. The suffix's own occurrence has nothing after it yet, so a node with children
        is an earlier one."""
        for i, node in enumerate(self.suffixes):
            length = len(self.suffixes) - i
            if length <= max_length and node.children:
                return node, length
        return None


class Suffix(Vanilla):
    """Suffix decoding over the prompt and the text generated so far.

    The longest suffix of the context (at most ``max_match`` tokens) that occurred earlier is matched in a
    ``SuffixIndex``; the continuations that followed it form the draft tree, grown best first by their
    estimated probability (the product along the path of count(child) / count(siblings together)) while it is
    at least ``min_prob``. The tree has at most ``k`` nodes, and at most ``spec_factor`` x the match length
    (SuffixDecoding's adaptive speculation length: a short match is weak evidence).
    """

    def __init__(self, k: int = 5, max_match: int = 16, min_prob: float = 0.1, spec_factor: float = 1.0) -> None:
        self.k, self.max_match, self.min_prob, self.spec_factor = k, max_match, min_prob, spec_factor

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.index = SuffixIndex(self.max_match + self.k)

    def propose(self, tokens: torch.Tensor) -> Tree:
        self.index.extend(tokens[self.index.length :].tolist())
        found = self.index.match(self.max_match)
        if found is None:
            return empty_tree(tokens.device)
        node, length = found
        budget = min(self.k, math.ceil(self.spec_factor * length))
        drafted: list[int] = []
        parents: list[int] = []
        # (-probability, order seen, (token, node), parent slot): ties go to the continuation seen first.
        frontier = [(-prob, order, continuation, -1) for order, (prob, continuation) in enumerate(self._ranked(node))]
        heapq.heapify(frontier)
        order = len(frontier)
        while frontier and len(drafted) < budget:
            neg_prob, _, (token, child), parent = heapq.heappop(frontier)
            if -neg_prob < self.min_prob:
                break
            drafted.append(token)
            parents.append(parent)
            for prob, continuation in self._ranked(child):
                heapq.heappush(frontier, (neg_prob * prob, order, continuation, len(drafted) - 1))
                order += 1
        return tree_from_parents(drafted, parents, tokens.device)

    @staticmethod
    def _ranked(node: _Node) -> list[tuple[float, tuple[int, _Node]]]:
        """(probability, (token, node)) of each continuation of ``node``, given ``node``."""
        total = sum(child.count for child in node.children.values())
        return [(child.count / total, (token, child)) for token, child in node.children.items()]


class Lookahead(Vanilla):
    """Lookahead decoding: a Jacobi window of ``ngram - 1`` levels of ``window`` guesses and a pool of n-grams.

    The window rides in the verification forward as part of the tree, with no change to the verifier's
    attention: level 0 is a chain below the root (guesses for the next ``window`` positions) and the token of
    level l > 0 in column i hangs below level l - 1's token in column i, so each window token sees the root,
    level 0 up to its column and one token of each level below it: the paper's lookahead-branch mask, one
    position further per level. The target's argmax at every row comes back through the tree's
    ``Tree.on_target_argmax``; its outputs at the top level are the next Jacobi level (the oldest is dropped),
    and column i's tokens from level 0 up, with the top one's output, are an n-gram of consecutive positions
    whose last token is the target's own choice after the others. Those n-grams, and those of the prompt and
    the committed text, fill the pool, keyed by their first token (the ``guesses`` latest per key).

    The drafts are the pool's n-grams that start with the pending root (their tails merged into a trie) and the
    window itself: all fixed tokens, verified like any others, so the output is lossless whatever the window
    holds. The window is seeded with the context's last tokens and is not re-aligned when a step accepts
    several tokens (as in the paper: the pool keys n-grams by content, not position).
    """

    def __init__(self, window: int = 4, ngram: int = 4, guesses: int = 4) -> None:
        if ngram < 2:
            raise ValueError(f"lookahead n-grams need at least 2 tokens, got ngram={ngram}")
        self.window, self.ngram, self.guesses = window, ngram, guesses

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.text: list[int] = []  # the committed tokens
        self.indexed = 0  # n-grams of ``text`` starting before this are in the pool
        self.pool: dict[int, dict[tuple[int, ...], None]] = {}  # first token -> tails, oldest first
        self.levels: list[list[int]] = []  # the Jacobi window, oldest level first
        self.target_argmax: torch.Tensor | None = None  # at [root, nodes...] of the last verified draft
        self.level_nodes: list[list[int]] = []  # the tree slots of each window level's tokens

    def add_ngram(self, ngram: Iterable[int]) -> None:
        first, *tail = ngram
        tails = self.pool.setdefault(first, {})
        tails.pop(tuple(tail), None)  # a repeat becomes the latest
        tails[tuple(tail)] = None
        if len(tails) > self.guesses:
            del tails[next(iter(tails))]

    def propose(self, tokens: torch.Tensor) -> Tree:
        self.text.extend(tokens[len(self.text) :].tolist())
        for start in range(self.indexed, len(self.text) - self.ngram + 1):
            self.add_ngram(self.text[start : start + self.ngram])
        self.indexed = max(self.indexed, len(self.text) - self.ngram + 1)
        if not self.levels:
            self.levels = [(self.text[-self.window :] * self.window)[: self.window]]
        drafted: list[int] = []
        parents: list[int] = []
        trie: dict[tuple[int, int], int] = {}  # (parent slot, token) -> slot
        for tail in reversed(self.pool.get(self.text[-1], {})):  # the latest first
            parent = -1
            for token in tail:
                if (parent, token) not in trie:
                    trie[parent, token] = len(drafted)
                    drafted.append(token)
                    parents.append(parent)
                parent = trie[parent, token]
        self.level_nodes = []
        for level, guesses in enumerate(self.levels):
            below = self.level_nodes[-1] if level else []
            nodes: list[int] = []
            for column, token in enumerate(guesses):
                chain_parent = nodes[-1] if column else -1
                parents.append(below[column] if level else chain_parent)
                nodes.append(len(drafted))
                drafted.append(token)
            self.level_nodes.append(nodes)
        return tree_from_parents(drafted, parents, tokens.device, on_target_argmax=self.read_target_argmax)

    def read_target_argmax(self, argmax: torch.Tensor) -> None:
        """Keep the target's argmax [n + 1] at [root, nodes...] of the draft just verified, for ``update``."""
        self.target_argmax = argmax

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.target_argmax is None:
            return
        argmax = self.target_argmax.tolist()
        outputs = [argmax[node + 1] for node in self.level_nodes[-1]]  # row 0 is the root
        if len(self.levels) < self.ngram - 1:  # still filling the window
            self.levels.append(outputs)
        else:
            for column, output in enumerate(outputs):
                self.add_ngram([guesses[column] for guesses in self.levels] + [output])
            self.levels = self.levels[1:] + [outputs]
        self.target_argmax = None
