"""Hidden-state capture: run the frozen target over the samples and keep what the heads learn from.

    python -m data_recipes.capture --config configs/demo-eagle3.yaml [key=value ...]

Offline, the states go to safetensors shards (``data_recipes.shards``); online, ``OnlineCapture``
computes the very same tensors inside the training step. Both come from ``data_recipes.states`` (the target's
forward, or a vLLM server).

What to write is fixed first (``data_recipes.capture_plan``: the samples, their shards and fingerprint, the shards
a killed run already finished); this module runs the target over the shards still to do and writes each one
atomically, so a killed capture continues where it died and ends byte-identical to an uninterrupted one; a finished
capture is verified byte for byte (sha256) before a re-run calls it complete. One capture writes a folder at a time
(``core.io.output_lock``).

Across processes and machines: ``torchrun --nproc_per_node N [--nnodes M ...] -m data_recipes.capture
--config ...`` gives rank r the shards k with k % world == r, each on the rank's own device (LOCAL_RANK
on a GPU box), in a folder every node sees. Rank 0 holds the folder's lock and writes the manifest once
every shard exists. The shards are the ones a single process writes, byte for byte, and a re-run with
any number of processes resumes from whatever shards a killed run left.
Before it starts, the run prints its storage estimate and refuses to start when the disk is short
(or read-only).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoConfig, PreTrainedModel

from headstart.core.config_files import load_config, run_command
from headstart.core.io import output_lock
from headstart.core.memory import check_memory
from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.core.runtime import Ranks, barrier, join_process_group, rank_device
from headstart.core.settings import parse
from headstart.data_recipes.capture_plan import (
    CAPTURE_MEMORY_REMEDY,
    CaptureJob,
    announce,
    capture_memory,
    check_max_length,
    finished_shards,
    plan_capture,
    token_tensors,
)
from headstart.data_recipes.engine_capture import check_engine, engine_states_for
from headstart.data_recipes.recipes import Sample
from headstart.data_recipes.settings import CaptureConfig
from headstart.data_recipes.shards import (
    FP8,
    MANIFEST,
    StatesError,
    WriteBehind,
    check_finite,
    check_states,
    file_sha256,
    read_manifest,
    shard_name,
    store_hidden,
    verify_capture,
    write_manifest,
    write_shard,
)
from headstart.data_recipes.states import StateSource, VisionRows, forward_states


def capture_shard(
    states: StateSource,
    samples: list[Sample],
    sample_ids: list[int],
    n_aux: int,
    store_dtype: torch.dtype,
    hidden_size: int | None = None,
    vision: VisionRows | None = None,
) -> dict[str, torch.Tensor]:
    """One shard's tensors: its samples' states, as stored (``store_hidden``), end to end along the tokens; for a
    vision-language target also which rows are image placeholders and the draft's positions (``VisionRows``).

    Each sample's states are checked first (``check_states``: a row per token, the target's ``hidden_size``,
    float, finite), and again once cast to ``store_dtype`` (fp16 overflows where bf16 does not): concatenated,
    one sample's extra rows and another's missing ones would pass for aligned.

    On a GPU the host waits once per shard: each sample's stored values are copied without blocking into one
    pinned host buffer per tensor, and their finiteness is read in the same synchronisation; only a shard that
    fails is checked again sample by sample, to name the first bad one."""
    found = states(samples, sample_ids)
    if len(found) != len(samples):
        raise StatesError(f"samples {sample_ids[:8]}...: {len(found)} states for {len(samples)} samples")
    for sample, sample_id, one in zip(samples, sample_ids, found):
        check_states(one, len(sample.input_ids), hidden_size, n_aux, f"sample {sample_id}", finite=False)
    stored = [store_hidden(one, store_dtype, n_aux) for one in found]
    flags = [torch.isfinite(v).all() for one in (*found, *stored) for v in one.values() if v.dtype != FP8]
    host = host_buffers(stored)
    # The shard's one wait for the device, after the copies were queued: it also completes them before the writer
    # thread reads the buffers (every shard has float states to check, so the wait always happens).
    if flags and not bool(torch.stack(flags).all()):
        for sample, sample_id, one, kept in zip(samples, sample_ids, found, stored):
            check_states(one, len(sample.input_ids), hidden_size, n_aux, f"sample {sample_id}")
            for key, value in kept.items():
                if value.dtype != FP8:
                    check_finite(value, f"sample {sample_id}: {key} stored as {store_dtype} (capture.store_dtype)")
    return token_tensors(samples, sample_ids, vision) | host


# Page-locked host memory is scarce (the OS cannot swap it) and slow to allocate in large blocks: a shard tensor
# larger than this is copied into pageable memory, one blocking copy per sample, as before pinning.
PINNED_BYTES = 2 * 2**30


def host_buffers(stored: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each key's per-sample tensors end to end in one host tensor: from a GPU, a pinned buffer (up to
    ``PINNED_BYTES``) filled by non-blocking copies, complete once the device is synchronised; plain copies
    otherwise."""
    out = {}
    for key in stored[0] if stored else {}:
        pieces = [one[key] for one in stored]
        first = pieces[0]
        rows = sum(len(piece) for piece in pieces)
        shape = (rows, *first.shape[1:])
        pinned = first.device.type == "cuda" and math.prod(shape) * first.element_size() <= PINNED_BYTES
        buffer = torch.empty(shape, dtype=first.dtype, pin_memory=pinned)
        start = 0
        for piece in pieces:
            buffer[start : start + len(piece)].copy_(piece, non_blocking=pinned)
            start += len(piece)
        out[key] = buffer
    return out


@contextmanager
def state_source(
    cfg: CaptureConfig,
    model: PreTrainedModel | None,
    aux_layers: list[int],
    pad_id: int,
    out_dir: Path,
    started: bool = True,
) -> Iterator[StateSource]:
    """Where the states come from while the block runs: the target loaded here, or a vLLM server (the one at
    ``capture.base_url``, or one started for the block, its log and request files under ``out_dir/engine``).
    ``started=False``: a rank with no shard to capture connects to no server."""
    if model is not None or not started:
        yield forward_states(model, aux_layers, cfg.capture.batch_tokens, pad_id) if model else _no_states
        return
    with engine_states_for(cfg.target, cfg.capture, cfg.data.max_length, aux_layers, out_dir / "engine") as engine:
        yield lambda samples, sample_ids: engine([s.input_ids for s in samples], sample_ids)


def _no_states(samples: list[Sample], sample_ids: list[int]) -> list[dict[str, torch.Tensor]]:
    raise AssertionError("a rank with no shard to capture asked for states")


def capture_ranks(cfg: CaptureConfig) -> tuple[Ranks, torch.device]:
    """This process's ranks and device: one process beside a vLLM server, else torchrun's, with the memory check
    done before any weight is read."""
    target, engine = cfg.target, cfg.capture.engine == "vllm"
    device = rank_device(target.device)
    if engine and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError(
            "capture.engine: vllm runs in one process (the server splits the target itself, target.tp_size ways): "
            "start it without torchrun"
        )
    ranks = Ranks() if engine else join_process_group(device, target.tp_size)
    if not engine:  # a server holds its own target, in its own memory
        memory = check_memory(capture_memory(cfg), device, CAPTURE_MEMORY_REMEDY)  # before any weight is read
        if ranks.rank == 0:
            print(memory)
    return ranks, device


def capture_mine(
    job: CaptureJob, mine: list[int], model: PreTrainedModel | None, pad_id: int, hasher: ThreadPoolExecutor
) -> tuple[dict[int, Future], int, float]:
    """Capture and write this rank's shards ``mine``: each shard is written (atomically, by ``WriteBehind``'s
    thread) while the target computes the next one, then its sha256 read back by ``hasher``.

    Returns the digests by shard, the tokens captured and the seconds it took once the states' source was up."""
    samples, plan, ranks, out_dir = job.samples, job.plan, job.ranks, job.out_dir
    my_tokens = sum(len(samples[i].input_ids) for k in mine for i in plan[k])
    desc = f"capture rank {ranks.rank}" if ranks.world > 1 else "capture"
    bar = tqdm(total=my_tokens, unit="tok", unit_scale=True, desc=desc)
    digests: dict[int, Future] = {}

    def write(k: int, tensors: dict[str, torch.Tensor]) -> None:
        write_shard(out_dir / shard_name(k), tensors, job.fingerprint)
        digests[k] = hasher.submit(file_sha256, out_dir / shard_name(k))

    with (
        state_source(job.cfg, model, job.aux_layers, pad_id, out_dir, started=bool(mine)) as states,
        WriteBehind() as writer,
    ):
        start = time.perf_counter()  # after a server's start: the rate is the capture's own
        for k in mine:
            shard = [samples[i] for i in plan[k]]
            tensors = capture_shard(
                states, shard, plan[k], len(job.aux_layers), job.store_dtype, job.hidden_size, job.vision
            )
            if ranks.writes:  # the other ranks of a tensor-parallel group computed the same states
                writer.put(write, k, tensors)
            bar.update(len(tensors["input_ids"]))
    bar.close()
    return digests, my_tokens, time.perf_counter() - start


def finish(job: CaptureJob, digests: dict[int, Future], hasher: ThreadPoolExecutor) -> None:
    """Rank 0, once every shard exists: the manifest, each shard's sha256 included (read here where another rank
    wrote it)."""
    out_dir, plan, samples, data = job.out_dir, job.plan, job.samples, job.cfg.data
    for k in range(len(plan)):
        if k not in digests:
            digests[k] = hasher.submit(file_sha256, out_dir / shard_name(k))
    shards = [_shard_entry(out_dir, k, plan[k], samples, digests[k]) for k in range(len(plan))]
    write_manifest(
        out_dir,
        {
            **job.settings,
            "fingerprint": job.fingerprint,
            "source": str(data.source),
            "format": data.format,
            "max_length": data.max_length,
            "over_length": data.over_length,
            "samples": len(samples),
            "tokens": sum(len(s.input_ids) for s in samples),
            "loss_tokens": sum(sum(s.loss_mask) for s in samples),
            "bytes": sum(entry["bytes"] for entry in shards),
            "shards": shards,
        },
    )


def run_capture(given: dict[str, Any] | CaptureConfig) -> Path:
    """Capture every sample of the config's ``data`` from its ``target`` into ``capture.out_dir``.

    A loaded config is checked first (``CaptureConfig``): a typo or a value out of range fails here, before
    the target is loaded. Under torchrun each rank captures its share of the shards.
    """
    cfg = given if isinstance(given, CaptureConfig) else parse(given, CaptureConfig)
    target = cfg.target
    ranks, device = capture_ranks(cfg)
    if cfg.capture.engine == "vllm":  # its venv, or its server's folder and model: before any tokenizing or folder
        check_engine(target, cfg.capture)
    config, tokenizer = AutoConfig.from_pretrained(target.path), load_tokenizer(target.path)
    check_max_length(cfg.data.max_length, config, target.path)
    processor = load_processor(target.path)
    if processor is not None and cfg.capture.engine == "vllm":
        raise ValueError(
            f"{target.path} is a vision-language target: capture.engine vllm sends token ids only, without the "
            "images; capture it with capture.engine: hf"
        )
    model = None
    if cfg.capture.engine != "vllm":
        model = load_model(target.path, device, target.dtype, target.tp_size, target.attn_implementation)
    vision = VisionRows.of(model) if processor is not None and model is not None else None
    job = plan_capture(cfg, ranks, config, tokenizer, processor, vision)
    out_dir, rank = job.out_dir, ranks.rank
    if (out_dir / MANIFEST).exists() and read_manifest(out_dir)["fingerprint"] == job.fingerprint:
        if rank == 0:
            verify_capture(out_dir)  # a shard replaced or damaged since must not pass for complete
            print(f"{out_dir}: capture complete with these settings, every shard as recorded; nothing to do")
        return out_dir

    # One run per folder: rank 0 holds the lock for the job. Each shard's sha256 is read back while the
    # next shard is captured.
    lock = output_lock(out_dir) if rank == 0 else contextlib.nullcontext(out_dir)
    with lock, ThreadPoolExecutor(max_workers=1) as hasher:
        done = finished_shards(out_dir, job.plan, job.fingerprint, job.samples, job.vision)
        mine = job.shards_to_capture(done)
        if rank == 0:
            announce(job, done)
        barrier()  # every rank has read what was done before any writes
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        digests, my_tokens, seconds = capture_mine(job, mine, model, pad_id, hasher)
        barrier()  # every shard exists
        if rank != 0:
            return out_dir
        finish(job, digests, hasher)
    rate = f"{my_tokens / max(seconds, 1e-9):,.0f} tokens/s" + (" on rank 0" if ranks.world > 1 else "")
    print(f"capture: wrote {out_dir / MANIFEST} ({rate} this run)")
    return out_dir


def _shard_entry(out_dir: Path, k: int, shard: list[int], samples: list[Sample], sha256: Future) -> dict[str, Any]:
    path = out_dir / shard_name(k)
    return {
        "file": path.name,
        "samples": len(shard),
        "tokens": sum(len(samples[i].input_ids) for i in shard),
        "bytes": path.stat().st_size,
        "sha256": sha256.result(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--on-error", choices=["raise", "skip"], help="bad input records: stop (default) or skip")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    overrides = args.overrides + ([f"data.on_error={args.on_error}"] if args.on_error else [])
    run_capture(parse(load_config(args.config, overrides), CaptureConfig, args.config))


if __name__ == "__main__":
    run_command(main, "python -m data_recipes.capture")
