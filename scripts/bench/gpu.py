"""Speed on one GPU against what the hardware allows, in one short command: ``make gpu-bench`` (issue #52).

    python -m scripts.bench.gpu --out runs/gpu-bench [--budget-s 270] [--allow-cpu]

At the Llama-3.1-8B shape (random weights built on the GPU, bf16, all 32 layers) one run measures, side by side:

1. capture: ``data_recipes.capture``'s path against a bare forward of the same batches (``scale_target``), 16
   samples of 1,024 tokens in 4 shards, so that each shard's write runs behind the next one's forward;
2. head training steps (forward, loss, backward, AdamW) of EAGLE-3 (its exact and its fused training-time-test
   attention, ``train.attention``), EAGLE-3.1, DFlash, DFlash-2 and DSpark at the
   real head shape on one sample of 1K, 2K, 8K and 32K tokens: tokens/s, peak memory and MFU (the step's FLOPs,
   counted from the shapes of the ops it ran by ``torch.utils.flop_counter`` during its warm-up step, over the
   timed step's seconds and the GPU's datasheet bf16 rate, ``scripts.bench.devices``);
3. the verify-step cost curve: 0-64 nodes over the one-token step, at a 1K-token KV cache;
4. the EAGLE-3 draft step in target forwards: one drafting level and the propose + commit base, each over the
   target's one-token step;
5. vanilla decoding at batch 1: ours (``decoding.verify.generate``) against the weight-read floor (the datasheet
   bandwidth over the bytes one step reads: every parameter but the input embedding's, of which it reads a row)
   and against HF ``generate`` with its default cache and with a static cache (which transformers compiles with
   CUDA graphs on CUDA); and ours again with our static cache, each forward a CUDA graph (``decoding.static_cache``,
   ``graphs``: its greedy output checked against the dynamic cache's).

Every figure sits beside its goal in gpu_bench.json and gpu_bench.md under ``--out``, written after every stage
(a killed run keeps what finished). The stages run cheapest first; one that would start after ``--budget-s``
seconds is recorded as skipped, so the command fits a short GPU window (the issue's 5 minutes, the build included).
Without CUDA it refuses unless ``--allow-cpu``: the same stages at a tiny shape, in seconds (the suite's smoke test).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import PreTrainedModel

from headstart.core.io import atomic_write_text
from headstart.core.runtime import prepare_decoding
from headstart.core.timing import timed
from headstart.decoding.proposers import Vanilla
from headstart.decoding.proposers_heads import head_drafter
from headstart.decoding.static_cache import clear_static_cache, setup_static_cache
from headstart.decoding.verify import generate
from headstart.eval.timing import drafting_tokens, machine, measure_drafting, peak_memory_mb
from headstart.heads import head_type as registered_type
from headstart.scripts.bench.capture import best_seconds
from headstart.scripts.bench.devices import DevicePeak, device_peak
from headstart.scripts.bench.scale_shapes import build_target, fused_layers
from headstart.scripts.bench.scale_target import (
    PAD_ID,
    measure_capture,
    measure_verify_curve,
    random_samples,
    reset_peak,
)
from headstart.scripts.bench.train import bench_head, random_batch

# The heads at the published drafts' shapes over an 8B target: a 32k draft vocabulary, EAGLE's 7 TTT steps, DFlash's
# block of 16 with 512 anchors. Options a head type does not have are left out (DFlash-2 drafts over the full vocab);
# "attention" is train.attention's (eagle3_fused: heads.sparse_attention.ttt_attention_fused).
HEADS: dict[str, dict[str, Any]] = {
    "eagle3": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 32000},
    "eagle3_fused": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 32000, "attention": "fused"},
    "eagle31": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 32000, "fc_norm": True, "norm_output": True},
    "dflash": {"type": "dflash", "draft_vocab_size": 32000},
    "dflash2": {"type": "dflash2"},
    "dspark": {"type": "dspark", "draft_vocab_size": 32000},
}
GOAL_ROWS = ("eagle3", "eagle3_fused")  # the HEADS rows whose long-sample ratio and MFU have goals
GOALS = {  # figure: (comparison, bound), as issue #52 states them
    "capture_vs_forward": (">=", 0.9),
    "eagle3_long_vs_short": (">=", 0.4),
    "eagle3_mfu_at_2k": (">=", 0.35),
    "eagle3_fused_long_vs_short": (">=", 0.4),
    "eagle3_fused_mfu_at_2k": (">=", 0.35),
    "vanilla_vs_floor": (">=", 0.6),
    "vanilla_vs_hf_best": (">=", 1.0),
    "vanilla_graphs_vs_floor": (">=", 0.6),
    "vanilla_graphs_vs_hf_best": (">=", 1.0),
    "verify_64_vs_one_token": ("<=", 1.3),
}
NO_GPU = (
    "scripts.bench.gpu measures speed on a GPU: torch.cuda.is_available() is False here (torch {torch}). Run it on a "
    "CUDA machine, or pass --allow-cpu for the same stages at a tiny shape (a smoke test, not a measurement)."
)


@dataclass(frozen=True)
class Settings:
    """The sizes one run measures at: the 8B shape on a GPU, a tiny one (seconds) on a CPU."""

    shape: str
    layers: int | None  # None: as published
    dtype: torch.dtype
    capture: tuple[int, int, int]  # samples, tokens each, samples per shard
    lengths: tuple[int, ...]  # head-step sample lengths: the first is "short", the last "long"
    mfu_length: int
    head_steps: int  # timed, after one counted warm-up
    draft_vocab: int
    kv_length: int
    max_nodes: int
    new_tokens: int
    repeats: int

    @classmethod
    def for_device(cls, device: torch.device) -> Settings:
        if device.type == "cuda":
            return cls("llama-3.1-8b", None, torch.bfloat16, (16, 1024, 4), (1024, 2048, 8192, 32768), 2048, 2, 32000,
                       1024, 64, 64, 2)  # fmt: skip
        return cls("tiny", 4, torch.float32, (4, 64, 2), (64, 128), 128, 1, 256, 64, 16, 8, 2)


def head_spec(name: str, draft_vocab: int) -> dict[str, Any]:
    """``HEADS[name]`` with ``draft_vocab`` where it has a draft vocabulary, less the options its head type lacks."""
    fields = registered_type(HEADS[name]["type"]).options.model_fields
    spec = HEADS[name] | ({"draft_vocab_size": draft_vocab} if "draft_vocab_size" in HEADS[name] else {})
    return {key: value for key, value in spec.items() if key in ("type", "attention") or key in fields}


def head_step(target: PreTrainedModel, name: str, seq_len: int, s: Settings, peak: DevicePeak | None) -> dict[str, Any]:
    """One head type's training step on one random ``seq_len``-token sample: FLOPs counted in the warm-up step,
    then ``s.head_steps`` timed steps."""
    device, text = target.device, target.config
    layers = fused_layers(text.num_hidden_layers)
    torch.manual_seed(0)
    head = bench_head(head_spec(name, s.draft_vocab), layers, target).to(device, s.dtype)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    batch = random_batch(text.vocab_size, text.hidden_size, len(layers), seq_len, s.dtype, device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = head.loss(batch)
        loss.backward()
        optimizer.step()

    reset_peak(device)
    counter = FlopCounterMode(display=False)
    with counter:  # the warm-up: kernel choice and allocations, and the FLOPs of the ops it ran
        step()
    flops = counter.get_total_flops()
    seconds = min(timed(device, step)[1] for _ in range(s.head_steps))
    result = {
        "tokens_per_s": seq_len / seconds,
        "step_s": seconds,
        "tflops_per_step": flops / 1e12,
        "mfu": None if peak is None else flops / seconds / peak.bf16_flops,
        "peak_memory_mb": peak_memory_mb(device),
        "trained_parameters": sum(p.numel() for p in head.parameters() if p.requires_grad),
    }
    return result


def measure_draft_step(target: PreTrainedModel, s: Settings, one_token_ms: float) -> dict[str, Any]:
    """An untrained EAGLE-3 head's drafting cost at ``s.kv_length``: one level of one token, and the propose +
    commit base of a step, each in the target's one-token steps (``one_token_ms``)."""
    layers = fused_layers(target.config.num_hidden_layers)
    torch.manual_seed(0)
    head = bench_head(head_spec("eagle3", s.draft_vocab), layers, target).to(target.device, s.dtype).eval()
    generator, repeats = torch.Generator().manual_seed(0), max(s.repeats, 2)
    length = s.kv_length + drafting_tokens([1], repeats, 2) + 1
    context = torch.randint(target.config.vocab_size, (length,), generator=generator).to(target.device)
    base_ms, (level_ms,) = measure_drafting(head_drafter(head), target, context, s.kv_length, [1], repeats)
    return {
        "kv_length": s.kv_length,
        "level_ms": level_ms,
        "base_ms": base_ms,
        "one_token_ms": one_token_ms,
        "level_in_target_steps": level_ms / one_token_ms,
        "base_in_target_steps": base_ms / one_token_ms,
    }


def read_bytes(target: PreTrainedModel) -> int:
    """The bytes a one-token decoding step reads: every parameter, but a row alone of an untied input embedding."""
    embedding = target.get_input_embeddings().weight
    assert isinstance(embedding, torch.Tensor), "a causal LM's input embedding holds a weight tensor"
    output = target.get_output_embeddings()
    total = sum(p.numel() * p.element_size() for p in target.parameters())
    tied = isinstance(output, torch.nn.Module) and embedding is output.weight
    return total if tied else total - embedding.numel() * embedding.element_size()


def decoding_prompt(target: PreTrainedModel, s: Settings) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(target.config.vocab_size, (1, s.kv_length), generator=generator).to(target.device)


def hf_generate(target: PreTrainedModel, s: Settings, cache: str | None) -> Callable[[], object]:
    """HF ``generate``, greedy, of ``s.new_tokens`` after ``decoding_prompt``; ``cache``: its cache_implementation."""
    prompt, extra = decoding_prompt(target, s), {"cache_implementation": cache} if cache else {}
    # min_new_tokens: a random model may emit its eos at once, and every side must decode as many tokens.
    return lambda: target.generate(  # type: ignore[operator]  # transformers types generate as an attribute
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=s.new_tokens,
        min_new_tokens=s.new_tokens, do_sample=False, pad_token_id=PAD_ID, **extra,
    )  # fmt: skip


def measure_decoding(target: PreTrainedModel, s: Settings, peak: DevicePeak | None) -> dict[str, Any]:
    """Batch-1 greedy decoding of ``s.new_tokens`` after a ``s.kv_length``-token prompt, best of ``s.repeats``:
    ours and HF ``generate`` with its default cache, beside the weight-read floor."""
    prompt = decoding_prompt(target, s)
    sides = {
        "ours": lambda: generate(target, Vanilla(), prompt, s.new_tokens),
        "hf_default": hf_generate(target, s, None),
    }
    seconds = best_seconds(target.device, sides, max(s.repeats, 2))
    floor = None if peak is None else peak.memory_bytes_per_s / read_bytes(target)
    return {
        "prompt_tokens": s.kv_length,
        "new_tokens": s.new_tokens,
        **{f"{name}_tokens_per_s": s.new_tokens / t for name, t in seconds.items()},
        "read_bytes": read_bytes(target),
        "floor_tokens_per_s": floor,
    }


def measure_graphs(target: PreTrainedModel, s: Settings) -> dict[str, Any]:
    """Our vanilla decoding with the static KV cache (``decoding.static_cache``; CUDA graphs on CUDA, eager on a
    CPU): best of ``s.repeats`` after a first run that captures the graphs; the greedy output checked against the
    dynamic cache's."""
    prompt = decoding_prompt(target, s)
    dynamic, _ = generate(target, Vanilla(), prompt, s.new_tokens)
    setup_static_cache(target, s.kv_length + s.new_tokens + 1)
    try:
        (first, _), first_s = timed(target.device, generate, target, Vanilla(), prompt, s.new_tokens)
        run = {"graphs": lambda: generate(target, Vanilla(), prompt, s.new_tokens)}
        seconds = best_seconds(target.device, run, s.repeats)["graphs"]
    finally:
        clear_static_cache(target)
    return {
        "tokens_per_s": s.new_tokens / seconds,
        "first_run_s": first_s,
        "graphs": target.device.type == "cuda",
        "greedy_identical": bool(torch.equal(first, dynamic)),
    }


def measure_hf_static(target: PreTrainedModel, s: Settings) -> dict[str, Any]:
    """HF ``generate`` with a static cache, which transformers compiles (CUDA graphs) on CUDA: best of
    ``s.repeats`` after a first run that compiles."""
    run = hf_generate(target, s, "static")
    _, first_s = timed(target.device, run)
    seconds = best_seconds(target.device, {"static": run}, s.repeats)["static"]
    return {"tokens_per_s": s.new_tokens / seconds, "first_run_s": first_s, "compiled": target.device.type == "cuda"}


def measured(value: Any) -> Any:
    """A stage's result, or None where it did not run or failed."""
    return None if value is None or "error" in value else value


def figures(result: dict[str, Any], s: Settings) -> dict[str, float | None]:
    """The goals' figures from what the stages measured (None where a stage did not run or failed)."""
    capture, verify, decoding, static, graphs = (
        measured(result.get(k)) for k in ("capture", "verify", "decoding", "hf_static", "graphs")
    )
    out: dict[str, float | None] = dict.fromkeys(GOALS)
    if capture:
        out["capture_vs_forward"] = capture["capture_vs_forward"]
    for name in GOAL_ROWS:
        rows = result.get("heads", {}).get(name, {})
        short, long, at_mfu = (measured(rows.get(str(n))) for n in (s.lengths[0], s.lengths[-1], s.mfu_length))
        if short and long:
            out[f"{name}_long_vs_short"] = long["tokens_per_s"] / short["tokens_per_s"]
        if at_mfu:
            out[f"{name}_mfu_at_2k"] = at_mfu["mfu"]
    if verify:
        out["verify_64_vs_one_token"] = verify["relative"][-1]
    if decoding:
        ours, floor = decoding["ours_tokens_per_s"], decoding["floor_tokens_per_s"]
        out["vanilla_vs_floor"] = None if floor is None else ours / floor
        hf = [decoding["hf_default_tokens_per_s"], *([static["tokens_per_s"]] if static else [])]
        out["vanilla_vs_hf_best"] = ours / max(hf)
        if graphs:
            out["vanilla_graphs_vs_floor"] = None if floor is None else graphs["tokens_per_s"] / floor
            out["vanilla_graphs_vs_hf_best"] = graphs["tokens_per_s"] / max(hf)
    return out


def verdict(name: str, value: float | None) -> str:
    if value is None:
        return "not measured"
    op, bound = GOALS[name]
    return "met" if (value >= bound if op == ">=" else value <= bound) else "missed"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# gpu-bench: {result['machine']}",
        "",
        f"{result['shape']} ({result['layers']} layers, {result['dtype']}), torch {result['versions']['torch']}, "
        f"transformers {result['versions']['transformers']}; {result['wall_s']:.0f} s",
        "",
        "| figure | value | goal | verdict |",
        "|---|---|---|---|",
    ]
    for name, value in result["figures"].items():
        op, bound = GOALS[name]
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"| {name} | {shown} | {op} {bound} | {verdict(name, value)} |")
    lines += [
        "",
        "| head | tokens | tokens/s | step (s) | GFLOP/step | MFU | peak (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for head, rows in result.get("heads", {}).items():
        for length, row in rows.items():
            if "error" in row:
                lines.append(f"| {head} | {length} | {row['error']} | | | | |")
                continue
            mfu = "-" if row.get("mfu") is None else f"{row['mfu']:.1%}"
            lines.append(
                f"| {head} | {length} | {row['tokens_per_s']:,.0f} | {row['step_s']:.3f} | "
                f"{row['tflops_per_step'] * 1e3:,.1f} | {mfu} | {row['peak_memory_mb']:,.0f} |"
            )
    for stage in ("capture", "verify", "draft_step", "decoding", "graphs", "hf_static"):
        if stage in result:
            lines += ["", f"**{stage}**: `{json.dumps(result[stage])}`"]
    if result["skipped"]:
        lines += ["", f"Skipped past the {result['budget_s']:.0f} s budget: {', '.join(result['skipped'])}"]
    return "\n".join(lines) + "\n"


def write(out: Path, result: dict[str, Any], s: Settings, started: float) -> None:
    result["figures"] = figures(result, s)
    result["goals"] = {name: f"{op} {bound}" for name, (op, bound) in GOALS.items()}
    result["wall_s"] = time.perf_counter() - started
    atomic_write_text(out / "gpu_bench.json", json.dumps(result, indent=2) + "\n")
    atomic_write_text(out / "gpu_bench.md", markdown(result))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json and gpu_bench.md")
    p.add_argument("--budget-s", type=float, default=270.0, help="no stage starts after this many seconds")
    p.add_argument("--allow-cpu", action="store_true", help="without CUDA: the same stages at a tiny shape")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit(NO_GPU.format(torch=torch.__version__))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = Settings.for_device(device)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    target = build_target(s.shape, s.layers, device, s.dtype)
    prepare_decoding(device)
    name = machine(device)
    peak = device_peak(name) if device.type == "cuda" else None
    result: dict[str, Any] = {
        "machine": name,
        "device_peak": None if peak is None else peak._asdict(),
        "shape": s.shape,
        "layers": target.config.num_hidden_layers,
        "dtype": str(s.dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in target.parameters()),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "command": "python -m scripts.bench.gpu " + " ".join(sys.argv[1:] if argv is None else argv),
        "budget_s": args.budget_s,
        "skipped": [],
    }
    samples = random_samples(target.config.vocab_size, *s.capture[:2], torch.Generator().manual_seed(0))
    layers = fused_layers(target.config.num_hidden_layers)
    stages: list[tuple[str, Callable[[], Any]]] = [
        ("capture", lambda: measure_capture(target, samples, layers, "bf16", args.out, s.repeats, s.capture[2])),
        ("verify", lambda: measure_verify_curve(target, s.kv_length, s.max_nodes, s.repeats, torch.Generator())),
        ("draft_step", lambda: measure_draft_step(target, s, result["verify"]["ms"][0])),
    ]
    # Every head at a length before any at the next: a tight budget drops the longest samples, not a head type.
    stages += [(f"heads/{h}/{n}", partial(head_step, target, h, n, s, peak)) for n in s.lengths for h in HEADS]
    # Decoding before the longest samples (the slowest steps); HF's static cache last: it compiles for minutes.
    stages.insert(-len(HEADS), ("decoding", lambda: measure_decoding(target, s, peak)))
    stages.insert(-len(HEADS), ("graphs", lambda: measure_graphs(target, s)))
    stages.append(("hf_static", lambda: measure_hf_static(target, s)))
    for stage, run in stages:
        if time.perf_counter() - started > args.budget_s or (
            stage == "draft_step" and not measured(result.get("verify"))
        ):
            result["skipped"].append(stage)
            continue
        try:
            value, seconds = timed(device, run)
        except Exception as error:  # noqa: BLE001  # one failed stage is reported; the window's other figures stay
            traceback.print_exc()
            value, seconds = {"error": f"{type(error).__name__}: {str(error)[:300]}"}, float("nan")
            reset_peak(device)
        print(f"gpu-bench: {stage} in {seconds:.1f} s", flush=True)
        if stage.startswith("heads/"):
            _, head, length = stage.split("/")
            result.setdefault("heads", {}).setdefault(head, {})[length] = value
        else:
            result[stage] = value
        write(args.out, result, s, started)
    write(args.out, result, s, started)
    print((args.out / "gpu_bench.md").read_text())
    return result


if __name__ == "__main__":
    main()
