"""Capture throughput as a ratio to a bare target forward over the same batches (goal: >= 0.9x).

    python -m scripts.bench.capture --config configs/demo-eagle3.yaml [--samples 256] [--repeats 3]
        [--engine-python .venv-engines/bin/python]

Both sides run on the same length-sorted, padded batches in one process, alternating, best of
``repeats``: the bare side is ``target(input_ids, attention_mask)`` (what any user would run); the
capture side is what ``data_recipes.capture`` does per shard: the decoder forward with layer hooks,
the copy into the store dtype and the atomic shard write. With ``--engine-python`` a third side is the
capture through vLLM (``capture.engine: vllm``): a server started first, then the same shards from its
states files. ``scripts.bench.scale`` times the same sides
at real model shapes.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
from transformers import PreTrainedModel

from headstart.core.config_files import load_config
from headstart.core.models import load_target
from headstart.core.runtime import resolve_dtype
from headstart.core.settings import parse
from headstart.core.timing import timed
from headstart.data_recipes.capture import capture_shard
from headstart.data_recipes.engine_capture import EngineStates, engine_states_for
from headstart.data_recipes.recipes import Sample, load_samples
from headstart.data_recipes.settings import CaptureConfig
from headstart.data_recipes.shards import WriteBehind, write_shard
from headstart.data_recipes.states import StateSource, forward_states, length_batches, resolve_aux_layers


@torch.no_grad()
def bare_forward(
    model: PreTrainedModel, samples: list[Sample], batch_tokens: int, pad_id: int, decoder_only: bool = False
) -> None:
    """The target over ``samples`` in capture's padded batches: the whole model, or (``decoder_only``) its decoder
    without ``lm_head``, the part of the forward capture runs."""
    lengths = [len(s.input_ids) for s in samples]
    run = model.get_decoder() if decoder_only else model
    for batch in length_batches(lengths, batch_tokens):
        longest = max(lengths[i] for i in batch)
        ids = torch.full((len(batch), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):
            ids[row, : lengths[i]] = torch.tensor(samples[i].input_ids)
            mask[row, : lengths[i]] = 1
        run(input_ids=ids.to(model.device), attention_mask=mask.to(model.device))


def capture_to(
    out: Path, states: StateSource, samples: list[Sample], n_aux: int, store_dtype: torch.dtype, shard_samples: int
) -> None:
    """What ``data_recipes.capture`` does for ``samples``: ``capture_shard`` per shard from ``states`` (the target
    here, ``forward_states``, or a vLLM server), each shard's atomic write behind the next one's capture."""
    with WriteBehind() as writer:
        for k in range(0, len(samples), shard_samples):
            shard = samples[k : k + shard_samples]
            tensors = capture_shard(states, shard, list(range(k, k + len(shard))), n_aux, store_dtype)
            writer.put(write_shard, out / f"shard-{k:05d}.safetensors", tensors, "bench")


def best_seconds(device: torch.device, sides: Mapping[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each side's best time of ``repeats``, the sides alternating so that a load change hits them alike."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, side in sides.items():
            seconds[name].append(timed(device, side)[1])
    return {name: min(times) for name, times in seconds.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo-eagle3.yaml")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--engine-python", help="also time the capture through vLLM, served from this venv's Python (.venv-engines)"
    )
    args = parser.parse_args(argv)
    cfg = parse(load_config(args.config), CaptureConfig, args.config)
    model, tokenizer = load_target(
        cfg.target.path, cfg.target.device, cfg.target.dtype, attention=cfg.target.attn_implementation
    )
    data, cap = cfg.data, cfg.capture
    samples, _ = load_samples(data.source, data.format, tokenizer, data.max_length, limit=args.samples)
    samples.sort(key=lambda s: -len(s.input_ids))
    aux_layers = resolve_aux_layers(cap.aux_layers, model.config.num_hidden_layers)
    store_dtype = resolve_dtype(cap.store_dtype)
    pad_id = tokenizer.pad_token_id or 0
    tokens = sum(len(s.input_ids) for s in samples)
    batches = length_batches([len(s.input_ids) for s in samples], cap.batch_tokens)

    here = forward_states(model, aux_layers, cap.batch_tokens, pad_id)
    folder = Path(cap.out_dir).parent if Path(cap.out_dir).parent.exists() else None
    with tempfile.TemporaryDirectory(dir=folder) as tmp, ExitStack() as stack:
        sides: dict[str, Callable[[], object]] = {
            "bare": lambda: bare_forward(model, samples, cap.batch_tokens, pad_id),
            "capture": lambda: capture_to(Path(tmp), here, samples, len(aux_layers), store_dtype, cap.shard_samples),
        }
        if args.engine_python:  # the server is started (and answering) before any side is timed
            served_cap = cap.model_copy(update={"engine": "vllm", "engine_python": args.engine_python})
            opening = engine_states_for(cfg.target, served_cap, data.max_length, aux_layers, Path(tmp) / "engine")
            engine = stack.enter_context(opening)
            served = partial(_served_states, engine)
            sides["vllm"] = lambda: capture_to(
                Path(tmp), served, samples, len(aux_layers), store_dtype, cap.shard_samples
            )
        best = best_seconds(model.device, sides, args.repeats)
    bare_tps, capture_tps = tokens / best["bare"], tokens / best["capture"]
    device = (
        torch.cuda.get_device_name(model.device)
        if model.device.type == "cuda"
        else (f"CPU, {torch.get_num_threads()} threads")
    )
    print(
        f"target {cfg.target.path} ({model.dtype}), {len(samples)} samples, {tokens:,} tokens, "
        f"{len(batches)} batches of <= {cap.batch_tokens} tokens, layers {aux_layers} + last -> {store_dtype}, "
        f"{device}"
    )
    print(f"| side | tokens/s (best of {args.repeats}) |\n|---|---|")
    print(
        f"| bare target forward | {bare_tps:,.0f} |\n| capture (forward + hooks + shard write) | {capture_tps:,.0f} |"
    )
    if "vllm" in best:
        vllm_tps = tokens / best["vllm"]
        print(f"| capture through vLLM (requests, states files, final norm, shard write) | {vllm_tps:,.0f} |")
        print(f"vLLM capture / transformers capture = {vllm_tps / capture_tps:.2f}x")
    print(f"capture / bare = {capture_tps / bare_tps:.2f}x (goal >= 0.9x)")


def _served_states(engine: EngineStates, samples: list[Sample], sample_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    return engine([s.input_ids for s in samples], sample_ids)


if __name__ == "__main__":
    main()
