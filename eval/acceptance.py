"""Acceptance length and speedup of drafting methods on a benchmark, measured against vanilla decoding.

    python -m eval.acceptance --target assets/demo-target --draft assets/demo-draft \
        --method vanilla,ngram,draft_model --bench assets/data/gsm8k_test.jsonl --limit 8 --out runs/acc

Every method decodes the same prompts through the one verification core (``decoding.verify.generate``, run
by ``eval.run``); vanilla runs first as the speedup baseline (also when not asked for). ``--out`` gets
report.json, report.md and PNG plots (``eval.report``), and eval_config.yaml: the settings, as the
``eval:`` section that ``headstart eval --config`` reads.

``--temperatures 0,0.7,1.0`` runs every method at each temperature over the same prompts and writes the
matrix (``eval.matrix``: tau and speedup per category group, the speedup claims checked) as matrix.json,
matrix.md and its plots, with each temperature's own report under ``T<temperature>/``. ``--per-group N``
takes N prompts from each group of Spec-Bench categories.

``--prompt-format`` (``data_recipes.prompts``): ``auto`` (the default) renders prompts with the target's chat
template where its tokenizer has one, else as raw text the way a completion API tokenizes it (a base model);
``chat`` or ``raw`` forces one. It is resolved once, before any decoding; the reports say what it became.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import torch
import transformers
from pydantic import Field
from transformers import AutoConfig

from headstart.core.command_flags import CommandFlags
from headstart.core.config_files import run_command, save_config
from headstart.core.io import check_writable
from headstart.core.models import load_decoding_target, load_model, load_processor, load_tokenizer
from headstart.core.runtime import Ranks, prepare_decoding, resolve_dtype
from headstart.core.settings import (
    AUTO_ATTENTION,
    AttentionKernel,
    Count,
    Device,
    Dtype,
    Float,
    Folder,
    NonNegative,
    NonNegativeFloat,
    Registered,
)
from headstart.core.weights import safetensors_bytes
from headstart.data_recipes.bench import (
    BenchItem,
    check_positions,
    check_token_ids,
    load_bench,
    longest_context,
    with_image_prompts,
)
from headstart.data_recipes.prompts import PROMPT_FORMAT_HELP, PromptFormat, resolve_prompt_format
from headstart.decoding.methods import (
    TreeSettings,
    all_methods,
    build_proposer,
    head_methods,
    tuned_trees,
)
from headstart.decoding.proposers import check_draft_vocab
from headstart.decoding.static_cache import bucket, setup_static_cache
from headstart.decoding.tree_config import TreeSpec, check_tree_vocab, load_tree_config
from headstart.decoding.verify import Proposer, Sampling
from headstart.eval.matrix import check_claims, groups_of, pick_per_group, temperature_row
from headstart.eval.report import prompts_rendered, report_json, write_matrix_report, write_report
from headstart.eval.results import MethodResult
from headstart.eval.run import MethodRun, divergences, run_methods, summarize
from headstart.eval.timing import machine
from headstart.heads import HeadConfig, HeadFolder, drafting_of, load_head, method_needs, read_head_folder


class Eval(CommandFlags, TreeSettings):
    """``python -m eval.acceptance``'s flags, the config's ``eval:`` section: acceptance length and speedup against
    vanilla decoding (the tree flags are ``decoding.methods.TreeSettings``)."""

    section: ClassVar[str] = "eval"

    target: str = Field(description="target model folder or hub id")
    head: list[str] = Field([], description="head folders, one per head method")
    draft: str | None = Field(None, description="draft model for method draft_model")
    allow_other_tokenizer: bool = Field(
        False, description="evaluate heads trained with another tokenizer than the target's (refused by default)"
    )
    # A name checked against the registered methods when the flags are parsed: a typo is refused before any load.
    method: Annotated[list[Annotated[str, Registered(all_methods)]], Field(min_length=1, description="methods to run")]
    bench: str = Field(description="JSONL: Spec-Bench, GSM8K, messages, prompt/text or input_ids records")
    prompt_format: PromptFormat = Field("auto", description=PROMPT_FORMAT_HELP)
    limit: Count | None = Field(None, description="prompts to run, round-robin over categories; null: every prompt")
    per_group: Count | None = Field(
        None, description="prompts from each category group (eval.matrix.GROUPS), round-robin over its categories"
    )
    max_new_tokens: Count = Field(128, description="per turn")
    temperature: NonNegativeFloat = 0.0
    temperatures: list[NonNegativeFloat] = Field(
        [], description="every method at each one: the matrix per category group (eval.matrix)"
    )
    top_p: Annotated[Float, Field(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0
    seed: NonNegative = 0
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Dtype = "fp32"
    tp_size: Count = Field(1, description="split the target across this many torchrun processes")
    kv_cache: Literal["dynamic", "static"] = Field(
        "dynamic",
        description="static: the target's KV cache in fixed buffers and, on CUDA, each verify forward replayed as a "
        "CUDA graph (decoding.static_cache); one sequence at a time",
    )
    attn_implementation: AttentionKernel = AUTO_ATTENTION
    out: Folder = Field(description="the report folder")


def heads_by_method(head_dirs: list[str]) -> dict[str, HeadFolder]:
    """Method name (``heads.drafting_of``: the type, or peagle) -> head folder, its config.json read here once for
    the whole run (an unknown head type is refused there)."""
    found: dict[str, HeadFolder] = {}
    for head_dir in head_dirs:
        head = read_head_folder(head_dir)
        head_type = drafting_of(head.config).method
        if head_type in found:
            raise ValueError(f"--head {head_dir} and {found[head_type].path} are both {head_type} heads; give one")
        found[head_type] = head
    return found


def check_methods(methods: list[str], heads: dict[str, str], draft: str | None) -> None:
    """Fail before loading anything when a method lacks what it needs (or a head would go unused)."""
    for method in methods:
        if method in head_methods() and method not in heads:
            given = f" (given: {', '.join(f'{d} is {t}' for t, d in heads.items())})" if heads else ""
            kind = method_needs(method)
            raise ValueError(f"method {method!r} needs a --head whose config type is {kind}{given}")
    if "draft_model" in methods and not draft:
        raise ValueError("method 'draft_model' needs --draft PATH (a small LM with the target's tokenizer)")
    unused = [d for t, d in heads.items() if t not in methods]
    if unused:
        raise ValueError(f"--head {', '.join(unused)} given but its method is not in --method")


def training_tau(config: HeadConfig, kind: str) -> float | None:
    """The tau the head's training recorded at its last evaluation, when it did: ``predicted_tau`` (the chain model on
    held-out top-1 accuracies) or ``measured_tau`` (decoded with the head drafting, ``train.eval_prompts``)."""
    return (config.training or {}).get(kind)


def parse_args(argv: list[str] | None = None) -> Eval:
    """The command line as validated settings: the flags are ``Eval``'s fields."""
    return Eval.from_argv(argv, "python -m eval.acceptance", __doc__.split("\n")[0])


def _describe(d: dict) -> str:
    if d["logit_gap"] is None:
        return "one output stops where the other goes on"
    kind = "a near-tie (reduced-precision rounding)" if d["near_tie"] else "NOT a near-tie: a bug"
    return f"vanilla {d['vanilla_token']} vs {d['method_token']}, target logit gap {d['logit_gap']:.4f}: {kind}"


def check_matrix_flags(args: Eval) -> None:
    """Refuse flag pairs of which one would silently lose: the prompt count, the temperature."""
    if args.per_group and args.limit:
        raise ValueError("give --limit (prompts in all) or --per-group (prompts per category group), not both")
    if args.temperatures and args.temperature:
        raise ValueError("give --temperature (one report) or --temperatures (the matrix), not both")
    # Checked here, when the run starts, not in the settings: a pipeline's file may name a tree autotune writes later.
    if (tree := args.tree_file()) and not tree.is_file():
        raise FileNotFoundError(
            f"--tree {tree}: expected static, dynamic or a tree.json file, and there is no such file"
        )


@dataclass
class Loaded:
    """What every run of one command shares: the prompts, the models and each method's proposer."""

    items: list[BenchItem]
    target: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    prompt_format: str  # --prompt-format resolved for the tokenizer: chat or raw
    heads: dict[str, HeadFolder]  # by method, each config.json read once
    trees: dict[str, TreeSpec]  # by method, the tuned tree it drafts (a tree.json's)
    proposers: dict[str, Proposer]  # vanilla first: the speedup baseline
    device: torch.device
    ranks: Ranks  # a split target: every rank decodes, the first writes


def load(args: Eval) -> Loaded:
    """Check the flags, then load the prompts, the target, the draft model and heads, and build the proposers."""
    head_folders = heads_by_method(args.head)
    head_dirs = {method: head.path for method, head in head_folders.items()}
    check_methods(args.method, head_dirs, args.draft)
    check_matrix_flags(args)
    # Every tree.json, before any model loads.
    flags = args.tree_spec()
    trees = tuned_trees(head_folders, flags, args.method)
    items = load_bench(args.bench, args.limit)
    if args.per_group:
        items = pick_per_group(items, args.per_group)
    dtype, tokenizer = resolve_dtype(args.dtype), load_tokenizer(args.target)
    prompt_format = resolve_prompt_format(tokenizer, args.prompt_format)  # chat without a template: refused here
    items = with_image_prompts(items, load_processor(args.target), tokenizer)  # images read before the target loads
    check_token_ids(tokenizer, items)
    warn_prompt_formats(head_folders, prompt_format)
    drafters = sum(safetensors_bytes(d) for d in [*head_dirs.values(), *([args.draft] if args.draft else [])])
    positions = AutoConfig.from_pretrained(args.target).get_text_config().max_position_embeddings
    check_positions(tokenizer, items, args.max_new_tokens, args.total_tokens, positions, prompt_format)
    context = longest_context(tokenizer, items, args.max_new_tokens, prompt_format) + args.total_tokens
    target, ranks = load_decoding_target(
        args.target, args.device, dtype, args.tp_size, drafters, context, args.attn_implementation
    )
    device = target.device
    prepare_decoding(device)
    if args.kv_cache == "static":
        if args.tp_size > 1:
            raise ValueError("--kv-cache static decodes one process's target: leave --tp-size at 1")
        setup_static_cache(target, context + bucket(args.total_tokens + 1))  # the last step's bucketed queries
    draft = load_model(args.draft, device, dtype) if args.draft and "draft_model" in args.method else None
    if draft is not None and args.draft:
        check_draft_vocab(draft, target, args.draft, args.target)
    heads = {m: load_head(h, target, tokenizer, args.allow_other_tokenizer).to(dtype) for m, h in head_folders.items()}
    for method, model, name in (("draft_model", draft, args.draft), ("self_spec", target, args.target)):
        if method in trees and model is not None:  # a head's tree met its head's vocabulary in tuned_trees
            check_tree_vocab(trees[method], model.config.vocab_size, str(args.tree), f"the model {name}")
    order = ["vanilla"] + [m for m in args.method if m != "vanilla"]  # the baseline first
    proposers = {m: build_proposer(m, flags, draft, heads, trees.get(m), target) for m in order}
    return Loaded(items, target, tokenizer, prompt_format, head_folders, trees, proposers, device, ranks)


def measure(args: Eval, loaded: Loaded, temperature: float) -> tuple[dict[str, MethodRun], dict[str, MethodResult]]:
    """Every method over the prompts at ``temperature``: the runs and their results."""
    sampling = Sampling(temperature=temperature, top_p=args.top_p, top_k=args.top_k)
    target, tokenizer, items, prompt_format = loaded.target, loaded.tokenizer, loaded.items, loaded.prompt_format
    runs = run_methods(
        target, tokenizer, loaded.proposers, items, args.max_new_tokens, sampling, args.seed, prompt_format
    )
    heads = loaded.heads
    methods = {
        m: replace(
            summarize(run, runs["vanilla"], sampling.greedy),
            requested=m in args.method,
            predicted_tau=training_tau(heads[m].config, "predicted_tau") if m in heads else None,
            training_measured_tau=training_tau(heads[m].config, "measured_tau") if m in heads else None,
            tree_config=tree_record(loaded.trees.get(m)),
        )
        for m, run in runs.items()
    }
    return runs, {
        method: replace(
            result,
            divergences=divergences(
                target, tokenizer, items, runs["vanilla"], runs[method], result.mismatched_prompts, prompt_format
            ),
        )
        for method, result in methods.items()
    }


def tree_record(tree: TreeSpec | None) -> dict | None:
    """What the report records of a method's tuned tree: its tree.json as written."""
    return load_tree_config(tree.file) if tree is not None and tree.file is not None else None


def settings(args: Eval, loaded: Loaded) -> dict:
    """The report's header: what ran, on what, with which settings (the temperature: each run's own)."""
    return {
        "target": str(args.target),
        "draft": args.draft,
        "heads": {method: head.path for method, head in loaded.heads.items()},
        "bench": str(args.bench),
        "prompt_format": args.prompt_format,
        "prompt_format_resolved": loaded.prompt_format,
        "limit": args.limit,
        "per_group": args.per_group,
        "prompts": len(loaded.items),
        "max_new_tokens": args.max_new_tokens,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "tree": {
            "shape": str(args.tree) if args.tree else None,
            "file": str(args.tree_file()) if args.tree_file() else None,
            "top_k_draft": args.top_k_draft,
            "depth": args.depth,
            "total": args.total_tokens,
            "exit_layer": args.exit_layer,
        },
        "seed": args.seed,
        "device": str(loaded.device),
        "dtype": args.dtype,
        "tp_size": args.tp_size,
        "kv_cache": args.kv_cache,
        "machine": machine(loaded.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def warn_prompt_formats(heads: dict[str, HeadFolder], prompt_format: str) -> None:
    """Say so where a head trained on other prompts than these (chat data, now raw prompts, or the reverse): its
    acceptance here is not what it reaches where it is served as it was trained."""
    for method, head in heads.items():
        trained = head.config.prompt_format
        if trained is not None and trained != prompt_format:
            print(
                f"WARNING: the {method} head {head.path} was trained on {trained} prompts, evaluated here on "
                f"{prompt_format} ones (--prompt-format {trained} evaluates it as it was trained)",
                file=sys.stderr,
            )


def warn_mismatches(methods: dict[str, MethodResult]) -> None:
    for method, result in methods.items():
        if result.greedy_identical is False:
            print(
                f"WARNING: {method} is NOT identical to vanilla greedy decoding on "
                f"{len(result.mismatched_prompts)} prompt(s): {result.mismatched_prompts}",
                file=sys.stderr,
            )
            for d in result.divergences:
                print(f"  {d['prompt']} turn {d['turn']} token {d['token']}: {_describe(d)}", file=sys.stderr)


def run_matrix(args: Eval, loaded: Loaded, header: dict) -> dict:
    """Every method at each of ``--temperatures``: each temperature's report under ``T<t>/``, the matrix in
    ``--out``; returns the matrix."""
    rows = []
    for temperature in args.temperatures:
        runs, methods = measure(args, loaded, temperature)
        if loaded.ranks.rank == 0:
            write_report(
                header | {"temperature": temperature, "methods": methods}, Path(args.out) / f"T{temperature:g}"
            )
            warn_mismatches(methods)
        rows.append(temperature_row(temperature, runs, methods))
    matrix = header | {
        "temperatures": args.temperatures,
        "groups": groups_of([item.category for item in loaded.items]),
        "rows": rows,
        "claims": check_claims(rows),
    }
    if loaded.ranks.rank == 0:
        print(write_matrix_report(matrix, args.out))
    return matrix


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


def run(args: Eval) -> dict:
    """The evaluation ``args`` describe (from flags, or a config's ``eval:`` section): its report."""
    check_writable(args.out)  # before the evaluation, whose measurements an unwritable --out would lose
    loaded = load(args)
    header = settings(args, loaded)
    if args.temperatures:
        report = run_matrix(args, loaded, header)
    else:
        _, methods = measure(args, loaded, args.temperature)
        results = header | {"temperature": args.temperature, "methods": methods}
        if loaded.ranks.rank == 0:
            print(write_report(results, args.out))
            warn_mismatches(methods)
        report = report_json(results)  # what report.json holds
    if loaded.ranks.rank != 0:  # the other ranks of a split target decoded in lockstep; the first writes
        return report
    note = f"prompts: {prompts_rendered(args.prompt_format, loaded.prompt_format)}"
    save_config(args.as_config(), Path(args.out) / "eval_config.yaml", note)  # `headstart eval --config`
    if "vanilla" not in args.method:
        print("note: vanilla was not requested; it ran anyway as the speedup baseline", file=sys.stderr)
    return report


if __name__ == "__main__":
    run_command(main, "python -m eval.acceptance")
