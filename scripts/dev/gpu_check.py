"""What CI cannot run, checked on a CUDA machine in one command: ``make gpu-check``.

    python -m scripts.dev.gpu_check --out runs/gpu-check [--head runs/demo/eagle3/head] [--steps eval-fp32,...]
        [--allow-cpu]

Every step is a subprocess of the bundled target (``assets/demo-target``), its command, wall time and
pass/fail recorded in gpu_check.json and gpu_check.md under ``--out`` (rewritten after every step, so a
killed run keeps what finished):

1. ``eval-fp32``: ``eval.acceptance`` on CUDA with vanilla, n-gram (and the ``--head``'s method) in fp32;
   passes when every method's greedy output is token-for-token vanilla's (``greedy_identical``);
2. ``eval-bf16``: the same in bf16, where the tree forward and the one-token forward may round a near-tie
   differently: it reports each method's mismatches and passes when every divergence is a near-tie;
3. ``eval-graphs``: ``eval-fp32`` with ``--kv-cache static``: the static KV cache, every verify forward replayed as
   a CUDA graph (``decoding.static_cache``); passes when every method's greedy output is vanilla's;
4. ``capture-tp1`` / ``capture-tp2``: ``data_recipes.capture`` of the same samples in one process and under
   ``torchrun --nproc_per_node 2 ... target.tp_size=2`` (the bundled target's 2 key/value heads allow 2 at
   most); passes when the split capture's token ids, loss masks and sample ids equal the one-process capture's
   (the hidden states' largest difference is reported);
5. ``eval-tp2``: ``eval.acceptance --tp-size 2`` under torchrun in fp32; passes when every method's tau,
   target forwards, new tokens and greedy_identical equal ``eval-fp32``'s (report.json holds no token ids);
6. ``heads-bf16``: every demo recipe (EAGLE-1/2, EAGLE-3.1, P-EAGLE, Medusa, DFlash, DSpark, DFlash-2) trained a
   few steps in bf16 (``train.dtype=bf16``: DeepSpeed's bf16, the whole head cast) from a capture of its own,
   then ``eval.acceptance --dtype bf16`` with every trained head; passes when each trained and every
   divergence is a near-tie, as ``eval-bf16``. It needs no ``--head``: every head type's bf16 path runs on CUDA
   (a head cast to bf16 once crashed there in DSpark's confidence head, found only when a DSpark head was named);
7. ``fused-ttt``: ``scripts.dev.fused_ttt``: ``train.attention: fused`` against the exact training-time-test
   attention on CUDA, values and gradients, fp32 (equal to rounding) and bf16 (no worse than twice the exact
   path's own bf16 error), 2,048 tokens at the 8B head's shape;
8. ``families``: ``scripts.dev.tiny_families`` on CUDA in fp32: tiny random targets of every family a serving
   engine drafts for (MoE, MLA, sliding-window, linear-attention and Mamba hybrids); passes when n-gram and
   EAGLE-3 speculative decoding give each one's own greedy output (the windows and recurrent rollback on CUDA);
9. ``bench-scale``: ``scripts.bench.scale`` on CUDA at the llama-3.1-8b shape, full depth, small settings
   (its GPU column: capture vs forward, head steps, verify curve); passes when it writes its report.

The tensor-parallel steps need 2 visible GPUs; with one they are recorded as ``skipped: 1 GPU visible``. On a
machine without CUDA the command refuses (exit 1) unless ``--allow-cpu``, which runs the same steps on the CPU
with tiny settings (tensor parallelism over 2 gloo processes): what the test suite checks.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from headstart.core.io import atomic_write_text
from headstart.data_recipes.capture_diff import compare_captures
from headstart.eval.results import MethodResult, read_methods
from headstart.heads.registry import drafting_owner
from headstart.scripts.dev.steps import Step, run_step

REPO = Path(__file__).resolve().parents[2]  # scripts/dev/gpu_check.py: the repository root
TARGET = "assets/demo-target"
BENCH = "assets/data/gsm8k_test.jsonl"
CAPTURE_CONFIG = "configs/demo-eagle3.yaml"
MAX_TP = 2  # the bundled target's key/value heads: each rank holds whole heads
STEPS = (
    "eval-fp32",
    "eval-bf16",
    "eval-graphs",
    "capture-tp1",
    "capture-tp2",
    "eval-tp2",
    "heads-bf16",
    "fused-ttt",
    "families",
    "bench-scale",
)
# The demo's recipes (configs/<recipe>.yaml, all on the EAGLE-3 demo's capture) and the method each head drafts with.
DEMO_RECIPES = {
    "demo-eagle": "eagle",
    "demo-eagle3": "eagle3",
    "demo-peagle": "peagle",
    "demo-medusa": "medusa",
    "demo-dflash": "dflash",
    "demo-dspark": "dspark",
    "demo-dflash2": "dflash2",
}
NO_GPU = (
    "scripts.dev.gpu_check runs what CI cannot (the CUDA evaluation path, tensor parallelism over GPUs, the GPU bench) "
    "and needs a CUDA GPU: torch.cuda.is_available() is False here (torch {torch}). Run it on a GPU machine, or "
    "pass --allow-cpu to run the same steps on the CPU with tiny settings."
)


@dataclass(frozen=True)
class Settings:
    """How big each step runs: on a GPU, enough prompts and tokens to meet near-ties; on a CPU, seconds."""

    device: str
    prompts: int
    new_tokens: int
    capture_samples: int
    train_steps: int  # heads-bf16: optimizer steps per recipe
    fused_ttt: tuple[str, ...]  # scripts.dev.fused_ttt's sizes
    bench: tuple[str, ...]

    @classmethod
    def for_device(cls, device: str) -> Settings:
        if device == "cuda":  # the 8B shape at full depth (16 GB in bf16), short sequences: a few minutes
            bench = "--shape llama-3.1-8b --dtype bf16 --seq-len 1024 --capture-samples 4 --head-steps 2 "
            bench += "--kv-length 1024 --max-nodes 64 --repeats 2"
            # fused-ttt at the 8B head's 32 heads, 8 key/value heads of 128 (the script's default shape)
            fused: tuple[str, ...] = ("--seq-len", "2048", "--steps", "7")
            return cls("cuda", 8, 64, 64, 10, fused, tuple(bench.split()))
        bench = "--shape tiny --layers 4 --dtype fp32 --seq-len 32 --capture-samples 2 --draft-vocab 256 "
        bench += "--ttt-steps 2 --head-steps 1 --kv-length 16 --max-nodes 8 --repeats 1"
        fused = ("--seq-len", "64", "--steps", "3", "--heads", "4", "2", "16")
        return cls("cpu", 1, 8, 4, 2, fused, tuple(bench.split()))


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


def eval_command(s: Settings, methods: list[str], heads: list[str], dtype: str, out: Path, tp: int) -> list[str]:
    launcher = [sys.executable] if tp == 1 else torchrun(tp)
    cmd = [*launcher, "-m", "eval.acceptance", "--target", TARGET, "--method", ",".join(methods), "--bench", BENCH]
    cmd += ["--limit", str(s.prompts), "--max-new-tokens", str(s.new_tokens), "--device", s.device]
    cmd += ["--dtype", dtype, "--out", str(out)]
    cmd += ["--head", ",".join(heads)] if heads else []
    return cmd + (["--tp-size", str(tp)] if tp > 1 else [])


def capture_command(s: Settings, out: Path, tp: int) -> list[str]:
    launcher = [sys.executable] if tp == 1 else torchrun(tp)
    cmd = [*launcher, "-m", "data_recipes.capture", "--config", CAPTURE_CONFIG, f"data.limit={s.capture_samples}"]
    cmd += [f"capture.out_dir={out}", f"target.device={s.device}"]
    return cmd + ([f"target.tp_size={tp}"] if tp > 1 else [])


def read_report(out: Path) -> dict[str, MethodResult]:
    """The methods' results of the report.json in ``out``."""
    return read_methods(json.loads((out / "report.json").read_text()))


def check_fp32(out: Path) -> tuple[bool, dict[str, Any]]:
    """Every method's greedy output is vanilla's, token for token."""
    identical = {m: result.greedy_identical for m, result in read_report(out).items()}
    return all(v is True for v in identical.values()), {"greedy_identical": identical}


def check_bf16(out: Path) -> tuple[bool, dict[str, Any]]:
    """Mismatches are allowed in bf16 where they are near-ties (reduced-precision rounding), never otherwise."""
    found: dict[str, Any] = {}
    for method, result in read_report(out).items():
        divergences = result.divergences
        found[method] = {
            "greedy_identical": result.greedy_identical,
            "mismatched_prompts": len(result.mismatched_prompts),
            "near_ties": sum(bool(d["near_tie"]) for d in divergences),
            "not_near_ties": [d for d in divergences if not d["near_tie"]],
        }
    return all(not f["not_near_ties"] for f in found.values()), {"methods": found}


def check_capture(out: Path) -> tuple[bool, dict[str, Any]]:
    manifest = json.loads((out / "manifest.json").read_text())
    return True, {"samples": manifest["samples"], "tokens": manifest["tokens"]}


def check_capture_tp(reference: Path, out: Path) -> tuple[bool, dict[str, Any]]:
    if not (reference / "manifest.json").exists():
        return False, {"why": f"no one-process capture in {reference} to compare with (capture-tp1 did not run)"}
    same = compare_captures(reference, out)
    return bool(same["token_ids_equal"] and same.get("loss_masks_equal")), same


def compared(result: MethodResult) -> dict[str, Any]:
    """What a split target must reproduce of a method's result (report.json holds no token ids)."""
    return {
        "tau": result.tau,
        "target_forwards": result.target_forwards,
        "new_tokens": result.new_tokens,
        "greedy_identical": result.greedy_identical,
    }


def check_eval_tp(reference: Path, out: Path) -> tuple[bool, dict[str, Any]]:
    """The split target decodes what the whole one does: per method, the same tau, forwards and tokens."""
    if not (reference / "report.json").exists():
        return False, {"why": f"no tp 1 report in {reference} to compare with (eval-fp32 did not run)"}
    whole, split = read_report(reference), read_report(out)
    differ = {}
    for m in whole.keys() & split.keys():
        one, two = compared(whole[m]), compared(split[m])
        differ[m] = {key: [one[key], two[key]] for key in one if one[key] != two[key]}
    differ = {m: row for m, row in differ.items() if row}
    identical = {m: result.greedy_identical for m, result in split.items()}
    passed = not differ and split.keys() == whole.keys() and all(v is True for v in identical.values())
    details: dict[str, Any] = {"tau": {m: result.tau for m, result in split.items()}, "greedy_identical": identical}
    if split.keys() != whole.keys():
        details["methods [tp1, tp2]"] = [sorted(whole), sorted(split)]
    return passed, details | ({"differ [tp1, tp2]": differ} if differ else {})


def check_families(out: Path) -> tuple[bool, dict[str, Any]]:
    report = json.loads((out / "families.json").read_text())
    identical = {f: {m: r["greedy_identical"] for m, r in methods.items()} for f, methods in report["families"].items()}
    return bool(report["passed"]), {"greedy_identical": identical}


def check_fused_ttt(out: Path) -> tuple[bool, dict[str, Any]]:
    result = json.loads((out / "fused_ttt.json").read_text())
    worst = {key: max(row[key] for row in result["steps"]) for key in ("fp32_fused", "bf16_exact", "bf16_fused")}
    return bool(result["passed"]), {"seq_len": result["seq_len"], "worst": worst}


def check_bench(out: Path) -> tuple[bool, dict[str, Any]]:
    result = json.loads((out / "bench_scale.json").read_text())
    cap, heads = result["capture"], result["heads"]
    return True, {
        "machine": result["machine"],
        "layers": result["target"]["num_hidden_layers"],
        "capture_vs_forward": cap["capture_vs_forward"],
        "capture_tokens_per_s": cap["capture_tokens_per_s"],
        "head_tokens_per_s": {h: entry["tokens_per_s"] for h, entry in heads.items()},
        "verify_relative_at_max_nodes": result["verify"]["relative"][-1],
    }


def plan(s: Settings, out: Path, heads: list[str], gpus: int) -> list[Step | dict[str, Any]]:
    """The steps in order; a tensor-parallel step that cannot run here is a dict saying why."""
    methods = ["vanilla", "ngram", *methods_of_head_folders(heads)]
    d = {name: out / name for name in STEPS}
    steps: list[Step | dict[str, Any]] = [
        Step(
            "eval-fp32",
            [eval_command(s, methods, heads, "fp32", d["eval-fp32"], 1)],
            lambda: check_fp32(d["eval-fp32"]),
            d["eval-fp32"],
        ),
        Step(
            "eval-bf16",
            [eval_command(s, methods, heads, "bf16", d["eval-bf16"], 1)],
            lambda: check_bf16(d["eval-bf16"]),
            d["eval-bf16"],
        ),
        Step(
            "eval-graphs",
            [[*eval_command(s, methods, heads, "fp32", d["eval-graphs"], 1), "--kv-cache", "static"]],
            lambda: check_fp32(d["eval-graphs"]),
            d["eval-graphs"],
        ),
        Step(
            "capture-tp1",
            [capture_command(s, d["capture-tp1"], 1)],
            lambda: check_capture(d["capture-tp1"]),
            d["capture-tp1"],
        ),
    ]
    steps += tp_steps(s, d, methods, heads, gpus)
    steps.append(
        Step(
            "heads-bf16",
            heads_bf16_commands(s, d["heads-bf16"]),
            lambda: check_heads_bf16(d["heads-bf16"]),
            d["heads-bf16"],
        )
    )
    fused = [sys.executable, "-m", "scripts.dev.fused_ttt", "--device", s.device, *s.fused_ttt]
    steps.append(
        Step(
            "fused-ttt",
            [[*fused, "--out", str(d["fused-ttt"])]],
            lambda: check_fused_ttt(d["fused-ttt"]),
            d["fused-ttt"],
        )
    )
    families = [sys.executable, "-m", "scripts.dev.tiny_families", "--device", s.device, "--dtype", "fp32"]
    steps.append(
        Step(
            "families", [[*families, "--out", str(d["families"])]], lambda: check_families(d["families"]), d["families"]
        )
    )
    bench = [sys.executable, "-m", "scripts.bench.scale", *s.bench, "--device", s.device]
    steps.append(
        Step(
            "bench-scale",
            [[*bench, "--out", str(d["bench-scale"])]],
            lambda: check_bench(d["bench-scale"]),
            d["bench-scale"],
        )
    )
    return steps


def tp_steps(
    s: Settings, d: dict[str, Path], methods: list[str], heads: list[str], gpus: int
) -> list[Step | dict[str, Any]]:
    """Capture and evaluation over 2 processes, against one's; each a dict saying why where 2 GPUs are not seen."""
    tp = min(MAX_TP, gpus) if s.device == "cuda" else MAX_TP  # on a CPU: gloo processes
    if tp < 2:
        why = f"skipped: {gpus} GPU visible"
        return [{"name": "capture-tp2", "skipped": why}, {"name": "eval-tp2", "skipped": why}]
    return [
        Step(
            "capture-tp2",
            [capture_command(s, d["capture-tp2"], tp)],
            lambda: check_capture_tp(d["capture-tp1"], d["capture-tp2"]),
            d["capture-tp2"],
        ),
        Step(
            "eval-tp2",
            [eval_command(s, methods, heads, "fp32", d["eval-tp2"], tp)],
            lambda: check_eval_tp(d["eval-fp32"], d["eval-tp2"]),
            d["eval-tp2"],
        ),
    ]


def heads_bf16_commands(s: Settings, out: Path) -> list[list[str]]:
    """A capture of ``s.capture_samples`` conversations, each demo recipe trained ``s.train_steps`` steps on it with
    a bf16 head (the target, and so the captured states, as the recipe says), then one bf16 evaluation of them all."""
    capture = out / "capture"
    commands = [capture_command(s, capture, 1)]
    for recipe, method in DEMO_RECIPES.items():
        trainer = drafting_owner(method).trainer
        command = [*torchrun(1), f"train/{trainer}.py", "--config", f"configs/{recipe}.yaml"]
        command += [f"capture.out_dir={capture}", f"data.limit={s.capture_samples}", f"target.device={s.device}"]
        command += [f"train.out_dir={out / recipe}", "train.dtype=bf16", f"train.max_steps={s.train_steps}"]
        command += [f"train.heldout_samples={max(1, s.capture_samples // 8)}", f"train.save_every={s.train_steps}"]
        command += ["train.batch_size=2", "train.micro_batch_size=2"]  # what the CPU's 3 training samples fill
        commands.append(command + [f"train.eval_every={s.train_steps}", "train.eval_prompts=1"])
    heads = [str(out / recipe / "head") for recipe in DEMO_RECIPES]
    return commands + [eval_command(s, ["vanilla", *DEMO_RECIPES.values()], heads, "bf16", out / "eval", 1)]


def check_heads_bf16(out: Path) -> tuple[bool, dict[str, Any]]:
    """check_bf16 of the trained heads' evaluation, with each recipe's last training loss (finite, or it fails)."""
    losses = {}
    for recipe in DEMO_RECIPES:
        records = [json.loads(line) for line in (out / recipe / "metrics.jsonl").read_text().splitlines()]
        losses[recipe] = [r["loss"] for r in records if r.get("split") == "train" and "loss" in r][-1]
    passed, details = check_bf16(out / "eval")
    finite = all(math.isfinite(loss) for loss in losses.values())
    return passed and finite, details | {"last_train_loss": losses}


def methods_of_head_folders(heads: list[str]) -> list[str]:
    """The evaluation method of each head folder (its config's type), as eval.acceptance names it."""
    if not heads:
        return []
    from headstart.eval.acceptance import heads_by_method

    return list(heads_by_method(heads))


def markdown(report: dict[str, Any]) -> str:
    """The report as a table: a row per step, its result, wall time and command."""
    verdict = "PASSED" if report["passed"] else ("FAILED" if report["passed"] is False else "INCOMPLETE")
    lines = [
        f"# gpu-check: {verdict}",
        "",
        f"{report['machine']}; device {report['device']}, {report['gpus']} GPU(s) visible; torch {report['torch']}",
        "",
        "| step | result | wall (s) | details | command |",
        "|---|---|---|---|---|",
    ]
    for step in report["steps"]:
        if "skipped" in step:
            lines.append(f"| {step['name']} | {step['skipped']} | | | |")
            continue
        result = "pass" if step["passed"] else "**FAIL**"
        details, command = (text.replace("|", "\\|") for text in (json.dumps(step["details"]), step["command"]))
        lines.append(f"| {step['name']} | {result} | {step['wall_s']:.1f} | {details} | `{command}` |")
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any], out: Path) -> None:
    """gpu_check.json and gpu_check.md under ``out``; ``passed``: every step that ran passed (None: none ran)."""
    ran = [step["passed"] for step in report["steps"] if "skipped" not in step]
    report["passed"] = all(ran) if ran else None
    atomic_write_text(out / "gpu_check.json", json.dumps(report, indent=2) + "\n")
    atomic_write_text(out / "gpu_check.md", markdown(report))


def _steps(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in STEPS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{unknown or text!r}: expected comma-separated steps of {list(STEPS)}")
    return names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.dev.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json, gpu_check.md and each step's")
    p.add_argument("--head", action="append", default=[], help="head folder(s) to evaluate too (e.g. an EAGLE-3 head)")
    p.add_argument("--steps", type=_steps, default=list(STEPS), help=f"comma-separated, of: {', '.join(STEPS)}")
    p.add_argument("--step-timeout", type=float, default=1800, help="seconds a step may run before it is killed")
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA: the same steps on the CPU, tiny settings")
    args = p.parse_args(argv)
    args.head = [h.strip() for arg in args.head for h in arg.split(",") if h.strip()]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit(NO_GPU.format(torch=torch.__version__))
    from headstart.eval.timing import machine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    settings = Settings.for_device(device)
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": "python -m scripts.dev.gpu_check " + shlex.join(sys.argv[1:] if argv is None else argv),
        "device": device,
        "gpus": gpus,
        "machine": machine(torch.device(device)),
        "torch": torch.__version__,
        "settings": {
            "prompts": settings.prompts,
            "max_new_tokens": settings.new_tokens,
            "capture_samples": settings.capture_samples,
        },
        "steps": [],
    }
    for step in plan(settings, out, args.head, gpus):
        name = step["name"] if isinstance(step, dict) else step.name
        if name not in args.steps:
            continue
        print(f"gpu-check: {name} ...", flush=True)
        record = step if isinstance(step, dict) else run_step(step, out / "logs", args.step_timeout, REPO)
        report["steps"].append(record)
        write_report(report, out)
        print(f"gpu-check: {name}: {record.get('skipped') or ('pass' if record['passed'] else 'FAIL')}", flush=True)
    write_report(report, out)
    print(markdown(report))
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] is True else 1)
