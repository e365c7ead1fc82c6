"""Decoding runs: every method over a benchmark (``eval.acceptance``), through the one verification core
(``decoding.verify.generate``) with the proposers ``decoding.methods`` builds.

Greedy runs must reproduce vanilla decoding token for token; where a method's output leaves vanilla's,
``divergence`` says where and whether the target's logits there were a near-tie (reduced-precision
rounding) or a real choice (a bug).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.acceptance import chain_acceptance
from headstart.core.runtime import seed_everything
from headstart.core.vision import on_model, with_text_after
from headstart.data_recipes.bench import BenchItem, turn_prompt
from headstart.decoding.verify import Proposer, Sampling, Stats, generate
from headstart.eval.results import CategoryResult, MethodResult
from headstart.eval.speedup import predicted_speedup
from headstart.eval.timing import TimedProposer, peak_memory_mb

WARMUP_TOKENS = 16

# ------------------------------------------------------------------------------------------- tallies


@dataclass
class Tally:
    """What decoding runs add up: new tokens, wall seconds (``generate``'s own clock: prefill and decoding,
    not the chat template), target forwards and tokens committed (bonus included)."""

    new_tokens: int = 0
    wall_s: float = 0.0
    forwards: int = 0
    committed: int = 0

    def add(self, new_tokens: int, stats: Stats) -> None:
        self.new_tokens += new_tokens
        self.wall_s += stats.wall_time
        self.forwards += stats.target_forwards
        self.committed += sum(stats.accepted_lengths)

    def merge(self, other: Tally) -> None:
        """Add ``other``'s sums: a group of categories is the sum of theirs (``eval.matrix``)."""
        self.new_tokens += other.new_tokens
        self.wall_s += other.wall_s
        self.forwards += other.forwards
        self.committed += other.committed

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def tau(self) -> float:
        return self.committed / max(self.forwards, 1)

    def speedup_over(self, baseline: Tally | None) -> float:
        """tokens/s over ``baseline``'s (0.0 without a baseline or with one that decoded nothing)."""
        base = baseline.tokens_per_s if baseline is not None else 0.0
        return self.tokens_per_s / base if base else 0.0


# ------------------------------------------------------------------------------ methods on a benchmark


@dataclass
class MethodRun(Tally):
    ids: list[str] = field(default_factory=list)  # item ids, in run order
    outputs: list[list[list[int]]] = field(default_factory=list)  # per item: new tokens per turn
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per target forward
    by_category: dict[str, Tally] = field(default_factory=dict)
    timer: TimedProposer = field(kw_only=True)
    peak_memory_mb: float = 0.0


def decode_item(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    proposer: Proposer,
    item: BenchItem,
    max_new_tokens: int,
    sampling: Sampling,
    prompt_format: str = "auto",
) -> Iterator[tuple[torch.Tensor, Stats]]:
    """Yield (new tokens [n], stats) per turn; each turn is asked after the model's own previous answer, its
    prompt in ``prompt_format`` (``data_recipes.bench.turn_prompt``)."""
    answers: list[str] = []
    for _ in item.turns:
        prompt = turn_prompt(tokenizer, item, answers, prompt_format).to(target.device)
        out, stats = generate(target, proposer, prompt, max_new_tokens, sampling, tokenizer.eos_token_id, item.vision)
        new = out[0, prompt.shape[1] :]
        answers.append(cast(str, tokenizer.decode(new, skip_special_tokens=True)))
        yield new, stats


def warm_up(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    proposer: Proposer,
    item: BenchItem,
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    prompt_format: str = "auto",
) -> None:
    """An untimed short decode, so that first-call costs (allocation, kernel selection) are nobody's time."""
    seed_everything(seed)
    tokens = min(WARMUP_TOKENS, max_new_tokens)
    for _ in decode_item(target, tokenizer, proposer, item, tokens, sampling, prompt_format):
        pass


def decode_into(
    run: MethodRun,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    item: BenchItem,
    max_new_tokens: int,
    sampling: Sampling,
    prompt_format: str = "auto",
) -> None:
    """Decode ``item`` with ``run``'s proposer (prompts in ``prompt_format``) and add its tokens, stats and peak
    memory to ``run``."""
    device = target.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    category = run.by_category.setdefault(item.category, Tally())
    run.ids.append(item.id)
    run.outputs.append([])
    hooks = [
        target.register_forward_pre_hook(run.timer.before_forward),
        target.register_forward_hook(run.timer.after_forward),
    ]
    try:
        for new, stats in decode_item(target, tokenizer, run.timer, item, max_new_tokens, sampling, prompt_format):
            run.outputs[-1].append(new.tolist())
            run.accepted.extend(n - 1 for n in stats.accepted_lengths)
            run.add(len(new), stats)
            category.add(len(new), stats)
    finally:
        for hook in hooks:
            hook.remove()
    run.peak_memory_mb = max(run.peak_memory_mb, peak_memory_mb(device))


def run_methods(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    proposers: dict[str, Proposer],
    items: list[BenchItem],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int,
    prompt_format: str = "auto",
) -> dict[str, MethodRun]:
    """Every method (in the order given, the speedup baseline first) over every item, its prompts in
    ``prompt_format``, after an untimed warm-up each.

    The methods take turns item by item, so a change in the machine's load during the run falls on every
    method alike and the speedups stay fair on a shared CPU. Each (item, method) decode starts from the
    seed ``seed + the item's index``: a method's output does not depend on which methods run beside it.
    """
    for proposer in proposers.values():
        warm_up(target, tokenizer, proposer, items[0], max_new_tokens, sampling, seed, prompt_format)
    runs = {method: MethodRun(timer=TimedProposer(proposer, target.device)) for method, proposer in proposers.items()}
    for index, item in enumerate(tqdm(items, desc=f"prompts x {len(runs)} methods")):
        for run in runs.values():
            seed_everything(seed + index)
            decode_into(run, target, tokenizer, item, max_new_tokens, sampling, prompt_format)
    return runs


def category_entry(tally: Tally, baseline: Tally | None) -> CategoryResult:
    """One benchmark category of a method's result: tau, target forwards, tokens/s and the speedup over
    the baseline's tokens/s on the same category's prompts (0.0 without one)."""
    return CategoryResult(
        tau=tally.tau,
        target_forwards=tally.forwards,
        tokens_per_s=tally.tokens_per_s,
        speedup_vs_vanilla=tally.speedup_over(baseline),
    )


def summarize(run: MethodRun, baseline: MethodRun, greedy: bool) -> MethodResult:
    """The result of one method (report.json's entry, ``eval.results``); ``eval.acceptance`` adds what the run
    does not know (requested, the head's training taus, the tree.json, the divergences)."""
    timer = run.timer
    by_depth, alpha = chain_acceptance(timer.depths, run.accepted)
    k = max(timer.depths, default=0)
    forward_s = timer.target_s / max(timer.target_calls, 1)
    # c: one draft call's cost in target forwards, with k draft calls per step.
    c = timer.draft_s / max(len(timer.depths), 1) / (k * forward_s) if k and forward_s else 0.0
    mismatched = [i for i, out, ref in zip(run.ids, run.outputs, baseline.outputs) if out != ref] if greedy else []
    return MethodResult(
        tau=sum(run.accepted) / max(len(run.accepted), 1) + 1,
        acceptance_by_depth=by_depth,
        alpha=alpha,
        mean_accepted=sum(run.accepted) / max(len(run.accepted), 1),
        target_forwards=len(run.accepted),
        new_tokens=run.new_tokens,
        wall_s=run.wall_s,
        tokens_per_s=run.tokens_per_s,
        speedup_vs_vanilla=run.speedup_over(baseline),
        draft_depth=k,
        drafted_nodes=timer.most_nodes,
        draft_cost_ratio=c,
        target_forward_ms=forward_s * 1e3,
        predicted_speedup=predicted_speedup(alpha, c, k),
        peak_memory_mb=run.peak_memory_mb,
        greedy_identical=not mismatched if greedy else None,
        mismatched_prompts=mismatched,
        per_category={
            cat: category_entry(tally, baseline.by_category.get(cat)) for cat, tally in run.by_category.items()
        },
    )


# A greedy mismatch is a near-tie when the target's two candidate logits differ by less than this many
# units in the last place of the compute dtype (at the logits' scale): reduced precision (bf16) rounds a
# tree forward and a one-token forward differently, and such a gap is inside that rounding.
NEAR_TIE_ULPS = 4


@torch.no_grad()
def divergence(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    item: BenchItem,
    ref_turns: list[list[int]],
    out_turns: list[list[int]],
    prompt_format: str = "auto",
) -> dict:
    """Where a method's greedy output first leaves vanilla's: turn, token index, both tokens, and the
    target's logit gap between them there (one full forward over the shared prefix, the prompt in
    ``prompt_format``), with ``near_tie``."""
    answers: list[str] = []
    for turn_index, (ref, out) in enumerate(zip(ref_turns, out_turns)):
        if ref != out:
            at = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            entry = {"prompt": item.id, "turn": turn_index, "token": at}
            if at == min(len(ref), len(out)):  # one output is a prefix of the other: a stop, not a token choice
                return entry | {"vanilla_token": None, "method_token": None, "logit_gap": None, "near_tie": False}
            prompt = turn_prompt(tokenizer, item, answers, prompt_format).to(target.device)[0]
            ids = torch.cat((prompt, torch.tensor(ref[:at], dtype=prompt.dtype, device=prompt.device)))
            vision = on_model(with_text_after(item.vision, at), target) if item.vision else {}
            logits = target(ids[None], **vision).logits[0, -1].float()
            gap = float(logits[ref[at]] - logits[out[at]])
            tolerance = NEAR_TIE_ULPS * torch.finfo(target.dtype).eps * float(logits.abs().max())
            return entry | {
                "vanilla_token": ref[at],
                "method_token": out[at],
                "logit_gap": gap,
                "near_tie": abs(gap) <= tolerance,
            }
        answers.append(cast(str, tokenizer.decode(ref, skip_special_tokens=True)))
    raise ValueError(f"{item.id}: outputs do not differ")


def divergences(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: list[BenchItem],
    baseline: MethodRun,
    run: MethodRun,
    mismatched: list[str],
    prompt_format: str = "auto",
) -> list[dict]:
    """``divergence`` of each mismatched item id of ``run`` from ``baseline`` (prompts in ``prompt_format``)."""
    by_id = {item.id: item for item in items}
    outputs, reference = dict(zip(run.ids, run.outputs)), dict(zip(baseline.ids, baseline.outputs))
    return [divergence(target, tokenizer, by_id[i], reference[i], outputs[i], prompt_format) for i in mismatched]
