"""``scripts.bench.scale``'s stages 1-4, on the target built at ``--shape``: capture against the bare forward, the
heads' training step, the verification curve over tree sizes, and vanilla decoding against HF ``generate``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from headstart.core.runtime import resolve_dtype
from headstart.data_recipes.recipes import Sample
from headstart.data_recipes.settings import Capture
from headstart.data_recipes.states import OnlineCapture, forward_states
from headstart.decoding.proposers import Vanilla
from headstart.decoding.verify import generate
from headstart.eval.timing import VERIFY_NODES, measure_verify, peak_memory_mb
from headstart.heads import build_head
from headstart.heads import head_type as registered_type
from headstart.scripts.bench.capture import bare_forward, best_seconds, capture_to
from headstart.scripts.bench.train import bench, step_batches

HEAD_TYPES = ("eagle3", "dflash")
PAD_ID = 0  # random tokens need no real pad: every sample is full length


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
    target: PreTrainedModel,
    samples: list[Sample],
    layers: list[int],
    store_dtype: str,
    out: Path,
    repeats: int,
    shard_samples: int = Capture.model_fields["shard_samples"].default,
) -> dict[str, Any]:
    """Tokens/s of the bare forward, the decoder alone and capture over the same batches, best of ``repeats``;
    ``shard_samples`` below the samples makes several shards, each written behind the next one's forward as a
    long capture does."""
    device, dtype = target.device, resolve_dtype(store_dtype)
    batch_tokens = Capture.model_fields["batch_tokens"].default  # capture's, so that the batches are a real run's
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
        "shards": -(-len(samples) // shard_samples),
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
    if "ttt_steps" in registered_type(head_type).options.model_fields:  # training-time-test steps, where it has them
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
