"""Headstart's data and decoding paths at real model shapes, with random weights built in memory (issue #19).

    python -m scripts.bench.scale --shape llama-3.1-8b --out runs/bench-scale [--device auto] [--dtype bf16]
        [--layers N] [--seq-len 2048] [--kv-length 2048] [--compare-generate 64]
        [--borrowed-shapes llama-3.1-8b,llama-3.3-70b] [--capture-tp 1,2] [--stages borrowed,capture-tp]

Nothing is downloaded: the target is built from its published shape (transformers' config class,
``from_config``, seeded random init), at full depth on a GPU and ``--layers`` deep (default 4) on a CPU.
One run measures, side by side:

1. capture: ``data_recipes.capture``'s own path (``capture_shard`` and the atomic shard write, run by
   ``scripts.bench.capture``) against the bare forward of the same batches (goal >= 0.9x), and against the
   decoder alone (the forward without ``lm_head``, which capture skips);
2. head training: ``scripts.bench.train``'s step (forward, loss, backward, AdamW) for EAGLE-3 and DFlash at
   the real head shape (the target's hidden size, a 32k draft vocabulary, TTT 7, sequences of 2048), with
   peak memory;
3. verification: ``eval.timing.measure_verify``'s step over trees of 0..64 nodes at a KV length, relative
   to the one-token decoding step (0 nodes);
4. with ``--compare-generate N``: our vanilla decoding against HF ``generate`` over N new tokens;
5. with ``--borrowed-shapes``: the peak memory of what training from shards loads (``core.models.load_target``
   with ``borrowed_only=True``, then ``core.fingerprint.weights_hash``), each shape at its published depth and
   ``--borrowed-layers`` deep, in a fresh process each (its own peak RSS: VmHWM, as Linux's ru_maxrss
   also counts the RSS of the process that started it), from a sharded safetensors checkpoint
   written to a temporary folder: its index names every tensor of the model, but only the embedding, final
   norm and lm_head (seeded random bf16) are real; the decoder layers' files are missing or garbage. Beside
   it, what the whole target would take (parameters x 2 bytes);
6. with ``--capture-tp 1,2``: ``data_recipes.capture`` on the bundled target (``--capture-config``,
   ``data.limit`` = ``--capture-samples``), one process for tp 1, ``torchrun --nproc_per_node N ...
   target.tp_size=N`` otherwise, each into a fresh folder, best of ``--repeats``: the tokens/s capture
   prints, its ratio to tp 1, and whether every tp size wrote the same token ids.

``--stages`` picks which run (default: 1-3, with 4-6 when their flags are given); ``--stages borrowed,capture-tp``
builds no target at ``--shape``.

It writes bench_scale.json and bench_scale.md under ``--out``. Random weights change no timing (the kernels
are the same whatever the values) but make acceptance meaningless, so nothing here measures acceptance.

This module holds the command line and the run; the shapes are in ``scale_shapes``, stages 1-4 in
``scale_target``, 5 in ``scale_borrowed``, 6 in ``scale_capture_tp`` and the Markdown in ``scale_report``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from headstart.core.io import atomic_write_text
from headstart.core.runtime import prepare_decoding, resolve_device, resolve_dtype
from headstart.core.timing import timed
from headstart.eval.timing import machine
from headstart.scripts.bench.scale_borrowed import measure_borrowed
from headstart.scripts.bench.scale_capture_tp import measure_capture_tp
from headstart.scripts.bench.scale_report import markdown
from headstart.scripts.bench.scale_shapes import CPU_LAYERS, SHAPES, build_target, fused_layers
from headstart.scripts.bench.scale_target import (
    compare_generate,
    measure_capture,
    measure_heads,
    measure_verify_curve,
    random_samples,
)

Stage = Callable[[], dict[str, Any]]  # one stage's measurement, run (and timed) by main in order
TARGET_STAGES = ("capture", "heads", "verify", "generate")  # the ones that build the --shape target
STAGES = (*TARGET_STAGES, "borrowed", "capture-tp")
DEFAULT_BORROWED_SHAPES = "llama-3.1-8b,llama-3.3-70b"
DEFAULT_CAPTURE_TP = "1,2"


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _names(choices: tuple[str, ...] | list[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"{unknown or text!r}: expected comma-separated names of {list(choices)}")
        return names

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--out", required=True, help="folder for bench_scale.json and bench_scale.md")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument(
        "--layers", type=int, help=f"target depth; default: as published on a GPU, {CPU_LAYERS} on a CPU"
    )
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sample, capture and head training")
    parser.add_argument(
        "--capture-samples", type=int, default=16, help="samples of the capture stage, and data.limit of --capture-tp"
    )
    parser.add_argument("--store-dtype", choices=["bf16", "fp32", "fp8_e4m3"], default="bf16")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--head-batch", type=int, default=1, help="samples per head step")
    parser.add_argument("--head-steps", type=int, default=5, help="timed head steps (after one warm-up step)")
    parser.add_argument("--kv-length", type=int, default=2048, help="KV length the verify steps run at")
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--compare-generate", type=int, metavar="N", help="also time vanilla decoding of N tokens")
    parser.add_argument(
        "--borrowed-shapes",
        type=_names(sorted(SHAPES)),
        help=f"also measure what training from shards loads at these shapes (stage borrowed; default "
        f"{DEFAULT_BORROWED_SHAPES} when the stage is named in --stages)",
    )
    parser.add_argument("--borrowed-layers", type=int, default=4, help="the shallow depth the borrowed stage compares")
    parser.add_argument(
        "--capture-tp",
        type=_int_list,
        help=f"also time capture of the bundled target at these tp sizes (stage capture-tp; default "
        f"{DEFAULT_CAPTURE_TP})",
    )
    parser.add_argument("--capture-config", default="configs/demo-eagle3.yaml", help="the capture-tp stage's config")
    parser.add_argument(
        "--stages",
        type=_names(STAGES),
        help="comma-separated, of: " + ", ".join(STAGES) + "; default: capture, heads, verify, and generate, "
        "borrowed, capture-tp where their flags are given",
    )
    parser.add_argument("--repeats", type=int, default=3, help="capture and generate: best of; verify: median of")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = ["layers", "seq_len", "capture_samples", "draft_vocab", "ttt_steps", "head_batch", "head_steps"]
    for name in [*counts, "kv_length", "compare_generate", "borrowed_layers", "repeats"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.head_batch > args.capture_samples:
        parser.error(f"--head-batch {args.head_batch} needs as many samples: raise --capture-samples to it")
    if args.stages is None:
        flagged = {"generate": args.compare_generate, "borrowed": args.borrowed_shapes, "capture-tp": args.capture_tp}
        args.stages = ["capture", "heads", "verify", *(stage for stage, flag in flagged.items() if flag)]
    if "generate" in args.stages and not args.compare_generate:
        parser.error("stage generate needs --compare-generate N (the new tokens)")
    if "borrowed" in args.stages and args.borrowed_shapes is None:
        args.borrowed_shapes = DEFAULT_BORROWED_SHAPES.split(",")
    if "capture-tp" in args.stages and args.capture_tp is None:
        args.capture_tp = _int_list(DEFAULT_CAPTURE_TP)
    return args


def target_stages(
    args: argparse.Namespace, device: torch.device, dtype: torch.dtype, out: Path
) -> tuple[dict[str, Any], dict[str, Stage]]:
    """Build the ``--shape`` target: what it is (for the result), and those of ``args.stages`` that run on it."""
    layers = args.layers if args.layers is not None or device.type == "cuda" else CPU_LAYERS
    torch.manual_seed(args.seed)
    target = build_target(args.shape, layers, device, dtype)
    prepare_decoding(device)
    fused = fused_layers(target.config.num_hidden_layers)
    generator = torch.Generator().manual_seed(args.seed)
    samples = random_samples(target.config.vocab_size, args.capture_samples, args.seq_len, generator)
    config = target.config
    described = {
        "shape": args.shape,
        "target": {
            "model_type": config.model_type,
            "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size,
            "num_hidden_layers": config.num_hidden_layers,
            "published_layers": SHAPES[args.shape]["num_hidden_layers"],
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "vocab_size": config.vocab_size,
            "tie_word_embeddings": config.tie_word_embeddings,
            "parameters": sum(p.numel() for p in target.parameters()),
        },
    }
    stages: dict[str, Stage] = {
        "capture": lambda: measure_capture(target, samples, fused, args.store_dtype, out, args.repeats),
        "heads": lambda: measure_heads(target, samples[: args.head_batch], fused, args),
        "verify": lambda: measure_verify_curve(target, args.kv_length, args.max_nodes, args.repeats, generator),
        "generate": lambda: compare_generate(target, args.kv_length, args.compare_generate, args.repeats, generator),
    }
    return described, {name: stage for name, stage in stages.items() if name in args.stages}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    stages: dict[str, Stage] = {}
    if any(stage in TARGET_STAGES for stage in args.stages):
        described, stages = target_stages(args, device, dtype, out)
        result |= described
    if "borrowed" in args.stages:
        stages["borrowed"] = lambda: measure_borrowed(args.borrowed_shapes, args.borrowed_layers, out, args.seed)
    if "capture-tp" in args.stages:
        capture_device = device.type if args.device == "auto" else args.device  # each rank: its own GPU
        stages["capture_tp"] = lambda: measure_capture_tp(
            args.capture_tp, args.capture_config, args.capture_samples, capture_device, args.repeats, out
        )
    result |= {
        "device": str(device),
        "dtype": args.dtype,
        "machine": machine(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": "python -m scripts.bench.scale " + " ".join(sys.argv[1:] if argv is None else argv),
        "peak_memory": "CUDA: per stage, from what was allocated at its start (the target included); "
        "CPU: the process's peak resident set so far; borrowed: each load's own process",
    }
    for name, stage in stages.items():
        result[name], seconds = timed(device, stage)
        print(f"{name}: measured in {seconds:.0f} s", flush=True)  # a full-depth GPU run takes minutes
    report = markdown(result)
    atomic_write_text(out / "bench_scale.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "bench_scale.md", report)
    print(report)
    return result


if __name__ == "__main__":
    main()
