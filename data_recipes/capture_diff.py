"""Two captures of the same conversations side by side: are they the same data? (an engine capture against the
transformers one, a tensor-parallel capture against one process, two store dtypes, ...)

Token ids, loss masks, offsets and sample ids must be identical shard by shard. For each stored layer,
``differences`` measures how far the hidden states are apart in bf16 steps (one step: 2^-7 of the value's power of
two): the share of values one step apart and more than two, and the worst distance beyond a floor of 2^-20 times
the token's largest value (fp32 summation noise of a sum that large, which near zero is many bf16 steps), plus
each token's relative L2 difference. ``python -m scripts.dev.compare_captures`` prints it; ``compare_captures``
is the verdict the tensor-parallel checks (``scripts.bench.scale``, ``scripts.dev.gpu_check``) keep.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from headstart.data_recipes.shards import read_manifest

TOKEN_KEYS = ("input_ids", "loss_mask", "sample_offsets", "sample_ids")
BF16_STEP = 2.0**-7
NOISE_FLOOR = 2.0**-20


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value: |a - b| in bf16 steps of the larger, and the same beyond the token's noise floor."""
    magnitude = torch.maximum(a.abs(), b.abs())
    step = 2.0 ** torch.floor(torch.log2(magnitude.clamp_min(2.0**-126))) * BF16_STEP
    floor = magnitude.amax(-1, keepdim=True) * NOISE_FLOOR
    diff = (a - b).abs()
    return diff / step, (diff - floor).clamp_min(0) / step


def layer_pairs(a: dict, b: dict, manifest: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    hidden = manifest["hidden_size"]
    pairs = [
        (
            f"layer {layer}",
            a["aux_hidden"][:, i * hidden : (i + 1) * hidden],
            b["aux_hidden"][:, i * hidden : (i + 1) * hidden],
        )
        for i, layer in enumerate(manifest["aux_layers"])
    ]
    return [*pairs, ("last (after the final norm)", a["last_hidden"], b["last_hidden"])]


def differences(first: Path, second: Path) -> dict[str, Any]:
    """How two captures of the same conversations differ: ``token_side``, every ``shard: tensor`` whose token
    ids, masks, offsets or sample ids are not equal (that shard's states are then not compared), and per stored
    layer its bf16-step statistics and largest absolute difference."""
    manifest = read_manifest(first)
    if read_manifest(second)["samples_hash"] != manifest["samples_hash"]:
        raise ValueError(f"{first} and {second} hold other conversations (samples_hash differs)")
    token_side: list[str] = []
    totals: dict[str, dict[str, float]] = {}
    relative: dict[str, list[torch.Tensor]] = {}
    for entry in manifest["shards"]:
        a, b = load_file(first / entry["file"]), load_file(second / entry["file"])
        unequal = [f"{entry['file']}: {key}" for key in TOKEN_KEYS if not torch.equal(a[key], b[key])]
        token_side += unequal
        if unequal:
            continue
        for name, x, y in layer_pairs(a, b, manifest):
            x, y = x.float(), y.float()
            steps, beyond = bf16_steps(x, y)
            t = totals.setdefault(name, {"values": 0, "one": 0, "over_two": 0, "worst": 0.0, "max_abs": 0.0})
            t["values"] += x.numel()
            t["one"] += int(((steps > 0) & (steps <= 1)).sum())
            t["over_two"] += int((steps > 2).sum())
            t["worst"] = max(t["worst"], beyond.max().item())
            t["max_abs"] = max(t["max_abs"], (x - y).abs().max().item())
            relative.setdefault(name, []).append((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-12))
    layers = {
        name: t
        | {
            "relative_median": torch.cat(relative[name]).median().item(),
            "relative_max": torch.cat(relative[name]).max().item(),
        }
        for name, t in totals.items()
    }
    return {"samples": manifest["samples"], "tokens": manifest["tokens"], "token_side": token_side, "layers": layers}


def compare_captures(reference: Path, other: Path) -> dict[str, Any]:
    """Whether two captures of the same samples hold the same token ids, loss masks and sample ids shard by
    shard, and how far apart their hidden states are (``differences``: a split target sums its partial products
    in another order, so the states may differ in the last bits)."""
    if [s["file"] for s in read_manifest(reference)["shards"]] != [s["file"] for s in read_manifest(other)["shards"]]:
        return {"token_ids_equal": False, "why": "the captures wrote different shards"}
    found = differences(reference, other)
    unequal = {where.split(": ")[1] for where in found["token_side"]}
    return {
        "token_ids_equal": not unequal - {"loss_mask"},
        "loss_masks_equal": "loss_mask" not in unequal,
        "hidden_max_abs_diff": max((t["max_abs"] for t in found["layers"].values()), default=0.0),
    }
