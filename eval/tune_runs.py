"""The tree tuner's decoding runs (``eval.autotune``): calibration with a "comb" tree, validation of the chosen
tree beside the others on held-out prompts, and the same at several batch sizes (speculation by load). Every
run goes through the one verification core (``decoding.verify``) with the proposers ``eval.run`` builds.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from headstart.core.timing import timed
from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.methods import proposer_for
from headstart.decoding.proposers import ProposerWrapper
from headstart.decoding.proposers_heads import Drafter, DraftSource, head_drafter
from headstart.decoding.tree import Tree
from headstart.decoding.tree_config import Schedule, TreeSpec, comb_choices, scheduled_depth
from headstart.decoding.verify import Proposer, Sampling, generate, generate_batch
from headstart.eval.run import Tally
from headstart.eval.speedup import ConfidenceStep, Costs, RankCounts, tree_tau

# ----------------------------------------------------------------------------------- tree calibration


class CombRecorder(ProposerWrapper):
    """Wraps a proposer that takes ``choices``: drafts the comb and records which ranks the target accepted,
    and with them the rank-0 chain's draft confidence at each depth (what adaptive depth is fitted on)."""

    def __init__(self, proposer: Drafter, depth: int, width: int) -> None:
        super().__init__(proposer)
        self.depth, self.width = depth, width
        proposer.choices = comb_choices(depth, width)
        self.counts = RankCounts()
        self.steps: list[ConfidenceStep] = []
        self.tree: Tree | None = None

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.tree = None
        super().reset(sampling, positions)

    def propose(self, tokens: torch.Tensor) -> Tree:
        tree = self.tree = self.proposer.propose(tokens)
        self.proposed_len = len(tokens)
        return tree

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        if self.tree is not None and len(self.tree):
            accepted = tokens[self.proposed_len : -1].tolist()  # the bonus is the last new token
            children, node = self.tree.children(), -1
            ranks: list[int] = []
            for token in accepted:
                kids = children[node + 1]
                rank = [int(self.tree.tokens[k]) for k in kids].index(token)
                node, ranks = kids[rank], ranks + [rank]
            self.counts.record(self.depth, self.width, ranks)
            self.steps.append(ConfidenceStep(chain_logq(self.tree), ranks))
        super().update(tokens, hidden)


def chain_logq(tree: Tree) -> list[float]:
    """The drafter's estimate that the target accepts each depth of the tree's rank-0 chain (first children), in
    log: the cumulative draft log-probability, or the drafter's own estimate where it gives one (``Tree.survival``)."""
    children, node, total, out = tree.children(), -1, 0.0, []
    while children[node + 1]:
        node = children[node + 1][0]
        total += float(tree.draft_logprobs[node])
        out.append(total if tree.survival is None else float(tree.survival[node]))
    return out


def calibrate(
    target: PreTrainedModel,
    head: DraftSource,
    prompts: list[torch.Tensor],
    depth: int,
    width: int,
    max_new_tokens: int,
    eos: int | None,
) -> tuple[list[list[float]], list[torch.Tensor], list[ConfidenceStep]]:
    """(rank_probs, the decoded sequences, every step's chain confidences and accepted ranks) from greedy
    decoding of ``prompts`` with a "comb" tree (the rank-0 chain with ``width`` siblings at every depth):
    p[d][r] = P(the target's token at depth d is the head's rank-r candidate | depth d - 1 was accepted on
    the rank-0 chain)."""
    recorder = CombRecorder(head_drafter(head), depth, width)
    outputs = []
    for prompt in tqdm(prompts, desc="calibrate", leave=False):
        out, _ = generate(target, recorder, prompt, max_new_tokens, Sampling(), eos)
        outputs.append(out[0])
    return recorder.counts.rank_probs(), outputs, recorder.steps


# ------------------------------------------------------------------------------------ tree validation


class TreeRecorder(ProposerWrapper):
    """Wraps a proposer; keeps the model's expected tau of every tree it proposes."""

    def __init__(self, proposer: Proposer, rank_probs: Sequence[Sequence[float]]) -> None:
        super().__init__(proposer)
        self.rank_probs = rank_probs
        self.expected: list[float] = []

    def propose(self, tokens: torch.Tensor) -> Tree:
        tree = self.proposer.propose(tokens)
        self.expected.append(tree_tau(self.rank_probs, tree))
        return tree


@dataclass(kw_only=True)
class Measured(Tally):
    tree: TreeSpec
    outputs: list[list[int]] = field(default_factory=list)
    predicted_tau: float = 0.0
    predicted_tokens_per_s: float = 0.0


@torch.no_grad()
def validate(
    target: PreTrainedModel,
    head: DraftSource,
    prompts: list[torch.Tensor],
    trees: list[TreeSpec],
    costs: Costs,
    rank_probs: Sequence[Sequence[float]],
    max_new_tokens: int,
    eos: int | None,
) -> list[Measured]:
    """Decode every prompt with every tree (greedy), interleaved prompt by prompt so that a shared CPU's load
    drifts over all of them alike; vanilla should be first."""
    runs = [Measured(tree=tree) for tree in trees]
    recorders = [TreeRecorder(proposer_for(head, tree), rank_probs) for tree in trees]
    for recorder in recorders:  # warm-up, untimed
        generate(target, recorder, prompts[0], 8, Sampling(), eos)
        recorder.expected.clear()
    for prompt in tqdm(prompts, desc="validate", leave=False):
        for run, recorder in zip(runs, recorders):
            out, stats = generate(target, recorder, prompt, max_new_tokens, Sampling(), eos)
            run.outputs.append(out[0, prompt.shape[1] :].tolist())
            run.add(out.shape[1] - prompt.shape[1], stats)
    for run, recorder in zip(runs, recorders):
        run.predicted_tau = statistics.fmean(recorder.expected) if recorder.expected else 1.0
        run.predicted_tokens_per_s = 1e3 * run.predicted_tau / costs.step(run.tree)
    return runs


@torch.no_grad()
def validate_batches(
    target: PreTrainedModel,
    head: DraftSource,
    prompts: list[torch.Tensor],
    tree: TreeSpec,
    schedule: Schedule,
    sizes: Sequence[int],
    max_new_tokens: int,
    eos: int | None,
) -> list[dict]:
    """Speculation by load, measured: per batch size b, the first b ``prompts`` decoded together
    (``generate_batch``, greedy) plainly, with ``tree`` at every step, and with ``tree`` cut as ``schedule``
    says for the sequences still decoding; tokens/s of each and whether both reproduce the plain run."""
    runs = {"vanilla": (TreeSpec.static([]), None), "fixed": (tree, None), "scheduled": (tree, schedule)}
    rows = []
    for size in tqdm(sizes, desc="batches", leave=False):
        batch, outputs = prompts[:size], {}
        row: dict = {"batch_size": size, "depth": scheduled_depth(schedule, size)}
        for name, (spec, by_load) in runs.items():
            proposers = [proposer_for(head, spec) for _ in batch]
            generate_batch(target, proposers, batch, 4, Sampling(), eos, by_load)  # warm-up, untimed
            (outs, _), seconds = timed(
                target.device, generate_batch, target, proposers, batch, max_new_tokens, Sampling(), eos, by_load
            )
            outputs[name] = [out[0, p.shape[1] :].tolist() for out, p in zip(outs, batch)]
            row[f"{name}_tokens_per_s"] = sum(map(len, outputs[name])) / seconds
        row["greedy_identical"] = outputs["fixed"] == outputs["vanilla"] == outputs["scheduled"]
        rows.append(row)
    return rows


def validation_rows(runs: list[Measured], chosen: TreeSpec) -> list[dict]:
    """The grid table: per tree, measured and predicted tau and tokens/s, speedup over the first run
    (vanilla) and whether its greedy output matched vanilla's."""
    vanilla = runs[0]
    return [
        {"name": r.tree.name, "chosen": r.tree.config() == chosen.config(), **r.tree.config(), "tau": r.tau,
         "predicted_tau": r.predicted_tau, "tokens_per_s": r.tokens_per_s,
         "predicted_tokens_per_s": r.predicted_tokens_per_s,
         "speedup": r.tokens_per_s / vanilla.tokens_per_s, "greedy_identical": r.outputs == vanilla.outputs}
        for r in runs
    ]  # fmt: skip


def validation_checks(rows: list[dict], eagle_default: TreeSpec) -> dict:
    """Whether the chosen tree is within 10% of the best measured one and beats ``eagle_default`` (None where
    that was not measured: P-EAGLE and DFlash draft no dynamic trees)."""
    chosen = next(r for r in rows if r["chosen"])
    eagle = next((r for r in rows if r["name"] == eagle_default.name), None)
    best = max(r["tokens_per_s"] for r in rows)
    return {
        "chosen_vs_best": chosen["tokens_per_s"] / best,
        "within_10pct_of_best": chosen["tokens_per_s"] >= 0.9 * best,
        "chosen_vs_eagle_default": chosen["tokens_per_s"] / eagle["tokens_per_s"] if eagle else None,
        "beats_eagle_default": chosen["tokens_per_s"] > eagle["tokens_per_s"] if eagle else None,
    }
