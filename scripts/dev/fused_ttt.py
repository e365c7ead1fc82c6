"""``train.attention: fused`` against the exact training-time-test attention on the device at hand (a step of
``make gpu-check``): values and gradients of ``heads.sparse_attention.ttt_attention`` both ways.

    python -m scripts.dev.fused_ttt --out runs/gpu-check/fused-ttt [--device cuda] [--seq-len 2048] [--steps 7]

For every training-time-test step j (1..steps-1; step 0 is plain causal attention) and each dtype: fp32, where the
fused path must equal the exact one to float rounding; bf16, where both round, each is compared with the exact
path in fp32 from the same inputs and the fused path passes when its error is at most twice the exact path's (and
under a floor). Writes fused_ttt.json (``passed`` and the worst errors); exit 1 when any comparison fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from headstart.core.io import atomic_write_text
from headstart.heads.sparse_attention import ttt_attention

FP32_TOLERANCE = 2e-4  # relative to the output's largest magnitude, values and gradients
BF16_FLOOR = 2e-2  # bf16 keeps 8 bits: errors below this fraction of the largest magnitude pass whatever the ratio


def outputs(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], fused: bool, dtype: torch.dtype,
            weights: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
    """The attention output and the gradients of (output * weights).sum() for q, every key and value, in fp32."""
    inputs = [t.detach().to(dtype).requires_grad_() for t in (q, *keys, *values)]
    steps = len(keys)
    out = ttt_attention(inputs[0], inputs[1 : 1 + steps], inputs[1 + steps :], fused=fused)
    grads = torch.autograd.grad((out * weights.to(dtype)).sum(), inputs)
    return [t.detach().float() for t in (out, *grads)]


def worst_error(mine: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest difference of any tensor over that tensor's largest reference magnitude."""
    return max(
        float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(mine, reference, strict=True)
    )


def compare(device: torch.device, seq_len: int, steps: int, heads: int, kv_heads: int, dim: int) -> dict[str, Any]:
    gen = torch.Generator(device).manual_seed(0)
    rows: list[dict[str, Any]] = []
    for j in range(1, steps):
        q = torch.randn(1, heads, seq_len, dim, generator=gen, device=device)
        keys = [torch.randn(1, kv_heads, seq_len, dim, generator=gen, device=device) for _ in range(j + 1)]
        values = [torch.randn(1, kv_heads, seq_len, dim, generator=gen, device=device) for _ in range(j + 1)]
        weights = torch.randn(q.shape, generator=gen, device=device)
        reference = outputs(q, keys, values, False, torch.float32, weights)
        fused32 = worst_error(outputs(q, keys, values, True, torch.float32, weights), reference)
        exact16 = worst_error(outputs(q, keys, values, False, torch.bfloat16, weights), reference)
        fused16 = worst_error(outputs(q, keys, values, True, torch.bfloat16, weights), reference)
        passed = fused32 <= FP32_TOLERANCE and fused16 <= max(2 * exact16, BF16_FLOOR)
        rows.append({"step": j, "fp32_fused": fused32, "bf16_exact": exact16, "bf16_fused": fused16, "passed": passed})
    return {"device": str(device), "seq_len": seq_len, "heads": [heads, kv_heads, dim], "steps": rows,
            "passed": all(row["passed"] for row in rows)}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m scripts.dev.fused_ttt", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for fused_ttt.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=7, help="training-time-test steps (EAGLE-3's 7)")
    p.add_argument("--heads", type=int, nargs=3, default=[32, 8, 128], metavar=("HEADS", "KV_HEADS", "DIM"))
    args = p.parse_args(argv)
    result = compare(torch.device(args.device), args.seq_len, args.steps, *args.heads)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "fused_ttt.json", json.dumps(result, indent=2) + "\n")
    for row in result["steps"]:
        print(json.dumps(row))
    if not result["passed"]:
        sys.exit(f"fused training-time-test attention differs from the exact path on {args.device}")
    return result


if __name__ == "__main__":
    main()
