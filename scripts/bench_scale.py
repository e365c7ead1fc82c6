"""Headstart's data and decoding paths at real model shapes, with random weights built in memory (issue #19).

    python -m scripts.bench_scale --shape llama-3.1-8b --out runs/bench-scale [--device auto] [--dtype bf16]
        [--layers N] [--seq-len 2048] [--kv-length 2048] [--compare-generate 64]

Nothing is downloaded: the target is built from its published shape (transformers' config class,
``from_config``, seeded random init), at full depth on a GPU and ``--layers`` deep (default 4) on a CPU.
One run measures, side by side:

1. capture: ``data_recipes.capture``'s own path (``capture_shard`` and the atomic shard write, run by
   ``scripts.bench_capture``) against the bare forward of the same batches (goal >= 0.9x), and against the
   decoder alone (the forward without ``lm_head``, which capture skips);
2. head training: ``scripts.bench_train``'s step (forward, loss, backward, AdamW) for EAGLE-3 and DFlash at
   the real head shape (the target's hidden size, a 32k draft vocabulary, TTT 7, sequences of 2048), with
   peak memory;
3. verification: ``eval.timing.measure_verify``'s step over trees of 0..64 nodes at a KV length, relative
   to the one-token decoding step (0 nodes);
4. with ``--compare-generate N``: our vanilla decoding against HF ``generate`` over N new tokens.

It writes bench_scale.json and bench_scale.md under ``--out``. Random weights change no timing (the kernels
are the same whatever the values) but make acceptance meaningless, so nothing here measures acceptance.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from headstart.core.io import atomic_write_text
from headstart.core.models import default_aux_layers
from headstart.core.runtime import prepare_decoding, resolve_device, resolve_dtype
from headstart.core.schema import Capture
from headstart.core.timing import timed
from headstart.data_recipes.capture import OnlineCapture
from headstart.data_recipes.recipes import Sample
from headstart.eval.proposers import Vanilla
from headstart.eval.timing import VERIFY_NODES, machine, measure_verify, peak_memory_mb
from headstart.eval.verify import generate
from headstart.heads import build_head
from headstart.scripts.bench_capture import bare_forward, best_seconds, capture_to
from headstart.scripts.bench_train import bench, step_batches

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3 = {
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
}
# The published configs' shapes (hub config.json of each model); "tiny" is the test's, seconds on a CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "tie_word_embeddings": True,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192},
    },
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
}
CPU_LAYERS = 4  # the fewest that give EAGLE-3 and DFlash three distinct layers to fuse (``fused_layers``)
HEAD_TYPES = ("eagle3", "dflash")
PAD_ID = 0  # random tokens need no real pad: every sample is full length


def build_target(shape: str, layers: int | None, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The shape's model with random weights from torch's seeded generator, ``layers`` deep (None: as published),
    frozen, with the attention kernel ``core.models.load_model`` picks.

    Built on ``device`` itself: an 8B model initialised on the host first takes minutes and its size in RAM.
    """
    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def fused_layers(num_layers: int) -> list[int]:
    """The target layers capture stores and the heads fuse: EAGLE-3's defaults (2, L//2, L-3) where the depth has
    them, else three spread ones. The heads' cost depends on their count (the fused input is 3 x hidden), not on
    which layers they are."""
    if num_layers >= 7:
        return default_aux_layers(num_layers)
    if num_layers < CPU_LAYERS:
        raise ValueError(
            f"--layers {num_layers}: EAGLE-3 and DFlash fuse three distinct layers of 1..L-1, "
            f"so the target needs at least {CPU_LAYERS}"
        )
    return [1, num_layers // 2, num_layers - 1]


def random_samples(vocab_size: int, count: int, length: int, generator: torch.Generator) -> list[Sample]:
    """``count`` samples of ``length`` random tokens, every one a label (as in an all-assistant chat)."""
    ids = torch.randint(vocab_size, (count, length), generator=generator)
    return [Sample(row.tolist(), [1] * length, f"random:{i}") for i, row in enumerate(ids)]


def reset_peak(device: torch.device) -> None:
    """Start a stage's peak from what is allocated now (CUDA); a CPU process's peak RSS cannot be reset."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure_capture(
    target: PreTrainedModel, samples: list[Sample], layers: list[int], store_dtype: str, out: Path, repeats: int
) -> dict[str, Any]:
    """Tokens/s of the bare forward, the decoder alone and capture over the same batches, best of ``repeats``."""
    device, dtype = target.device, resolve_dtype(store_dtype)
    # Capture's own defaults, so that the batches are the ones a real capture forwards.
    batch_tokens, shard_samples = (
        Capture.model_fields["batch_tokens"].default,
        Capture.model_fields["shard_samples"].default,
    )
    reset_peak(device)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        sides = {
            "forward": partial(bare_forward, target, samples, batch_tokens, PAD_ID),
            "decoder": partial(bare_forward, target, samples, batch_tokens, PAD_ID, decoder_only=True),
            "capture": partial(
                capture_to, Path(tmp), target, samples, layers, dtype, batch_tokens, shard_samples, PAD_ID
            ),
        }
        seconds = best_seconds(device, sides, repeats)
    tokens = sum(len(s.input_ids) for s in samples)
    rates = {name: tokens / s for name, s in seconds.items()}
    return {
        "samples": len(samples),
        "tokens": tokens,
        "batch_tokens": batch_tokens,
        "aux_layers": layers,
        "store_dtype": store_dtype,
        **{f"{name}_tokens_per_s": rate for name, rate in rates.items()},
        "capture_vs_forward": rates["capture"] / rates["forward"],
        "capture_vs_decoder": rates["capture"] / rates["decoder"],
        "peak_memory_mb": peak_memory_mb(device),
    }


def scale_head_options(head_type: str, layers: list[int], draft_vocab: int, ttt_steps: int) -> dict[str, Any]:
    """The head at the real training shape: a ``draft_vocab`` vocabulary; EAGLE-3 with ``ttt_steps`` TTT steps,
    DFlash with its defaults (one layer, blocks of 16, 512 anchors per sequence)."""
    options: dict[str, Any] = {"type": head_type, "layer_ids": layers, "draft_vocab_size": draft_vocab}
    if head_type == "eagle3":
        options["ttt_steps"] = ttt_steps
    return options


def measure_heads(
    target: PreTrainedModel,
    samples: list[Sample],
    layers: list[int],
    args: argparse.Namespace,
) -> dict[str, dict[str, Any]]:
    """Tokens/s and peak memory of each head's training step on ``samples``' captured states.

    The head computes in the target's dtype: what DeepSpeed's bf16 mode runs forward and backward in (it
    also keeps fp32 master weights, which this step does not).
    """
    capture = OnlineCapture(target, layers, resolve_dtype(args.store_dtype))
    _, batches = step_batches(samples, args.head_batch, PAD_ID, capture)
    out = {}
    for head_type in HEAD_TYPES:
        torch.manual_seed(args.seed)
        options = scale_head_options(head_type, layers, args.draft_vocab, args.ttt_steps)
        head = build_head(options, target).to(target.dtype)
        reset_peak(target.device)
        tokens_per_s = bench(head, batches, args.head_steps)
        out[head_type] = {
            "tokens_per_s": tokens_per_s,
            "peak_memory_mb": peak_memory_mb(target.device),
            "trained_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
            "batch": [args.head_batch, args.seq_len],
            "steps": args.head_steps,
            **{k: v for k, v in head.config.options.model_dump().items() if k in ("draft_vocab_size", "ttt_steps")},
        }
        del head  # before the next head's peak starts
    return out


def measure_verify_curve(
    target: PreTrainedModel, kv_length: int, max_nodes: int, repeats: int, generator: torch.Generator
) -> dict[str, Any]:
    """Median ms of a verification step per tree size at KV length ``kv_length``, and each over the 0-node step
    (verifying the root alone: one token, as plain decoding)."""
    context = torch.randint(target.config.vocab_size, (kv_length + 1,), generator=generator).to(target.device)
    nodes = [n for n in VERIFY_NODES if n <= max_nodes]
    ms = measure_verify(target, context, nodes, [1], repeats)[1]
    return {"kv_length": kv_length, "nodes": nodes, "ms": ms, "relative": [m / ms[0] for m in ms]}


def compare_generate(
    target: PreTrainedModel, prompt_len: int, new_tokens: int, repeats: int, generator: torch.Generator
) -> dict[str, Any]:
    """Tokens/s of our vanilla decoding (``eval.verify.generate``) and HF ``generate``, greedy, same prompt."""
    prompt = torch.randint(target.config.vocab_size, (1, prompt_len), generator=generator).to(target.device)

    def hf() -> None:
        # min_new_tokens: a random model may emit its eos at once, and both sides must decode as many tokens.
        target.generate(  # type: ignore[operator]  # transformers types generate as a module attribute
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
        )

    seconds = best_seconds(
        target.device, {"ours": lambda: generate(target, Vanilla(), prompt, new_tokens), "hf": hf}, repeats
    )
    ours, theirs = new_tokens / seconds["ours"], new_tokens / seconds["hf"]
    return {
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "ours_tokens_per_s": ours,
        "hf_generate_tokens_per_s": theirs,
        "ours_vs_hf": ours / theirs,
    }


def markdown(result: dict[str, Any]) -> str:
    """The run's figures as the tables docs/BENCHMARKS.md holds."""
    cap, verify, t = result["capture"], result["verify"], result["target"]
    lines = [
        f"{result['shape']} shape, {t['num_hidden_layers']} of {t['published_layers']} layers, "
        f"{t['parameters'] / 1e9:.2f}B parameters, {result['dtype']}, {result['machine']}",
        "",
        f"| capture ({cap['samples']} x {cap['tokens'] // cap['samples']} tokens, layers {cap['aux_layers']} + last "
        f"-> {cap['store_dtype']}) | tokens/s |",
        "|---|---|",
        f"| bare forward (with lm_head) | {cap['forward_tokens_per_s']:,.0f} |",
        f"| decoder alone (no lm_head) | {cap['decoder_tokens_per_s']:,.0f} |",
        f"| capture (decoder + hooks + store copy + shard write) | {cap['capture_tokens_per_s']:,.0f} |",
        f"| **capture / forward** (goal >= 0.9x) | **{cap['capture_vs_forward']:.2f}x** |",
        f"| capture / decoder | {cap['capture_vs_decoder']:.2f}x |",
        "",
        "| head step | batch x seq | trained parameters | tokens/s | peak memory (MB) |",
        "|---|---|---|---|---|",
    ]
    for head_type, head in result["heads"].items():
        extra = f", TTT {head['ttt_steps']}" if "ttt_steps" in head else ""
        lines.append(
            f"| {head_type} (draft vocab {head['draft_vocab_size']:,}{extra}) | {head['batch'][0]} x "
            f"{head['batch'][1]} | {head['trained_parameters'] / 1e6:,.1f}M | {head['tokens_per_s']:,.1f} "
            f"| {head['peak_memory_mb']:,.0f} |"
        )
    lines += [
        "",
        f"| tree nodes (KV length {verify['kv_length']}) | " + " | ".join(map(str, verify["nodes"])) + " |",
        "|---" * (len(verify["nodes"]) + 1) + "|",
        "| verify ms | " + " | ".join(f"{m:.1f}" for m in verify["ms"]) + " |",
        "| / 1-token step | " + " | ".join(f"{r:.2f}" for r in verify["relative"]) + " |",
    ]
    if "generate" in result:
        gen = result["generate"]
        lines += [
            "",
            f"vanilla decoding, {gen['new_tokens']} new tokens after {gen['prompt_tokens']}: ours "
            f"{gen['ours_tokens_per_s']:.1f} tokens/s, HF generate {gen['hf_generate_tokens_per_s']:.1f} "
            f"({gen['ours_vs_hf']:.2f}x)",
        ]
    return "\n".join(lines) + "\n"


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
    parser.add_argument("--capture-samples", type=int, default=16)
    parser.add_argument("--store-dtype", choices=["bf16", "fp32", "fp8_e4m3"], default="bf16")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt-steps", type=int, default=7)
    parser.add_argument("--head-batch", type=int, default=1, help="samples per head step")
    parser.add_argument("--head-steps", type=int, default=5, help="timed head steps (after one warm-up step)")
    parser.add_argument("--kv-length", type=int, default=2048, help="KV length the verify steps run at")
    parser.add_argument("--max-nodes", type=int, default=64)
    parser.add_argument("--compare-generate", type=int, metavar="N", help="also time vanilla decoding of N tokens")
    parser.add_argument("--repeats", type=int, default=3, help="capture and generate: best of; verify: median of")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    counts = ["layers", "seq_len", "capture_samples", "draft_vocab", "ttt_steps", "head_batch", "head_steps"]
    for name in [*counts, "kv_length", "compare_generate", "repeats"]:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.head_batch > args.capture_samples:
        parser.error(f"--head-batch {args.head_batch} needs as many samples: raise --capture-samples to it")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    layers = args.layers if args.layers is not None or device.type == "cuda" else CPU_LAYERS
    torch.manual_seed(args.seed)
    target = build_target(args.shape, layers, device, dtype)
    prepare_decoding(device)
    fused = fused_layers(target.config.num_hidden_layers)
    generator = torch.Generator().manual_seed(args.seed)
    samples = random_samples(target.config.vocab_size, args.capture_samples, args.seq_len, generator)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = target.config
    result: dict[str, Any] = {
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
        "device": str(device),
        "dtype": args.dtype,
        "machine": machine(device),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": "python -m scripts.bench_scale " + " ".join(sys.argv[1:] if argv is None else argv),
        "peak_memory": "CUDA: per stage, from what was allocated at its start (the target included); "
        "CPU: the process's peak resident set so far",
    }
    stages: dict[str, Callable[[], dict[str, Any]]] = {
        "capture": lambda: measure_capture(target, samples, fused, args.store_dtype, out, args.repeats),
        "heads": lambda: measure_heads(target, samples[: args.head_batch], fused, args),
        "verify": lambda: measure_verify_curve(target, args.kv_length, args.max_nodes, args.repeats, generator),
    }
    if args.compare_generate:
        stages["generate"] = lambda: compare_generate(
            target, args.kv_length, args.compare_generate, args.repeats, generator
        )
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
