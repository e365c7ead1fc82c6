"""Hardware-aware tree tuning: pick the draft tree that maximises expected tokens/s on the machine at hand.

    python -m eval.autotune --target assets/demo-target --head runs/demo/eagle3/head \
        --bench assets/data/gsm8k_test.jsonl --out runs/autotune

1. Costs, measured here: the target's verification step (one forward over the root and n tree nodes,
   acceptance and KV commit) against n, at the bench's mean KV length and for each batch size; the head's
   drafting: a fixed part per step (reading the accepted rows, picking the root's children) and the cost
   of one drafting level against the number of nodes it expands.
2. Acceptance, measured on a calibration slice of the bench with a "comb" tree (the rank-0 chain with
   ``width`` siblings at every depth): p[d][r] = P(the target's token at depth d is the head's rank-r
   candidate | depth d - 1 was accepted on the rank-0 chain).
3. Model: a node at depth d reached by ranks (r_1..r_d) is accepted with probability prod_i p[i][r_i]
   (siblings are exclusive: the target picks one token), so a tree's expected tokens per step is
   1 + the sum of its nodes' values; the best n-node tree of depth <= D is the n most valuable nodes
   (a node is worth no more than its parent, so they form a tree). Expected tokens/s at batch B is
   B * tau / (verify_B(n) + B * draft(tree)), drafting being per sequence.
4. Validation on held-out prompts: the chosen tree, chains, other sizes and dynamic EAGLE-2 trees (EAGLE's
   default among them) decode the same prompts, interleaved prompt by prompt so that a shared CPU's load
   drifts over all of them alike; the table puts measured and predicted tau and tokens/s side by side.

The choice is written as JSON (``tree.json``; keys: ``eval.tree.TREE_KEYS`` and ``tree_config``) that
``python -m eval.acceptance --tree FILE`` reads (and picks up from a head folder by itself), as do the
exports' model cards.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import DynamicCache

from core.io import atomic_write_text
from core.models import load_model, load_tokenizer
from core.runtime import prepare_decoding, resolve_device, resolve_dtype, seed_everything
from eval.acceptance import machine, proposer_for_tree
from eval.bench import load_bench, render
from eval.proposers import Eagle, Vanilla
from eval.tree import Tree, chain
from eval.verify import Proposer, Sampling, generate, verify_batch

EAGLE_DEFAULT = {"shape": "dynamic", "total_tokens": 60, "depth": 6, "top_k": 10}  # EAGLE-2's published default


# ---------------------------------------------------------------------------------------------- model


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


@dataclass
class TreeSpec:
    """A static shape (``choices``: Medusa-style rank paths) or a dynamic EAGLE-2 tree (top_k, depth, total)."""

    shape: str  # "static" or "dynamic"
    depth: int
    top_k: int  # static: the most children any node has; dynamic: children per expanded node
    total_tokens: int  # draft nodes, root excluded
    choices: list[list[int]] | None = None

    @property
    def name(self) -> str:
        if self.total_tokens == 0:
            return "vanilla"
        if self.shape == "dynamic":
            return f"dynamic k{self.top_k} d{self.depth} n{self.total_tokens}"
        if self.top_k == 1:
            return f"chain {self.depth}"
        return f"static {self.total_tokens} (d{self.depth} w{self.top_k})"

    def level_widths(self) -> list[int]:
        """Nodes expanded by the drafter at each level below the first (the root's children need none)."""
        if self.shape == "dynamic":
            return [self.top_k] * (self.depth - 1)
        parents = {tuple(c[:-1]) for c in self.choices or [] if len(c) > 1}
        return [sum(len(p) == d for p in parents) for d in range(1, self.depth)]

    @classmethod
    def static(cls, choices: Sequence[Sequence[int]]) -> TreeSpec:
        choices = sorted((list(c) for c in choices), key=lambda c: (len(c), c))
        depth = max((len(c) for c in choices), default=0)
        return cls("static", depth, max((c[-1] + 1 for c in choices), default=0), len(choices), choices)

    @classmethod
    def from_config(cls, config: dict) -> TreeSpec:
        if config["shape"] == "static":
            return cls.static(config["choices"])
        return cls("dynamic", int(config["depth"]), int(config["top_k"]), int(config["total_tokens"]))

    def config(self) -> dict:
        return {"shape": self.shape, "choices": self.choices, "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens}  # fmt: skip


def chain_choices(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


def comb_choices(depth: int, width: int) -> list[list[int]]:
    """The rank-0 chain of ``depth`` with ``width`` candidates at every depth: one step shows the rank of the
    target's token among the head's candidates at the first depth the chain misses."""
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(width)]


def node_value(rank_probs: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """P(the node at rank path ``path`` is accepted) under the per-depth, per-rank model."""
    value = 1.0
    for depth, rank in enumerate(path):
        probs = rank_probs[depth] if depth < len(rank_probs) else ()
        value *= probs[rank] if rank < len(probs) else 0.0
    return value


def expected_tau(rank_probs: Sequence[Sequence[float]], choices: Sequence[Sequence[int]]) -> float:
    """Expected tokens committed per step (bonus included) with a tree of shape ``choices``."""
    return 1.0 + sum(node_value(rank_probs, c) for c in choices)


def tree_tau(rank_probs: Sequence[Sequence[float]], tree: Tree) -> float:
    """``expected_tau`` of a greedily drafted tree: a node's rank is its index among its siblings (they are
    stored best first, and pruning keeps a better sibling whenever it keeps a worse one)."""
    children, paths = tree.children(), {-1: []}
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
    heap = [(-node_value(rank_probs, [r]), 1, [r]) for r in range(width)]
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
                heapq.heappush(heap, (-node_value(rank_probs, child), depth + 1, child))
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


# ---------------------------------------------------------------------------------------- measurement


def _timed(device: torch.device, fn, *args) -> float:
    """Milliseconds ``fn(*args)`` takes (waiting for the device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


@torch.no_grad()
def measure_verify(
    target, context: torch.Tensor, nodes: Sequence[int], batches: Sequence[int], repeats: int
) -> dict[int, list[float]]:
    """Median ms of one verification step (forward, acceptance, KV commit) of ``batches`` sequences over a
    chain of n nodes, at KV length len(context); the cache is cropped back after every step."""
    out: dict[int, list[float]] = {}
    for batch in batches:
        cache = DynamicCache(config=target.config)
        rows = context[None].expand(batch, -1)
        target(rows[:, :-1], past_key_values=cache, use_cache=True)
        length = cache.get_seq_length()
        valid = torch.ones(batch, length, dtype=torch.bool, device=context.device)
        ms = []
        for n in nodes:
            trees, roots = [chain(context[:n])] * batch, rows[:, -1]
            times = []
            for _ in range(repeats):
                times.append(_timed(context.device, verify_batch, target, cache, valid, roots, trees, Sampling()))
                cache.crop(length - cache.get_seq_length())
            ms.append(statistics.median(times))
        out[batch] = ms
    return out


def drafting_tokens(widths: Sequence[int], repeats: int, accepted: int) -> int:
    """Context tokens ``measure_drafting`` commits after its start."""
    return 2 * len(widths) * repeats * (accepted + 1)


@torch.no_grad()
def measure_drafting(
    proposer: Proposer,
    target,
    context: torch.Tensor,
    start: int,
    widths: Sequence[int],
    repeats: int,
    accepted: int = 2,
) -> tuple[float, list[float]]:
    """(base ms, [ms of one drafting level per width]) from propose/update cycles of ``proposer`` (one that
    takes ``choices``) on the target's real features of ``context``, from KV length ``start`` on.

    Each cycle proposes, then commits the next ``accepted`` + 1 context tokens, as decoding does. k parallel
    chains of depth 3 cost two drafting levels of width k more than k children of the root alone; the
    base is the latter plus the commit (the head reading the accepted rows).
    """
    if len(context) < start + drafting_tokens(widths, repeats, accepted) + 1:
        raise ValueError(f"a context of {len(context)} tokens is too short to measure drafting from {start}")
    states = target(context[None, :-1], output_hidden_states=True).hidden_states
    hidden = torch.cat([states[i][0] for i in proposer.hidden_layers], -1) if proposer.hidden_layers else None
    m = accepted + 1

    def cycles(choices) -> tuple[float, float]:
        nonlocal start
        proposer.reset(Sampling())
        proposer.choices = choices
        proposer.update(context[: start + 1], None if hidden is None else hidden[:start])
        propose_ms, update_ms = [], []
        for _ in range(repeats):
            propose_ms.append(_timed(context.device, proposer.propose, context[: start + 1]))
            rows = None if hidden is None else hidden[start : start + m]
            update_ms.append(_timed(context.device, proposer.update, context[: start + 1 + m], rows))
            start += m
        return statistics.median(propose_ms), statistics.median(update_ms)

    level_ms, base = [], []
    for k in widths:
        one, update_ms = cycles([[r] for r in range(k)])
        three, _ = cycles([[r] + [0] * d for r in range(k) for d in range(3)])
        level_ms.append(max(three - one, 0.0) / 2)
        base.append(one + update_ms)
    return statistics.median(base), level_ms


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


class CombRecorder:
    """Wraps a proposer that takes ``choices``: drafts the comb and records which ranks the target accepted."""

    def __init__(self, proposer: Proposer, depth: int, width: int):
        self.proposer, self.depth, self.width = proposer, depth, width
        self.proposer.choices = comb_choices(depth, width)
        self.hidden_layers = proposer.hidden_layers
        self.counts, self.tree = RankCounts(), None

    def reset(self, sampling: Sampling) -> None:
        self.tree = None
        self.proposer.reset(sampling)

    def propose(self, tokens: torch.Tensor) -> Tree:
        self.tree = self.proposer.propose(tokens)
        self.proposed_len = len(tokens)
        return self.tree

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.tree is not None and len(self.tree):
            accepted = tokens[self.proposed_len : -1].tolist()  # the bonus is the last new token
            children, node, ranks = self.tree.children(), -1, []
            for token in accepted:
                kids = children[node + 1]
                rank = [int(self.tree.tokens[k]) for k in kids].index(token)
                node, ranks = kids[rank], ranks + [rank]
            self.counts.record(self.depth, self.width, ranks)
        self.proposer.update(tokens, hidden)


# ------------------------------------------------------------------------------------------ validation


def proposer_for(head, tree: TreeSpec) -> Proposer:
    return proposer_for_tree(head, tree.config()) if tree.total_tokens else Vanilla()


class TreeRecorder:
    """Wraps a proposer; keeps the model's expected tau of every tree it proposes."""

    def __init__(self, proposer: Proposer, rank_probs: Sequence[Sequence[float]]):
        self.proposer, self.rank_probs, self.expected = proposer, rank_probs, []
        self.hidden_layers = proposer.hidden_layers

    def reset(self, sampling: Sampling) -> None:
        self.proposer.reset(sampling)

    def propose(self, tokens: torch.Tensor) -> Tree:
        tree = self.proposer.propose(tokens)
        self.expected.append(tree_tau(self.rank_probs, tree))
        return tree

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.proposer.update(tokens, hidden)


@dataclass
class Measured:
    tree: TreeSpec
    new_tokens: int = 0
    wall_s: float = 0.0
    forwards: int = 0
    committed: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    predicted_tau: float = 0.0
    predicted_tokens_per_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def tau(self) -> float:
        return self.committed / max(self.forwards, 1)


@torch.no_grad()
def validate(target, head, prompts: list[torch.Tensor], trees: list[TreeSpec], costs: Costs, rank_probs,
             max_new_tokens: int, eos: int | None) -> list[Measured]:  # fmt: skip
    """Decode every prompt with every tree (greedy), interleaved prompt by prompt; vanilla should be first."""
    runs = [Measured(tree) for tree in trees]
    recorders = [TreeRecorder(proposer_for(head, tree), rank_probs) for tree in trees]
    for recorder in recorders:  # warm-up, untimed
        generate(target, recorder, prompts[0], 8, Sampling(), eos)
        recorder.expected.clear()
    for prompt in tqdm(prompts, desc="validate", leave=False):
        for run, recorder in zip(runs, recorders):
            out, stats = generate(target, recorder, prompt, max_new_tokens, Sampling(), eos)
            run.outputs.append(out[0, prompt.shape[1] :].tolist())
            run.new_tokens += out.shape[1] - prompt.shape[1]
            run.wall_s += stats.wall_time
            run.forwards += stats.target_forwards
            run.committed += sum(stats.accepted_lengths)
    for run, recorder in zip(runs, recorders):
        run.predicted_tau = statistics.fmean(recorder.expected) if recorder.expected else 1.0
        run.predicted_tokens_per_s = 1e3 * run.predicted_tau / costs.step(run.tree)
    return runs


# ------------------------------------------------------------------------------------------------- CLI


def grid(chosen: TreeSpec, rank_probs, max_depth: int) -> list[TreeSpec]:
    """The alternatives measured beside the choice: vanilla, chains, other tuned sizes, dynamic trees."""
    trees = [TreeSpec.static([]), chosen]
    trees += [TreeSpec.static(chain_choices(d)) for d in (2, 4, 6, 8) if d <= max_depth]
    for n in (6, 12, 24, 48):
        shape = best_shape(rank_probs, n, max_depth)
        if len(shape) == n:
            trees.append(TreeSpec.static(shape))
    trees += [TreeSpec.from_config(EAGLE_DEFAULT), TreeSpec("dynamic", 5, 8, 48), TreeSpec("dynamic", 6, 2, 10)]
    unique: dict[str, TreeSpec] = {}
    for tree in trees:
        unique.setdefault(json.dumps(tree.config()), tree)
    return list(unique.values())


def calibrate(target, head, prompts: list[torch.Tensor], depth: int, width: int, max_new_tokens: int, eos):
    """(rank_probs, the decoded sequences) from greedy comb decoding of ``prompts``."""
    recorder = CombRecorder(Eagle(head), depth, width)
    outputs = []
    for prompt in tqdm(prompts, desc="calibrate", leave=False):
        out, _ = generate(target, recorder, prompt, max_new_tokens, Sampling(), eos)
        outputs.append(out[0])
    return recorder.counts.rank_probs(), outputs


def tree_config(tree: TreeSpec, choice: Choice, vanilla: Choice, batch: dict, meta: dict) -> dict:
    """tree.json: the tree (``TREE_KEYS``: shape, choices, depth, top_k, total_tokens), the model's tau and
    tokens/s for it and for vanilla, ``speculate_max_batch`` (the largest measured batch size at which the
    model still prefers speculation; 0: never), and where it was tuned (machine, device, dtype, ...)."""
    return (
        tree.config()
        | {
            "predicted_tau": choice.tau,
            "predicted_tokens_per_s": choice.tokens_per_s,
            "predicted_vanilla_tokens_per_s": vanilla.tokens_per_s,
            "speculate_max_batch": max((b for b, row in batch.items() if row["speculate"]), default=0),
        }
        | meta
    )


def markdown(result: dict) -> str:
    rows = result["grid"]
    best = max(r["tokens_per_s"] for r in rows)
    lines = [
        f"# Tree auto-tuning: {result['head']}",
        "",
        f"- machine: {result['machine']} ({result['device']}, {result['dtype']}); KV length {result['kv_length']}",
        f"- calibration: {result['calibration_prompts']} prompts; held out: {result['heldout_prompts']} prompts, "
        f"{result['max_new_tokens']} new tokens, greedy",
        "- verify ms (nodes: ms, batch 1): "
        + ", ".join(f"{n}: {ms:.1f}" for n, ms in zip(result["costs"]["nodes"], result["costs"]["verify_ms"]["1"])),
        f"- drafting: base {result['costs']['base_ms']:.2f} ms, one level "
        + ", ".join(f"w{w}: {ms:.2f}" for w, ms in zip(result["costs"]["widths"], result["costs"]["level_ms"]))
        + " ms",
        "- acceptance p[depth][rank]: "
        + "; ".join(f"d{d + 1}: " + " ".join(f"{p:.2f}" for p in ps[:4]) for d, ps in enumerate(result["rank_probs"])),
        "",
        "| tree | nodes | tau measured | tau predicted | tokens/s measured | tokens/s predicted | speedup "
        "| identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " **(chosen)**" if r["chosen"] else ""
        lines.append(
            f"| {r['name']}{mark} | {r['total_tokens']} | {r['tau']:.2f} | {r['predicted_tau']:.2f} "
            f"| {r['tokens_per_s']:.1f}{' (best)' if r['tokens_per_s'] == best else ''} "
            f"| {r['predicted_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {'yes' if r['greedy_identical'] else 'NO'} |"
        )
    checks = result["checks"]
    lines += [
        "",
        f"- chosen within 10% of the best measured: {'yes' if checks['within_10pct_of_best'] else 'NO'} "
        f"({checks['chosen_vs_best']:.3f} of the best)",
        f"- chosen beats EAGLE's default tree (60 nodes, depth 6, top-k 10): "
        f"{'yes' if checks['beats_eagle_default'] else 'NO'} ({checks['chosen_vs_eagle_default']:.2f}x)",
        "",
        "## Batch size (model; drafting runs per sequence)",
        "",
        "| batch | best tree | tau | tokens/s | vanilla tokens/s | speculate |",
        "|---|---|---|---|---|---|",
    ]
    for b, row in result["batch"].items():
        lines.append(
            f"| {b} | {row['tree']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | {row['vanilla_tokens_per_s']:.1f} "
            f"| {'yes' if row['speculate'] else 'no: large batch does not benefit'} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from eval.report import _save

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    costs = result["costs"]
    for b, ms in costs["verify_ms"].items():
        left.plot(costs["nodes"], ms, marker="o", label=f"batch {b}")
    left.set_xlabel("tree nodes verified (root excluded)")
    left.set_ylabel("ms per verification step")
    left.set_title("Target verify cost")
    left.legend(fontsize="small")
    rows = result["grid"]
    for r in rows:
        style = {"marker": "*", "s": 200, "color": "red"} if r["chosen"] else {"marker": "o", "s": 40}
        right.scatter(r["predicted_tokens_per_s"], r["tokens_per_s"], **style)
        right.annotate(r["name"], (r["predicted_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
    lo = min(min(r["predicted_tokens_per_s"], r["tokens_per_s"]) for r in rows)
    hi = max(max(r["predicted_tokens_per_s"], r["tokens_per_s"]) for r in rows)
    right.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
    right.set_xlabel("predicted tokens/s")
    right.set_ylabel("measured tokens/s (held out)")
    right.set_title("Tree grid (red star: chosen)")
    fig.tight_layout()
    _save(fig, path)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m eval.autotune", description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="target model folder or hub id")
    p.add_argument("--head", required=True, help="EAGLE-1/2 or EAGLE-3 head folder")
    p.add_argument(
        "--allow-other-tokenizer",
        action="store_true",
        help="tune a head trained with another tokenizer than the target's (refused by default)",
    )
    p.add_argument("--bench", default="assets/data/gsm8k_test.jsonl", help="JSONL prompts (see eval.bench)")
    p.add_argument("--offset", type=int, default=0, help="bench prompts to skip (e.g. those a later eval uses)")
    p.add_argument("--calibration", type=int, default=8, help="prompts for the acceptance statistics")
    p.add_argument("--heldout", type=int, default=8, help="further prompts for the validation grid")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-nodes", type=int, default=48, help="largest tree the tuner considers")
    p.add_argument("--max-depth", type=int, default=8)
    p.add_argument("--comb-width", type=int, default=8, help="candidates per depth in the calibration tree")
    p.add_argument("--batch-size", type=int, default=1, help="the batch size to tune the tree for")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8], help="shown in the batch table")
    p.add_argument("--repeats", type=int, default=7, help="timings per point (the median is kept)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--dtype", default="fp32", help="fp32|bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path, help="folder for tree.json, autotune.json/.md/.png")
    p.add_argument("--write-head", action="store_true", help="also write <head>/tree.json (eval.acceptance reads it)")
    args = p.parse_args(argv)
    if args.batch_size not in args.batch_sizes:
        args.batch_sizes = sorted({*args.batch_sizes, args.batch_size})
    return args


VERIFY_NODES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
DRAFT_WIDTHS = (1, 2, 4, 8)


def main(argv: list[str] | None = None) -> dict:
    from heads import load_head

    args = parse_args(argv)
    seed_everything(args.seed)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    prepare_decoding(device)
    target, tokenizer = load_model(args.target, device, dtype), load_tokenizer(args.target)
    head = load_head(args.head, target, tokenizer, args.allow_other_tokenizer).to(dtype)
    wanted = args.offset + args.calibration + args.heldout
    items = load_bench(args.bench, wanted)[args.offset :]
    if len(items) < args.calibration + args.heldout:
        raise ValueError(f"{args.bench}: fewer than --offset + --calibration + --heldout = {wanted} prompts")
    prompts = [render(tokenizer, list(it.history) + [{"role": "user", "content": it.turns[0]}]) for it in items]
    prompts = [p.to(device) for p in prompts]
    calib, heldout = prompts[: args.calibration], prompts[args.calibration :]
    eos = tokenizer.eos_token_id

    rank_probs, decoded = calibrate(target, head, calib, args.max_depth, args.comb_width, args.max_new_tokens, eos)
    kv_length = round(statistics.fmean(p.shape[1] for p in calib) + args.max_new_tokens / 2)
    context = torch.cat(decoded)
    needed = kv_length + drafting_tokens(DRAFT_WIDTHS, args.repeats, 2) + 1
    context = context.repeat(needed // len(context) + 1)[:needed]
    nodes = [n for n in VERIFY_NODES if n <= max(args.max_nodes, EAGLE_DEFAULT["total_tokens"])]
    verify_ms = measure_verify(target, context[: kv_length + 1], nodes, args.batch_sizes, args.repeats)
    base_ms, level_ms = measure_drafting(Eagle(head), target, context, kv_length, DRAFT_WIDTHS, args.repeats)
    costs = Costs(nodes, verify_ms, list(DRAFT_WIDTHS), level_ms, base_ms)

    batch = {}
    for b in args.batch_sizes:
        best, vanilla, _ = tune(costs, rank_probs, args.max_nodes, args.max_depth, b)
        batch[b] = {"tree": best.tree.name, "config": best.tree.config(), "tau": best.tau,
                    "tokens_per_s": best.tokens_per_s, "vanilla_tokens_per_s": vanilla.tokens_per_s,
                    "speculate": best.tokens_per_s > vanilla.tokens_per_s}  # fmt: skip
    chosen, vanilla, _ = tune(costs, rank_probs, args.max_nodes, args.max_depth, args.batch_size)
    meta = {
        "machine": machine(device),
        "device": str(device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "target": str(args.target),
        "head": str(args.head),
        "bench": str(args.bench),
        "batch_size": args.batch_size,
        "tuned_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    # Written before the (long) validation, so an interrupted run still leaves its choice.
    config = tree_config(chosen.tree, chosen, vanilla, batch, meta)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "tree.json", json.dumps(config, indent=2) + "\n")
    if args.write_head:
        atomic_write_text(Path(args.head) / "tree.json", json.dumps(config, indent=2) + "\n")

    trees = grid(chosen.tree, rank_probs, args.max_depth)
    runs = validate(target, head, heldout, trees, costs, rank_probs, args.max_new_tokens, eos)
    vanilla_run = runs[0]
    rows = [
        {"name": r.tree.name, "chosen": r.tree.config() == chosen.tree.config(), **r.tree.config(), "tau": r.tau,
         "predicted_tau": r.predicted_tau, "tokens_per_s": r.tokens_per_s,
         "predicted_tokens_per_s": r.predicted_tokens_per_s,
         "speedup": r.tokens_per_s / vanilla_run.tokens_per_s, "greedy_identical": r.outputs == vanilla_run.outputs}
        for r in runs
    ]  # fmt: skip
    chosen_row = next(r for r in rows if r["chosen"])
    eagle_row = next(r for r in rows if r["name"] == TreeSpec.from_config(EAGLE_DEFAULT).name)
    best_measured = max(r["tokens_per_s"] for r in rows)
    result = meta | {
        "kv_length": kv_length,
        "calibration_prompts": len(calib),
        "heldout_prompts": len(heldout),
        "max_new_tokens": args.max_new_tokens,
        "rank_probs": rank_probs,
        "costs": asdict(costs) | {"verify_ms": {str(b): ms for b, ms in costs.verify_ms.items()}},
        "chosen": chosen.tree.config() | {"predicted_tau": chosen.tau, "predicted_tokens_per_s": chosen.tokens_per_s},
        "grid": rows,
        "batch": {str(b): row for b, row in batch.items()},
        "checks": {
            "chosen_vs_best": chosen_row["tokens_per_s"] / best_measured,
            "within_10pct_of_best": chosen_row["tokens_per_s"] >= 0.9 * best_measured,
            "chosen_vs_eagle_default": chosen_row["tokens_per_s"] / eagle_row["tokens_per_s"],
            "beats_eagle_default": chosen_row["tokens_per_s"] > eagle_row["tokens_per_s"],
        },
    }
    atomic_write_text(args.out / "autotune.json", json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    atomic_write_text(args.out / "autotune.md", md)
    plot(result, args.out / "autotune.png")
    print(md)
    return result


if __name__ == "__main__":
    main()
