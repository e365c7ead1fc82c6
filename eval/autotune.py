"""Hardware-aware tree tuning: pick the draft tree that maximises expected tokens/s on the machine at hand.

    python -m eval.autotune --target assets/demo-target --head runs/demo/eagle3/head \
        --bench assets/data/gsm8k_test.jsonl --out runs/autotune

1. Costs, measured here (``eval.timing``): the target's verification step (one forward over the root and n
   tree nodes, acceptance and KV commit) against n, at the bench's mean KV length and for each batch size;
   the head's drafting: a fixed part per step (reading the accepted rows, picking the root's children) and
   the cost of one drafting level against the number of nodes it expands.
2. Acceptance, measured on a calibration slice of the bench with a "comb" tree (``eval.tune_runs.calibrate``):
   p[d][r] = P(the target's token at depth d is the head's rank-r candidate | depth d - 1 was accepted on
   the rank-0 chain).
3. Model (``eval.speedup``): a tree's expected tokens per step is 1 + the sum of its nodes' acceptance
   probabilities (``core.acceptance``); the best n-node tree is the n most valuable nodes, and the tree with
   the highest expected tokens/s at the batch size asked for is chosen.
4. Adaptive depth (EAGLE heads, which draft level by level): the calibration steps are replayed with the
   chosen tree stopping below the first level whose best node's cumulative draft probability is under a
   threshold (``eval.speedup.fit_confidence``); the threshold that replays fastest (0: fixed depth) goes
   into the tree as ``min_confidence``.
5. Speculation by load: per batch size, the depth to cut the chosen tree at (0: plain decoding) and the best
   chain length, written as ``depth_per_batch_size`` (``decoding.verify.generate_batch`` follows it) and as
   vLLM's ``num_speculative_tokens_per_batch_size`` (the exports' serve commands carry it).
6. Validation on held-out prompts (``eval.tune_runs.validate``): the chosen tree (and the same tree at fixed depth),
   chains, other sizes and dynamic EAGLE-2 trees (EAGLE's default among them; none for a DFlash head, whose
   every depth comes from one forward, so its trees are static and no deeper than its block) decode the
   same prompts, interleaved prompt by prompt so that a shared CPU's load drifts over all of them alike; the
   table puts measured and predicted tau and tokens/s side by side. Then, per batch size, the held-out
   prompts decode together plainly, with the fixed tree and as scheduled (``eval.tune_runs.validate_batches``).

The choice is written as JSON (``tree.json``, ``decoding.tree_config``) that ``python -m eval.acceptance --tree
FILE`` reads (and picks up from a head folder by itself), as do the exports' model cards. ``--out`` also
gets autotune.json, autotune.md and autotune.png (``eval.report``), and autotune_config.yaml: the settings,
as the ``autotune:`` section that ``headstart autotune --config`` reads.

``--prompt-format`` renders the prompts as ``eval.acceptance``'s does (``data_recipes.prompts``; ``auto``: the chat
template where the tokenizer has one, else raw text); autotune.json and its report say what it became.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, ClassVar, cast

import torch
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError
from tqdm import tqdm
from transformers import PreTrainedModel

from headstart.core.command_flags import CommandFlags
from headstart.core.config_files import run_command, save_config
from headstart.core.io import atomic_write_text, check_writable
from headstart.core.models import load_decoding_target, load_model, load_tokenizer
from headstart.core.runtime import prepare_decoding, rank_zero_value, resolve_dtype, seed_everything
from headstart.core.settings import AUTO_ATTENTION, AttentionKernel, Count, Device, Dtype, Folder, NonNegative
from headstart.core.weights import safetensors_bytes
from headstart.data_recipes.bench import (
    check_token_ids,
    load_bench,
    longest_context,
    turn_prompt,
)
from headstart.data_recipes.prompts import PROMPT_FORMAT_HELP, PromptFormat, resolve_prompt_format
from headstart.decoding.proposers import check_draft_vocab, early_exit
from headstart.decoding.proposers_heads import DraftSource, adapts_depth, drafts_level_by_level, tree_depth_bound
from headstart.decoding.target_cache import recurrent_target, why_chains
from headstart.decoding.tree_config import EAGLE_DEFAULT, TreeSpec, schedule_ranges
from headstart.eval.autotune_report import write_autotune_report
from headstart.eval.report import prompts_rendered
from headstart.eval.speedup import Choice, ConfidenceStep, Costs, batch_table, fit_confidence, grid, tune
from headstart.eval.timing import machine, measure_costs
from headstart.eval.tune_runs import calibrate, validate, validate_batches, validation_checks, validation_rows
from headstart.heads import DraftHead, drafting_of, load_head


class Autotune(CommandFlags):
    """``python -m eval.autotune``'s flags, the config's ``autotune:`` section: the draft tree with the best
    expected tokens/s on this machine."""

    section: ClassVar[str] = "autotune"

    target: str = Field(description="target model folder or hub id")
    # What to tune for: exactly one of head, draft and self_spec.
    head: str | None = Field(
        None, description="EAGLE-1/2, EAGLE-3, P-EAGLE or DFlash head folder (DFlash: static trees within its block)"
    )
    draft: str | None = Field(None, description="a draft model folder (method draft_model)")
    self_spec: bool = Field(
        False, description="self-speculative decoding: tune the exit layer (--exit-layers) and its tree"
    )
    exit_layers: list[Count] | None = Field(
        None, description="--self-spec: the exit layers to try; null: 1 .. layers - 1"
    )
    allow_other_tokenizer: bool = Field(
        False, description="tune a head trained with another tokenizer than the target's (refused by default)"
    )
    bench: str = Field("assets/data/gsm8k_test.jsonl", description="JSONL prompts (see data_recipes.bench)")
    prompt_format: PromptFormat = Field("auto", description=PROMPT_FORMAT_HELP)
    offset: NonNegative = Field(0, description="bench prompts to skip (e.g. those a later eval uses)")
    calibration: Count = Field(8, description="prompts for the acceptance statistics")
    heldout: Count = Field(8, description="further prompts for the validation grid")
    max_new_tokens: Count = 128
    max_nodes: Count = Field(48, description="largest tree the tuner considers")
    max_depth: Count = 8
    comb_width: Count = Field(8, description="candidates per depth in the calibration tree")
    batch_size: Count = Field(1, description="the batch size to tune the tree for")
    batch_sizes: Annotated[list[Count], Field(min_length=1, description="shown in the batch table")] = [1, 2, 4, 8]
    repeats: Count = Field(7, description="timings per point (the median is kept)")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Dtype = "fp32"
    tp_size: Count = Field(1, description="split the target across this many torchrun processes")
    attn_implementation: AttentionKernel = AUTO_ATTENTION
    seed: NonNegative = 0
    out: Folder = Field(description="folder for tree.json, autotune.json/.md/.png")
    write_head: bool = Field(False, description="also write <head>/tree.json (eval.acceptance reads it)")

    @model_validator(mode="after")
    def _one_draft_source(self) -> Autotune:
        given = [name for name in ("head", "draft", "self_spec") if getattr(self, name)]
        if len(given) != 1:
            raise PydanticCustomError(
                "section_rule",
                "give exactly one of head, draft and self_spec (got {given})",
                {"given": given or "none"},
            )
        if self.write_head and not self.head:
            raise PydanticCustomError(
                "section_rule",
                "write_head needs head (a draft model or self-spec tree.json goes to eval.acceptance --tree)",
            )
        if self.batch_size not in self.batch_sizes:  # the batch size tuned for is in the batch table
            self.batch_sizes = sorted({*self.batch_sizes, self.batch_size})
        return self


@dataclass
class Tuned:
    """One draft source, calibrated and modelled: its acceptance, costs and best tree."""

    source: DraftSource
    max_depth: int
    rank_probs: list[list[float]]
    steps: list[ConfidenceStep]
    costs: Costs
    chosen: Choice
    vanilla: Choice


def parse_args(argv: list[str] | None = None) -> Autotune:
    """The command line as validated settings: the flags are ``Autotune``'s fields."""
    return Autotune.from_argv(argv, "python -m eval.autotune", __doc__.split("\n")[0])


def draft_sources(args: Autotune, target: PreTrainedModel, dtype: torch.dtype) -> dict[str, DraftSource]:
    """What to tune, by name: the head, the draft model, or the target's early exit at each exit layer."""
    if args.head:
        tokenizer = load_tokenizer(args.target)
        return {args.head: load_head(args.head, target, tokenizer, args.allow_other_tokenizer).to(dtype)}
    if args.draft:
        draft = load_model(args.draft, target.device, dtype)
        check_draft_vocab(draft, target, args.draft, args.target)
        return {args.draft: draft}
    layers = target.config.num_hidden_layers
    exits = args.exit_layers or list(range(1, layers))
    if not exits or not all(0 < n < layers for n in exits):
        raise ValueError(f"--exit-layers must lie in 1..{layers - 1} (the target has {layers} layers), got {exits}")
    return {f"exit layer {n}": early_exit(target, n) for n in exits}


def tree_json(choice: Choice, vanilla: Choice, batch: dict[int, dict], meta: dict) -> dict:
    """tree.json: the chosen tree (``TREE_KEYS``), the model's tau and tokens/s for it and for vanilla,
    ``speculate_max_batch`` (the largest batch size of ``batch``, ``eval.speedup.batch_table``, at which the
    model still prefers speculation; 0: never), and where it was tuned (``meta``: machine, device, dtype, ...)."""
    return (
        choice.tree.config()
        | {
            "predicted_tau": choice.tau,
            "predicted_tokens_per_s": choice.tokens_per_s,
            "predicted_vanilla_tokens_per_s": vanilla.tokens_per_s,
            "speculate_max_batch": max((b for b, row in batch.items() if row["speculate"]), default=0),
        }
        | meta
    )


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


@dataclass
class Session:
    """What every phase of a tuning run reads: the target, the draft sources and the prompts."""

    target: PreTrainedModel
    rank: int
    sources: dict[str, DraftSource]
    prompt_format: str  # resolved (chat or raw)
    calib: list[torch.Tensor]
    heldout: list[torch.Tensor]
    eos: int | None
    kv_length: int  # the KV length draft and verify costs are timed at


@dataclass
class Picked:
    """The fastest source's tree, with adaptive depth fitted, its batch-size table and schedules."""

    name: str
    best: Tuned
    chosen: Choice  # its tree carries the fitted min_confidence
    adaptive: tuple[float, float, float]  # (min_confidence, replayed tokens/s with it, at fixed depth)
    level_by_level: bool
    adapts: bool  # adaptive depth was fitted (``adapts_depth``)
    batch: dict[int, dict]
    schedules: dict[str, list]


def start(args: Autotune) -> Session:
    """The prompts checked and rendered, the target loaded for them and the draft sources beside it."""
    seed_everything(args.seed)
    dtype, tokenizer = resolve_dtype(args.dtype), load_tokenizer(args.target)
    wanted = args.offset + args.calibration + args.heldout
    items = load_bench(args.bench, wanted)[args.offset :]
    if len(items) < args.calibration + args.heldout:
        raise ValueError(f"{args.bench}: fewer than --offset + --calibration + --heldout = {wanted} prompts")
    prompt_format = resolve_prompt_format(tokenizer, args.prompt_format)  # chat without a template: refused here
    check_token_ids(tokenizer, items)
    drafter = args.head or args.draft
    drafters = safetensors_bytes(drafter) if drafter else 0
    context = longest_context(tokenizer, items, args.max_new_tokens, prompt_format) + max(
        args.max_nodes, EAGLE_DEFAULT["total_tokens"]
    )
    target, ranks = load_decoding_target(
        args.target, args.device, dtype, args.tp_size, drafters, context, args.attn_implementation
    )
    if recurrent_target(target):
        raise ValueError(
            f"{args.target}: eval.autotune tunes trees and batch schedules, and {why_chains(target)}: such a target "
            "drafts chains one sequence at a time; compare chain lengths with eval.acceptance --tree static --depth N"
        )
    prepare_decoding(target.device)
    sources = draft_sources(args, target, dtype)
    prompts = [turn_prompt(tokenizer, item, [], prompt_format).to(target.device) for item in items]  # first turns
    calib, heldout = prompts[: args.calibration], prompts[args.calibration :]
    kv_length = round(statistics.fmean(p.shape[1] for p in calib) + args.max_new_tokens / 2)
    return Session(target, ranks.rank, sources, prompt_format, calib, heldout, tokenizer.eos_token_id, kv_length)


def tune_sources(args: Autotune, run: Session) -> dict[str, Tuned]:
    """Each source calibrated, its drafting timed (the target's verify curve once) and its best tree modelled."""
    # The verify curve reaches EAGLE's default tree too: the validation grid predicts its speed.
    curve_nodes = max(args.max_nodes, EAGLE_DEFAULT["total_tokens"])
    tuned: dict[str, Tuned] = {}
    for name, source in tqdm(run.sources.items(), desc="draft sources", disable=len(run.sources) == 1):
        max_depth = tree_depth_bound(source, args.max_depth)
        rank_probs, decoded, steps = calibrate(
            run.target, source, run.calib, max_depth, args.comb_width, args.max_new_tokens, run.eos
        )
        verify = next(iter(tuned.values())).costs.verify_ms if tuned else None
        costs = measure_costs(
            run.target, source, decoded, run.kv_length, curve_nodes, args.batch_sizes, args.repeats, verify
        )
        costs = rank_zero_value(costs)  # a split target's ranks tune (and then decode) the same trees
        chosen, vanilla, _ = tune(costs, rank_probs, args.max_nodes, max_depth, args.batch_size)
        tuned[name] = Tuned(source, max_depth, rank_probs, steps, costs, chosen, vanilla)
    return tuned


def choose(args: Autotune, tuned: dict[str, Tuned]) -> Picked:
    """The fastest predicted source (several: self-speculation's exit layers), adaptive depth fitted where it
    drafts level by level or estimates acceptance itself (``adapts_depth``), and its tree per batch size."""
    name = max(tuned, key=lambda n: tuned[n].chosen.tokens_per_s)
    best = tuned[name]
    fixed = best.chosen.tree
    level_by_level = drafts_level_by_level(best.source)
    speed = best.chosen.tokens_per_s
    adapts = adapts_depth(best.source)
    adaptive = fit_confidence(best.costs, fixed, best.steps) if adapts else (0.0, speed, speed)
    chosen = replace(best.chosen, tree=fixed.model_copy(update={"min_confidence": adaptive[0]}))
    batch = batch_table(best.costs, best.rank_probs, args.max_nodes, best.max_depth, args.batch_sizes, fixed)
    schedules = {
        "depth_per_batch_size": schedule_ranges({b: row["depth"] for b, row in batch.items()}),
        "num_speculative_tokens_per_batch_size": schedule_ranges({b: row["chain_k"] for b, row in batch.items()}),
    }
    return Picked(name, best, chosen, adaptive, level_by_level, adapts, batch, schedules)


def tuned_for(args: Autotune, run: Session, pick: Picked) -> dict:
    """Where and for what the tree was tuned (tree.json's meta)."""
    source = pick.best.source
    if isinstance(source, DraftHead):
        method = drafting_of(source.config).method
    else:
        method = "self_spec" if args.self_spec else "draft_model"
    meta = {
        "machine": machine(run.target.device),
        "device": str(run.target.device),
        "dtype": args.dtype,
        "torch_threads": torch.get_num_threads(),
        "target": str(args.target),
        "head": pick.name,
        "method": method,
        "bench": str(args.bench),
        "prompt_format": run.prompt_format,
        "batch_size": args.batch_size,
        "tuned_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if args.self_spec:  # eval.acceptance --method self_spec --tree tree.json drafts with this exit layer
        meta["exit_layer"] = cast(PreTrainedModel, source).config.num_hidden_layers
    return meta


def write_choice(args: Autotune, run: Session, pick: Picked, meta: dict) -> None:
    """tree.json (and the settings) in --out, and in the head folder with --write-head: before the (long)
    validation, so an interrupted run still leaves its choice."""
    config = json.dumps(tree_json(pick.chosen, pick.best.vanilla, pick.batch, meta) | pick.schedules, indent=2) + "\n"
    if run.rank != 0:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "tree.json", config)
    note = f"prompts: {prompts_rendered(args.prompt_format, run.prompt_format)}"
    # What `headstart autotune --config` reads, what auto became in a comment.
    save_config(args.as_config(), out / "autotune_config.yaml", note)
    if args.write_head and args.head:
        atomic_write_text(Path(args.head) / "tree.json", config)


def validate_choice(args: Autotune, run: Session, pick: Picked) -> tuple[list[dict], list[dict]]:
    """The chosen tree against the grid around it (and itself at fixed depth) on the held-out prompts, then as
    scheduled per batch size: (grid rows, batch rows)."""
    best, tree = pick.best, pick.chosen.tree
    # P-EAGLE and DFlash draft every depth in one forward: they have no dynamic trees to compare with.
    trees = grid(tree, best.rank_probs, best.max_depth, dynamic=pick.level_by_level)
    fixed = best.chosen.tree
    trees += [fixed] if tree != fixed else []  # adaptive depth measured against the same tree at fixed depth
    runs = validate(
        run.target, best.source, run.heldout, trees, best.costs, best.rank_probs, args.max_new_tokens, run.eos
    )
    sizes = [b for b in args.batch_sizes if b <= len(run.heldout)]
    batch_rows = validate_batches(run.target, best.source, run.heldout, tree, pick.schedules["depth_per_batch_size"],
                                  sizes, args.max_new_tokens, run.eos)  # fmt: skip
    return validation_rows(runs, tree), batch_rows


def run(args: Autotune) -> dict:
    """The tuning ``args`` describe (from flags, or a config's ``autotune:`` section): its result."""
    for folder in [args.out] + ([args.head] if args.write_head and args.head else []):
        check_writable(folder)  # before the tuning, whose result an unwritable folder would lose
    session = start(args)
    tuned = tune_sources(args, session)
    pick = choose(args, tuned)
    meta = tuned_for(args, session, pick)
    write_choice(args, session, pick, meta)
    rows, batch_rows = validate_choice(args, session, pick)
    best, chosen, adaptive = pick.best, pick.chosen, pick.adaptive
    result = meta | {
        "prompt_format": args.prompt_format,
        "prompt_format_resolved": session.prompt_format,
        "kv_length": session.kv_length,
        "calibration_prompts": len(session.calib),
        "heldout_prompts": len(session.heldout),
        "max_new_tokens": args.max_new_tokens,
        "rank_probs": best.rank_probs,
        "costs": asdict(best.costs) | {"verify_ms": {str(b): ms for b, ms in best.costs.verify_ms.items()}},
        "chosen": chosen.tree.config() | {"predicted_tau": chosen.tau, "predicted_tokens_per_s": chosen.tokens_per_s},
        "grid": rows,
        "batch": {str(b): row for b, row in pick.batch.items()},
        "adaptive": {
            "min_confidence": adaptive[0],
            "replayed_tokens_per_s": adaptive[1],
            "replayed_fixed_tokens_per_s": adaptive[2],
            "level_by_level": pick.level_by_level,
            "fitted": pick.adapts,
        },  # fmt: skip
        "schedules": pick.schedules,
        "batch_validation": batch_rows,
        "checks": validation_checks(rows, TreeSpec.from_config(EAGLE_DEFAULT)),
        "sources": [
            {
                "name": n,
                "tree": t.chosen.tree.name,
                "predicted_tau": t.chosen.tau,
                "predicted_tokens_per_s": t.chosen.tokens_per_s,
                "chosen": n == pick.name,
            }
            for n, t in tuned.items()
        ],  # fmt: skip
    }
    if session.rank == 0:  # the other ranks of a split target ran the same forwards
        print(write_autotune_report(result, Path(args.out)))
    return result


if __name__ == "__main__":
    run_command(main, "python -m eval.autotune")
