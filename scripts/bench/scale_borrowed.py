"""``scripts.bench.scale``'s stage 5, what training from shards loads: a checkpoint whose index names every tensor
but whose decoder files are missing or garbage, loaded borrowed-only in a fresh process for its own peak RSS.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PretrainedConfig, PreTrainedModel

from headstart.core.memory import TargetSizes
from headstart.core.weights import INDEX_NAME, borrowed_names, meta_model
from headstart.eval.timing import machine
from headstart.scripts.bench.scale_shapes import shape_config

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
model, tokenizer = load_target(folder, "cpu", dtype, borrowed_only=True)
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
BUNDLED_TARGET = Path(__file__).resolve().parents[2] / "assets" / "demo-target"  # its tokenizer: load_target loads one


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
    names, borrowed = _borrowed_files(model, config)
    weight_map, missing, garbage = _decoder_files(names, borrowed, config.get_text_config().num_hidden_layers)
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


def _borrowed_files(model: PreTrainedModel, config: PretrainedConfig) -> tuple[list[str], dict[str, str]]:
    """The checkpoint's tensor names (a tied lm_head is not one) and the file each borrowed tensor goes to: the
    embedding in one, lm_head and the final norm in another (the norm beside the embedding when lm_head is tied)."""
    roles = borrowed_names(model)
    tied = config.get_text_config().tie_word_embeddings
    names = [n for n in model.state_dict() if not (tied and n == roles.get("lm_head"))]
    files = {"embed": "model-embed.safetensors", "lm_head": "model-lm-head.safetensors"}
    files["norm"] = files["lm_head"] if "lm_head" in roles and not tied else files["embed"]
    return names, {roles[role]: files[role] for role in roles if roles[role] in names}


def _decoder_files(
    names: list[str], borrowed: dict[str, str], layers: int
) -> tuple[dict[str, str], set[str], set[str]]:
    """The index's weight map, and the decoder layers' files left missing (even layers) or garbage (odd)."""
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
    return weight_map, missing, garbage


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
