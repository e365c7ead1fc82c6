"""Training memory and speed against the sequence length: one head step per head type and length, each in a fresh
process, at the bundled target's shape or a published one.

    python -m scripts.bench.train_lengths --seq-lens 512,2048,8192,32768 [--heads eagle3,peagle,dflash]
    python -m scripts.bench.train_lengths --shape llama-3.1-8b --seq-lens 512,1024,2048 --dtype bf16
    python -m scripts.bench.train_lengths --shape llama-3.1-8b --seq-lens 8192,32768,65536 --dtype bf16 \
        --device cuda --steps 2

One step is what training does per micro-batch of one sample of that length: the head's forward, loss (the target's
distributions from ``last_hidden`` through its lm_head included), backward and an AdamW step, on random states of the
target's shape (the captured layers and the last hidden state) and random tokens. The target is its borrowed tensors
only (embedding, final norm, lm_head: what training from shards loads); a published shape gets a random-weight
checkpoint of them (``scale_borrowed.write_borrowed_checkpoint``). Per line: the process's peak memory, the step's
own peak above what was resident before it, the last step's seconds and tokens/s (``--steps``: one on a CPU, not
warmed up; a GPU's first step also picks its kernels), beside ``core.memory``'s estimate of the step's peak (its
activations, gradients and AdamW moments); then the per-token slope of the step's peak between the two longest
lengths and, for a GPU of ``--device-gb``, the longest sample it would hold at that slope. On the CPU memory is the
resident set (``/proc/self/clear_refs`` resets its high-water mark); on ``--device cuda`` it is what PyTorch's
allocator handed out (``torch.cuda.max_memory_allocated``), the figure that runs out first on a GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from headstart.core import memory as core_memory
from headstart.core.memory import head_activations, head_training_parts
from headstart.core.models import load_target
from headstart.core.runtime import resolve_dtype
from headstart.scripts.bench.scale_shapes import SHAPES, fused_layers, shape_config
from headstart.scripts.bench.train import bench_head, random_batch

BUNDLED_TARGET = "assets/demo-target"
HEADS = {  # the head options each measured head type trains with (the demo's sizes)
    "eagle3": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 2048},
    "eagle3_fused": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 2048, "attention": "fused"},
    "peagle": {"type": "eagle3", "ttt_steps": 7, "draft_vocab_size": 2048, "parallel_drafting": True},
    "dflash": {"type": "dflash", "block_size": 16, "num_anchors": 512, "draft_vocab_size": 2048},
}


def rss_gb(field: str) -> float:
    """This process's ``VmRSS`` or ``VmHWM`` (its peak) in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The process's memory now and its peak since ``reset``, in GB: the resident set on a CPU, the allocator's
    tensors on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 1e9
        return rss_gb("VmRSS")

    def peak(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        return rss_gb("VmHWM")

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM back to the current RSS

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def one_step(
    target_dir: str,
    head_name: str,
    seq_len: int,
    dtype: str,
    seed: int,
    recompute: str,
    device: str,
    steps: int,
    gpu_score_scale: int,
) -> dict[str, Any]:
    """The measurement of ``steps`` training steps on one sample in this process (the child's work)."""
    torch.manual_seed(seed)
    core_memory.GPU_SCORE_SCALE = gpu_score_scale  # read at each chunking: the A/B of a GPU's chunk size
    where = torch.device(device)
    target, _ = load_target(target_dir, device, dtype, borrowed_only=True)
    text = target.config.get_text_config()
    layers = fused_layers(text.num_hidden_layers)
    head = bench_head(HEADS[head_name], layers, target).to(where, resolve_dtype(dtype))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4)
    if recompute != "auto":  # train.checkpoint_steps
        head.checkpoint_steps = recompute == "true"
    compute = resolve_dtype(dtype)
    batch = random_batch(text.vocab_size, text.hidden_size, len(layers), seq_len, compute, where)
    options = head.config.options
    parts = head_training_parts(head, 0, 1, bf16=False)  # what the step adds: gradients and AdamW's moments
    estimate = parts["gradients"] + parts["optimizer"] + head_activations(
        target.config, seq_len, len(layers), options.trained_depth(), options.draft_vocab(), compute,
        head.recomputes(seq_len), where,
    )  # fmt: skip
    memory = PeakMemory(where)
    before = memory.now()
    memory.reset()
    for _ in range(steps):  # the last one timed: on a GPU the first also picks its kernels
        memory.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss, _ = head.loss(batch)
        loss.backward()
        optimizer.step()
        memory.synchronize()
        seconds = time.perf_counter() - start
    return {
        "head": head_name,
        "seq_len": seq_len,
        "device": device,
        "peak_gb": memory.peak(),
        "step_peak_gb": memory.peak() - before,
        "estimate_gb": estimate / 1e9,
        "recomputed": head.recomputes(seq_len),
        "score_budget": core_memory.score_budget(where),
        "seconds": seconds,
        "tokens_per_s": seq_len / seconds,
        "loss": float(loss),
    }


def describe(line: dict[str, Any]) -> str:
    if "error" in line:
        return str(line["error"])
    peak, step = line["peak_gb"], line["step_peak_gb"]
    estimate = f" (estimate {line['estimate_gb']:.2f})" if "estimate_gb" in line else ""
    speed = f"{line['seconds']:.1f} s, {line['tokens_per_s']:,.0f} tokens/s"
    kind = "GPU memory" if line.get("device", "cpu").startswith("cuda") else "RSS"
    return f"peak {kind} {peak:.2f} GB, step {step:.2f} GB{estimate}, {speed}"


def run_child(target_dir: str, head: str, seq_len: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "headstart.scripts.bench.train_lengths", "--child", target_dir, head]
    command += [str(seq_len), args.dtype, str(args.seed), args.checkpoint_steps, args.device, str(args.steps)]
    command += [str(args.gpu_score_scale)]
    timeout = args.timeout
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"head": head, "seq_len": seq_len, "error": f"over {timeout} s"}
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["killed"]
        return {"head": head, "seq_len": seq_len, "error": f"exit {done.returncode}: {tail[0][:200]}"}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def longest_fit(lines: list[dict[str, Any]], device_gb: float) -> dict[str, float] | None:
    """Per-token slope of the step's peak between the two longest measured lengths, and the length whose step
    peak reaches ``device_gb`` at that slope (linear growth assumed: the point of the measurement)."""
    done = sorted((line for line in lines if "error" not in line), key=lambda line: line["seq_len"])
    if len(done) < 2:
        return None
    short, long = done[-2], done[-1]
    slope = (long["step_peak_gb"] - short["step_peak_gb"]) / (long["seq_len"] - short["seq_len"])
    fixed = long["step_peak_gb"] - slope * long["seq_len"]
    return {"gb_per_1k_tokens": 1000 * slope, "longest_tokens": (device_gb - fixed) / slope if slope > 0 else 0.0}


def main(argv: list[str] | None = None) -> None:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        folder, name, length, dtype, seed, recompute, device, steps, scale = sys.argv[2:11]
        line = one_step(folder, name, int(length), dtype, int(seed), recompute, device, int(steps), int(scale))
        print(json.dumps(line))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lens", default="512,2048,8192", help="comma-separated sample lengths")
    parser.add_argument("--heads", default=",".join(HEADS), help=f"comma-separated, of {', '.join(HEADS)}")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="a published shape (default: bundled)")
    parser.add_argument("--dtype", default="fp32", help="the target's and the head's dtype")
    parser.add_argument("--device", default="cpu", help="where the step runs: cpu or cuda")
    parser.add_argument("--steps", type=int, default=1, help="training steps per process, the last one timed")
    parser.add_argument(
        "--gpu-score-scale",
        type=int,
        default=core_memory.GPU_SCORE_SCALE,
        help="a GPU's chunk of scores over a CPU's (core.memory.GPU_SCORE_SCALE; 1: a CPU's chunks)",
    )
    parser.add_argument("--device-gb", type=float, default=80.0, help="the GPU the longest sample is sized for")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one step may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--checkpoint-steps", default="auto", choices=["auto", "true", "false"], help="train.checkpoint_steps"
    )
    parser.add_argument("--out", default=None, help="write the lines as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        target_dir = BUNDLED_TARGET
        if args.shape is not None:
            from headstart.scripts.bench.scale_borrowed import write_borrowed_checkpoint

            target_dir = str(Path(work) / args.shape)
            write_borrowed_checkpoint(Path(target_dir), shape_config(args.shape, 4), args.seed)
        where = f"borrowed tensors, {args.dtype}, {args.device}"
        print(f"target {args.shape or BUNDLED_TARGET} ({where}), one sample per step")
        results: dict[str, Any] = {"shape": args.shape or "bundled", "dtype": args.dtype, "device": args.device}
        results["heads"] = {}
        for head in args.heads.split(","):
            lines = []
            for seq_len in (int(n) for n in args.seq_lens.split(",")):
                line = run_child(target_dir, head, seq_len, args)
                lines.append(line)
                print(f"{head:>7} {seq_len:>6} tokens: {describe(line)}")
            fit = longest_fit(lines, args.device_gb)
            if fit is not None:
                slope, longest = fit["gb_per_1k_tokens"], fit["longest_tokens"]
                print(f"{head:>7}: {slope:.3f} GB per 1k tokens: {longest:,.0f} tokens fit {args.device_gb:g} GB")
            results["heads"][head] = {"lines": lines, "fit": fit}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
