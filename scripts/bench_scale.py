"""Headstart's data and decoding paths at real model shapes, with random weights built in memory (issue #19).

    python -m scripts.bench_scale --shape llama-3.1-8b --out runs/bench-scale [--device auto] [--dtype bf16]
        [--layers N] [--seq-len 2048] [--kv-length 2048] [--compare-generate 64]
        [--borrowed-shapes llama-3.1-8b,llama-3.3-70b] [--capture-tp 1,2] [--stages borrowed,capture-tp]

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
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from headstart.core.io import atomic_write_text
from headstart.core.memory import TargetSizes
from headstart.core.models import default_aux_layers
from headstart.core.runtime import prepare_decoding, resolve_device, resolve_dtype
from headstart.core.schema import Capture
from headstart.core.timing import timed
from headstart.core.weights import INDEX_NAME, borrowed_names, meta_model
from headstart.data_recipes.capture import OnlineCapture, forward_states
from headstart.data_recipes.recipes import Sample
from headstart.data_recipes.shards import read_manifest
from headstart.decoding.proposers import Vanilla
from headstart.decoding.verify import generate
from headstart.eval.timing import VERIFY_NODES, machine, measure_verify, peak_memory_mb
from headstart.heads import build_head
from headstart.scripts.bench_capture import bare_forward, best_seconds, capture_to
from headstart.scripts.bench_train import bench, step_batches
from headstart.scripts.compare_captures import differences

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
    "llama-3.3-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "rope_parameters": {**_LLAMA3_ROPE, "factor": 8.0, "original_max_position_embeddings": 8192},
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
TARGET_STAGES = ("capture", "heads", "verify", "generate")  # the ones that build the --shape target
STAGES = (*TARGET_STAGES, "borrowed", "capture-tp")
REPO = Path(__file__).resolve().parents[1]
BUNDLED_TARGET = REPO / "assets" / "demo-target"
DEFAULT_BORROWED_SHAPES = "llama-3.1-8b,llama-3.3-70b"
DEFAULT_CAPTURE_TP = "1,2"


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
                capture_to,
                Path(tmp),
                forward_states(target, layers, batch_tokens, PAD_ID),
                samples,
                len(layers),
                dtype,
                shard_samples,
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
    """Tokens/s of our vanilla decoding (``decoding.verify.generate``) and HF ``generate``, greedy, same prompt."""
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


# ---- 5. what training from shards loads: the borrowed tensors of a checkpoint whose decoder cannot be read ----

BORROWED_CHILD = """
import json, resource, sys, time
from headstart.core.fingerprint import weights_hash
from headstart.core.models import load_target
from headstart.core.weights import borrowed_names

def ru_maxrss_mb():  # KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10

def peak_mb():
    # This process's own peak: Linux's ru_maxrss also counts the RSS of the process that exec'd it (the
    # bench, holding what it just wrote), VmHWM is the peak of this address space alone.
    try:
        status = open("/proc/self/status").read().splitlines()
    except OSError:
        return ru_maxrss_mb()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10

folder, dtype = sys.argv[1], sys.argv[2]
imports = peak_mb()
start = time.perf_counter()
model, tokenizer = load_target({"path": folder, "device": "cpu", "dtype": dtype}, borrowed_only=True)
loaded, after_load = time.perf_counter(), peak_mb()
digest = weights_hash(folder, dtype)
hashed = time.perf_counter()
borrowed = {id(p): p for p in (model.get_parameter(n) for n in borrowed_names(model).values())}
print(json.dumps({
    "peak_rss_mb": peak_mb(),
    "ru_maxrss_mb": ru_maxrss_mb(),
    "peak_rss_after_load_mb": after_load,
    "imports_rss_mb": imports,
    "load_s": loaded - start,
    "hash_s": hashed - loaded,
    "borrowed_bytes": sum(p.numel() * p.element_size() for p in borrowed.values()),
    "borrowed_dtype": str(next(iter(borrowed.values())).dtype),
    "parameters_loaded": sum(p.numel() for p in model.parameters() if not p.is_meta),
    "parameters_on_meta": sum(p.numel() for p in model.parameters() if p.is_meta),
    "weights_hash": digest,
}))
"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def shape_config(shape: str, layers: int | None = None) -> PretrainedConfig:
    """The shape's transformers config, ``layers`` deep (None: as published), saved as bf16 weights."""
    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    return AutoConfig.for_model(settings.pop("model_type"), dtype="bfloat16", **settings)


def random_bf16(shape: tuple[int, ...], generator: torch.Generator, chunk: int = 1 << 24) -> torch.Tensor:
    """A bf16 tensor of N(0, 0.02^2) values from ``generator``, filled ``chunk`` values at a time (no fp32 copy of
    a GB-sized table)."""
    out = torch.empty(shape, dtype=torch.bfloat16)
    flat = out.view(-1)
    for start in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - start)
        flat[start : start + n] = torch.randn(n, generator=generator) * 0.02
    return out


def write_borrowed_checkpoint(
    folder: Path, config: PretrainedConfig, seed: int, borrowed_from: Path | None = None
) -> dict[str, Any]:
    """A sharded safetensors checkpoint of ``config`` in ``folder`` whose index names every tensor of the model (its
    module tree built on the meta device) and whose files hold only the tensors a head borrows: the embedding
    in one file, lm_head and the final norm in another (seeded random bf16; hard links to ``borrowed_from``'s
    files when given, the same shape at another depth). Decoder layer i's tensors are indexed to a file of
    their own that is missing (even i) or garbage bytes (odd i), so anything that reads one fails. The tokenizer
    is the bundled target's (``load_target`` loads one). Returns what was written."""
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (BUNDLED_TARGET / name).exists():
            shutil.copy(BUNDLED_TARGET / name, folder / name)
    model = meta_model(config)
    roles = borrowed_names(model)
    tied = config.get_text_config().tie_word_embeddings
    names = [n for n in model.state_dict() if not (tied and n == roles.get("lm_head"))]
    files = {"embed": "model-embed.safetensors", "lm_head": "model-lm-head.safetensors"}
    files["norm"] = files["lm_head"] if "lm_head" in roles and not tied else files["embed"]
    borrowed = {roles[role]: files[role] for role in roles if roles[role] in names}
    layers = config.get_text_config().num_hidden_layers
    weight_map: dict[str, str] = {}
    missing: set[str] = set()
    garbage: set[str] = set()
    for name in names:
        if name in borrowed:
            weight_map[name] = borrowed[name]
            continue
        match = re.search(r"\.layers\.(\d+)\.", name)
        if match is None:
            raise ValueError(f"{name}: neither a borrowed tensor nor a decoder layer's; this checkpoint has no file")
        layer = int(match.group(1))
        weight_map[name] = file = f"model-layer-{layer + 1:05d}-of-{layers:05d}.safetensors"
        (garbage if layer % 2 else missing).add(file)
    for file in sorted(garbage):
        (folder / file).write_bytes(os.urandom(4096))  # no safetensors header: any read raises
    generator = torch.Generator().manual_seed(seed)
    for file in sorted(set(borrowed.values())):
        if borrowed_from is not None:
            os.link(borrowed_from / file, folder / file)
            continue
        shapes = {n: tuple(model.get_parameter(n).shape) for n, f in borrowed.items() if f == file}
        save_file({n: random_bf16(s, generator) for n, s in shapes.items()}, folder / file, metadata={"format": "pt"})
        gc.collect()  # the next file's tables only after this one's are gone
    index = {"metadata": {"note": "bench_scale: borrowed tensors only; decoder files missing or garbage"}}
    (folder / INDEX_NAME).write_text(json.dumps({**index, "weight_map": weight_map}, indent=1) + "\n")
    return {
        "index_tensors": len(weight_map),
        "borrowed_tensors": sorted(borrowed),
        "decoder_files_missing": len(missing),
        "decoder_files_garbage": len(garbage),
        "bytes_on_disk": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
    }


def run_borrowed_child(folder: Path, dtype: str) -> dict[str, Any]:
    """``BORROWED_CHILD`` on ``folder`` in a fresh Python: its peak RSS is the load's own, nothing of this one's."""
    done = subprocess.run(
        [sys.executable, "-c", BORROWED_CHILD, str(folder), dtype], capture_output=True, text=True, timeout=1800
    )
    if done.returncode:
        raise RuntimeError(f"the borrowed-tensor load of {folder} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure_borrowed(shapes: list[str], shallow_layers: int, out: Path, seed: int) -> dict[str, Any]:
    """Per shape, at its published depth and ``shallow_layers`` deep: peak RSS of loading the borrowed tensors and
    fingerprinting the checkpoint, in bf16 on the CPU, against the whole target's size (parameters x 2 bytes)."""
    result: dict[str, Any] = {
        "dtype": "bf16",
        "device": "cpu",
        "machine": machine(torch.device("cpu")),
        "shallow_layers": shallow_layers,
        "shapes": {},
    }
    for shape in shapes:
        runs: dict[str, dict[str, Any]] = {}
        # One folder per shape, gone before the next shape's tables are written (a 70B one holds 4.2 GB).
        with tempfile.TemporaryDirectory(dir=out, prefix=f"borrowed-{shape}-") as tmp:
            first: Path | None = None
            for label, layers in {"published": None, "shallow": shallow_layers}.items():
                config = shape_config(shape, layers)
                folder = Path(tmp) / f"{config.num_hidden_layers}-layers"
                start = time.perf_counter()
                written = write_borrowed_checkpoint(folder, config, seed, borrowed_from=first)
                write_s = time.perf_counter() - start
                first = first or folder
                sizes = TargetSizes.of(config)
                runs[label] = {
                    "layers": config.num_hidden_layers,
                    **written,
                    "write_s": write_s,
                    **run_borrowed_child(folder, "bf16"),
                    "parameters": sizes.parameters,
                    "whole_target_bytes": sizes.parameters * 2,
                    "memory_estimate_bytes": sizes.borrowed * 2,  # core.memory's figure for the same tensors
                }
                print(
                    f"borrowed: {shape} at {config.num_hidden_layers} layers, peak RSS "
                    f"{runs[label]['peak_rss_mb']:,.0f} MB",
                    flush=True,
                )
        published, shallow = runs["published"], runs["shallow"]
        result["shapes"][shape] = {
            **runs,
            "peak_published_vs_shallow": published["peak_rss_mb"] / shallow["peak_rss_mb"],
            "whole_target_vs_borrowed": published["whole_target_bytes"] / published["borrowed_bytes"],
            "whole_target_vs_peak_rss": published["whole_target_bytes"] / (published["peak_rss_mb"] * 2**20),
        }
    return result


# ---- 6. capture throughput of a split target: tp 1 against torchrun tp N on the bundled target ----

CAPTURE_RATE = re.compile(r"capture: wrote .* \(([\d,.]+) tokens/s")


def capture_command(config: str, tp_size: int, out_dir: Path, samples: int, device: str) -> list[str]:
    """``data_recipes.capture`` of ``samples`` samples into ``out_dir``: one process for tp 1, else ``tp_size``
    torchrun processes splitting the target."""
    overrides = [f"data.limit={samples}", f"capture.out_dir={out_dir}", f"target.device={device}"]
    if tp_size == 1:
        return [sys.executable, "-m", "data_recipes.capture", "--config", config, *overrides]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp_size)]
    return [*torchrun, "-m", "data_recipes.capture", "--config", config, *overrides, f"target.tp_size={tp_size}"]


def compare_captures(reference: Path, other: Path) -> dict[str, Any]:
    """Whether two captures of the same samples hold the same token ids, loss masks and sample ids shard by
    shard, and how far apart their hidden states are (``scripts.compare_captures``: a split target sums its
    partial products in another order, so the states may differ in the last bits)."""
    if [s["file"] for s in read_manifest(reference)["shards"]] != [s["file"] for s in read_manifest(other)["shards"]]:
        return {"token_ids_equal": False, "why": "the captures wrote different shards"}
    found = differences(reference, other)
    unequal = {where.split(": ")[1] for where in found["token_side"]}
    return {
        "token_ids_equal": not unequal - {"loss_mask"},
        "loss_masks_equal": "loss_mask" not in unequal,
        "hidden_max_abs_diff": max((t["max_abs"] for t in found["layers"].values()), default=0.0),
    }


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_capture_tp(
    tp_sizes: list[int], config: str, samples: int, device: str, repeats: int, out: Path
) -> dict[str, Any]:
    """Capture tokens/s (the rate capture prints: its capture loop, rank 0's) and process wall time at each tp
    size, best of ``repeats`` with the sizes alternating; each process gets cores / tp threads, so every size
    uses the whole CPU."""
    runs: dict[int, dict[str, Any]] = {
        tp: {"tp_size": tp, "threads_per_process": max(1, cpu_cores() // tp), "tokens_per_s": [], "wall_s": []}
        for tp in tp_sizes
    }
    with tempfile.TemporaryDirectory(dir=out, prefix="capture-tp-") as tmp:
        last: dict[int, Path] = {}
        for repeat in range(repeats):
            for tp in tp_sizes:
                out_dir = Path(tmp) / f"tp{tp}-{repeat}"
                cmd = capture_command(config, tp, out_dir, samples, device)
                env = {**os.environ, "OMP_NUM_THREADS": str(runs[tp]["threads_per_process"])}
                start = time.perf_counter()
                done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
                wall = time.perf_counter() - start
                rate = CAPTURE_RATE.search(done.stdout)
                if done.returncode or rate is None:
                    raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                runs[tp]["command"] = " ".join(cmd)
                runs[tp]["tokens_per_s"].append(float(rate.group(1).replace(",", "")))
                runs[tp]["wall_s"].append(wall)
                if tp in last:
                    shutil.rmtree(last[tp])
                last[tp] = out_dir
                print(f"capture-tp: tp {tp}, {runs[tp]['tokens_per_s'][-1]:,.0f} tokens/s, {wall:.1f} s", flush=True)
        base = last[tp_sizes[0]]
        manifest = read_manifest(base)
        same = {tp: compare_captures(base, last[tp]) for tp in tp_sizes[1:]}
    best = {tp: max(run["tokens_per_s"]) for tp, run in runs.items()}
    return {
        "config": config,
        "samples": manifest["samples"],
        "tokens": manifest["tokens"],
        "compute_dtype": manifest["compute_dtype"],
        "device": device,
        "cores": cpu_cores(),
        "repeats": repeats,
        "runs": {
            str(tp): {
                **run,
                "best_tokens_per_s": best[tp],
                "best_wall_s": min(run["wall_s"]),
                "vs_first": best[tp] / best[tp_sizes[0]],
            }
            for tp, run in runs.items()
        },
        "same_as_first": {str(tp): entry for tp, entry in same.items()},
    }


def markdown(result: dict[str, Any]) -> str:
    """The run's figures as the tables docs/BENCHMARKS.md holds: a section per stage that ran."""
    lines: list[str] = []
    if "target" in result:
        t = result["target"]
        lines += [
            f"{result['shape']} shape, {t['num_hidden_layers']} of {t['published_layers']} layers, "
            f"{t['parameters'] / 1e9:.2f}B parameters, {result['dtype']}, {result['machine']}",
        ]
    else:
        lines += [result["machine"]]
    if "capture" in result:
        cap = result["capture"]
        lines += [
            "",
            f"| capture ({cap['samples']} x {cap['tokens'] // cap['samples']} tokens, layers {cap['aux_layers']} "
            f"+ last -> {cap['store_dtype']}) | tokens/s |",
            "|---|---|",
            f"| bare forward (with lm_head) | {cap['forward_tokens_per_s']:,.0f} |",
            f"| decoder alone (no lm_head) | {cap['decoder_tokens_per_s']:,.0f} |",
            f"| capture (decoder + hooks + store copy + shard write) | {cap['capture_tokens_per_s']:,.0f} |",
            f"| **capture / forward** (goal >= 0.9x) | **{cap['capture_vs_forward']:.2f}x** |",
            f"| capture / decoder | {cap['capture_vs_decoder']:.2f}x |",
        ]
    if "heads" in result:
        lines += [
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
    if "verify" in result:
        verify = result["verify"]
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
    if "borrowed" in result:
        lines += ["", *borrowed_markdown(result["borrowed"])]
    if "capture_tp" in result:
        lines += ["", *capture_tp_markdown(result["capture_tp"])]
    return "\n".join(lines) + "\n"


def borrowed_markdown(borrowed: dict[str, Any]) -> list[str]:
    lines = [
        f"| training from shards loads (bf16, {borrowed['machine']}, a fresh process each) | layers | borrowed "
        "tensors (GB) | whole target (GB) | peak RSS, load (MB) | peak RSS, load + fingerprint (MB) | RSS of the "
        "imports (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, entry in borrowed["shapes"].items():
        for label in ("published", "shallow"):
            run = entry[label]
            lines.append(
                f"| {shape} ({label}) | {run['layers']} | {run['borrowed_bytes'] / 1e9:.2f} | "
                f"{run['whole_target_bytes'] / 1e9:.1f} | {run['peak_rss_after_load_mb']:,.0f} | "
                f"{run['peak_rss_mb']:,.0f} | {run['imports_rss_mb']:,.0f} |"
            )
    lines.append("")
    for shape, entry in borrowed["shapes"].items():
        run = entry["published"]
        lines.append(
            f"- {shape}: peak at {run['layers']} layers / at {entry['shallow']['layers']} = "
            f"**{entry['peak_published_vs_shallow']:.3f}x**; whole target / borrowed tensors = "
            f"{entry['whole_target_vs_borrowed']:.1f}x; whole target / peak RSS = "
            f"{entry['whole_target_vs_peak_rss']:.1f}x "
            f"({run['index_tensors']} tensors indexed, {run['decoder_files_missing']} decoder files missing and "
            f"{run['decoder_files_garbage']} garbage)"
        )
    return lines


def capture_tp_markdown(tp: dict[str, Any]) -> list[str]:
    first = next(iter(tp["runs"]))
    lines = [
        f"| capture, bundled target ({tp['samples']} samples, {tp['tokens']:,} tokens, {tp['compute_dtype']}, "
        f"{tp['device']}, best of {tp['repeats']}) | processes x threads | tokens/s | process wall (s) "
        f"| vs tp {first} |",
        "|---|---|---|---|---|",
    ]
    for size, run in tp["runs"].items():
        lines.append(
            f"| tp {size} | {size} x {run['threads_per_process']} | {run['best_tokens_per_s']:,.0f} | "
            f"{run['best_wall_s']:.1f} | **{run['vs_first']:.2f}x** |"
        )
    for size, same in tp["same_as_first"].items():
        diff = same.get("hidden_max_abs_diff")
        lines.append(
            f"\ntp {size} vs tp {first}: token ids {'equal' if same['token_ids_equal'] else 'DIFFERENT'}"
            + (f", hidden states max |diff| {diff:.3g}" if diff is not None else "")
        )
    return lines


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}
    stages: dict[str, Callable[[], dict[str, Any]]] = {}
    if any(stage in TARGET_STAGES for stage in args.stages):
        layers = args.layers if args.layers is not None or device.type == "cuda" else CPU_LAYERS
        torch.manual_seed(args.seed)
        target = build_target(args.shape, layers, device, dtype)
        prepare_decoding(device)
        fused = fused_layers(target.config.num_hidden_layers)
        generator = torch.Generator().manual_seed(args.seed)
        samples = random_samples(target.config.vocab_size, args.capture_samples, args.seq_len, generator)
        config = target.config
        result |= {
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
        target_stages: dict[str, Callable[[], dict[str, Any]]] = {
            "capture": lambda: measure_capture(target, samples, fused, args.store_dtype, out, args.repeats),
            "heads": lambda: measure_heads(target, samples[: args.head_batch], fused, args),
            "verify": lambda: measure_verify_curve(target, args.kv_length, args.max_nodes, args.repeats, generator),
            "generate": lambda: compare_generate(
                target, args.kv_length, args.compare_generate, args.repeats, generator
            ),
        }
        stages |= {name: stage for name, stage in target_stages.items() if name in args.stages}
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
        "command": "python -m scripts.bench_scale " + " ".join(sys.argv[1:] if argv is None else argv),
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
