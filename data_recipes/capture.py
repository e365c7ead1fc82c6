"""Hidden-state capture: run the frozen target over the samples and keep what the heads learn from.

    python -m data_recipes.capture --config configs/demo-eagle3.yaml [key=value ...]

Offline, the states go to safetensors shards (``data_recipes.shards``); online, ``OnlineCapture``
computes the very same tensors inside the training step. Both come from ``data_recipes.states`` (the target's
forward, or a vLLM server).

Resumable: samples are ordered deterministically (longest first, so batches pad little) and cut
into shards of ``shard_samples``; each shard is written atomically and stamped with a fingerprint
of everything that determines its contents. A re-run skips shards that exist with the same
fingerprint and hold their slot's samples, so a killed capture continues where it died and ends
byte-identical to an uninterrupted one; a finished capture is verified byte for byte (sha256)
before a re-run calls it complete. One capture writes a folder at a time (``core.io.output_lock``).

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
import hashlib
import math
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin

from headstart.core.config_files import ConfigError, load_config, run_command, save_config
from headstart.core.fingerprint import settings_fingerprint, tokenizer_hash, weights_hash
from headstart.core.io import OutOfSpaceError, check_writable, free_space_problem, output_lock
from headstart.core.memory import MemoryNeed, TargetSizes, capture_activations, check_memory
from headstart.core.models import load_model, load_processor, load_tokenizer
from headstart.core.runtime import Ranks, barrier, join_process_group, rank_device, resolve_dtype
from headstart.core.settings import as_dict, parse
from headstart.data_recipes.engine_capture import check_engine, engine_states_for
from headstart.data_recipes.recipes import Sample, load_samples, require_samples
from headstart.data_recipes.settings import CaptureConfig
from headstart.data_recipes.shards import (
    FP8,
    MANIFEST,
    RECAPTURE,
    ShardError,
    StatesError,
    WriteBehind,
    check_finite,
    check_states,
    file_sha256,
    open_shard,
    read_manifest,
    shard_fingerprint,
    shard_name,
    store_hidden,
    verify_capture,
    write_manifest,
    write_shard,
)
from headstart.data_recipes.states import StateSource, VisionRows, forward_states, resolve_aux_layers


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


def token_tensors(
    samples: list[Sample], sample_ids: list[int], vision: VisionRows | None = None
) -> dict[str, torch.Tensor]:
    """A shard's tensors other than the hidden states: token ids, loss mask, sample offsets and ids (and a
    vision-language target's image rows and positions, ``VisionRows.tensors``)."""
    lengths = [len(s.input_ids) for s in samples]
    return {
        "input_ids": torch.tensor([t for s in samples for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.uint8),
        "sample_offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64),
        "sample_ids": torch.tensor(sample_ids, dtype=torch.int64),
    } | (vision.tensors(samples) if vision is not None else {})


def samples_hash(samples: list[Sample]) -> str:
    """The samples' tokens, loss masks and vision inputs (the images as the processor gave them)."""
    digest = hashlib.sha256()
    for s in samples:
        digest.update(torch.tensor(s.input_ids, dtype=torch.int32).numpy().tobytes())
        digest.update(bytes(s.loss_mask))
        for key, value in sorted(s.vision.items()):
            digest.update(key.encode() + value.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def storage_estimate(
    tokens: int, hidden_size: int, n_aux: int, store_dtype: torch.dtype, vision: VisionRows | None = None
) -> int:
    """Bytes on disk: hidden states (k aux layers + the last one; fp8 adds a float32 scale per token and
    layer) plus 5 bytes of ids and mask per token; a vision-language target's image mask adds 1, its positions
    (mrope) 8."""
    scales = 4 * (n_aux + 1) if store_dtype == FP8 else 0
    rows = 0 if vision is None else 1 + 8 * vision.mrope
    return tokens * (hidden_size * (n_aux + 1) * store_dtype.itemsize + scales + 5 + rows)


def check_free_disk(out_dir: Path, needed: int) -> None:
    check_writable(out_dir)  # a read-only folder may show 0 bytes free: say read-only, not full
    remedy = (
        "free space, capture fewer samples (data.limit), store bf16 or fp8_e4m3 (capture.store_dtype), "
        "or train online (train.online_capture: true) without shards"
    )
    if problem := free_space_problem(out_dir, needed, "capture", remedy):
        raise OutOfSpaceError(problem)


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


CAPTURE_MEMORY_REMEDY = "split the target across more ranks (target.tp_size) or lower capture.batch_tokens"


def capture_memory(cfg: CaptureConfig) -> MemoryNeed:
    """One capture rank: its share of the target and one batch's activations (``core.memory``)."""
    target, cap = cfg.target, cfg.capture
    config, dtype = AutoConfig.from_pretrained(target.path), resolve_dtype(target.dtype)
    n_aux = len(resolve_aux_layers(cap.aux_layers, config.get_text_config().num_hidden_layers))
    share = TargetSizes.of(config).target_share(dtype, target.tp_size)
    activations = capture_activations(config, cap.batch_tokens, cfg.data.max_length, n_aux, dtype, target.tp_size)
    return MemoryNeed("capture", {"target share": share, "activations": activations})


@dataclass
class CaptureJob:
    """What one capture is: its settings (fingerprinted: what determines the shards' contents), the samples, the
    shards (the sample indices of each, longest first) and this process's ranks."""

    cfg: CaptureConfig
    ranks: Ranks
    samples: list[Sample]
    settings: dict[str, Any]  # the manifest's settings
    fingerprint: str
    plan: list[list[int]]
    aux_layers: list[int]
    hidden_size: int
    store_dtype: torch.dtype
    vision: VisionRows | None = None  # a vision-language target's image rows and positions

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.capture.out_dir)

    def estimate(self, tokens: int) -> int:
        return storage_estimate(tokens, self.hidden_size, len(self.aux_layers), self.store_dtype, self.vision)


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


def plan_capture(
    cfg: CaptureConfig,
    ranks: Ranks,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    processor: ProcessorMixin | None = None,
    vision: VisionRows | None = None,
) -> CaptureJob:
    """Load the samples and fix the job: its fingerprinted settings and its shards. A vision-language target's
    ``processor`` reads the images, and ``vision`` says what its shards hold beside the states."""
    target, data, cap = cfg.target, cfg.data, cfg.capture
    samples, report = load_samples(
        data.source,
        data.format,
        tokenizer,
        data.max_length,
        data.on_error,
        limit=data.limit,
        over_length=data.over_length,
        processor=processor,
        image_dir=data.image_dir,
    )
    require_samples(samples, report, data.source, data.max_length)
    num_layers, hidden = config.get_text_config().num_hidden_layers, config.get_text_config().hidden_size
    aux_layers = resolve_aux_layers(cap.aux_layers, num_layers)
    store_dtype, compute_dtype = resolve_dtype(cap.store_dtype), resolve_dtype(target.dtype)
    settings = {
        "target": str(target.path),
        "engine": cap.engine,  # the same tensors either way, but not bit for bit: never mixed in one capture
        "target_config_hash": hashlib.sha256(config.to_json_string().encode()).hexdigest()[:16],
        "target_weights_hash": weights_hash(target.path, compute_dtype),
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "compute_dtype": str(compute_dtype).removeprefix("torch."),
        "store_dtype": str(store_dtype).removeprefix("torch."),
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "aux_layers": aux_layers,
        "samples_hash": samples_hash(samples),
        "shard_samples": cap.shard_samples,
        "batch_tokens": cap.batch_tokens,
    }
    if vision is not None:  # a text capture's settings (and fingerprint) stay as they were
        positions = "mrope" if vision.mrope else "sequence"
        settings["vision"] = {"image_token_id": vision.image_token, "positions": positions}
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].input_ids), i))
    plan = [order[i : i + cap.shard_samples] for i in range(0, len(order), cap.shard_samples)]
    fingerprint = settings_fingerprint(settings)
    return CaptureJob(cfg, ranks, samples, settings, fingerprint, plan, aux_layers, hidden, store_dtype, vision)


def announce(job: CaptureJob, done: set[int]) -> None:
    """Rank 0, before any shard is written: what the capture will write and where; refused when the disk is short.
    The config is saved beside the shards."""
    ranks, out_dir, samples = job.ranks, job.out_dir, job.samples
    total_tokens = sum(len(s.input_ids) for s in samples)
    todo_tokens = sum(len(samples[i].input_ids) for k, shard in enumerate(job.plan) if k not in done for i in shard)
    print(
        f"capture: {len(samples)} samples, {total_tokens:,} tokens, layers {job.aux_layers} + last, {job.store_dtype} "
        f"-> {job.estimate(total_tokens) / 1e9:.2f} GB in {len(job.plan)} shards under {out_dir}"
        + (f" ({len(done)} already complete, resuming)" if done else "")
        + (f", {ranks.world} processes" if ranks.world > 1 else "")
        + (f" ({ranks.dp_world} groups of {ranks.tp_size} splitting the target)" if ranks.tp_size > 1 else "")
    )
    check_free_disk(out_dir, job.estimate(todo_tokens))
    save_config(as_dict(job.cfg), out_dir / "capture_config.yaml")


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


def check_max_length(max_length: int | None, config: Any, path: str) -> None:
    """ConfigError when samples of ``data.max_length`` tokens would run past the target's positions
    (max_position_embeddings): their states would come from positions the target was never trained at, as
    eval.acceptance refuses to decode them."""
    positions = config.get_text_config().max_position_embeddings
    if max_length is not None and positions and max_length > positions:
        raise ConfigError(
            f"data.max_length {max_length} is past the {positions} positions of the target {path} "
            "(max_position_embeddings): lower data.max_length"
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
        done = _finished_shards(out_dir, job.plan, job.fingerprint, job.samples, job.vision)
        # Data parallelism across tensor-parallel groups: group g captures the shards k with k % groups == g.
        mine = [k for k in range(len(job.plan)) if k % ranks.dp_world == ranks.dp_rank and k not in done]
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


def _finished_shards(
    out_dir: Path, plan: list[list[int]], fingerprint: str, samples: list[Sample], vision: VisionRows | None
) -> set[int]:
    """Shards already on disk from a run with the same settings; a foreign capture is an error.

    The fingerprint says a shard came from these settings, not that it sits in its own slot: a shard
    copied or renamed from another slot carries the same one. So each shard's token side (ids, mask,
    offsets, sample ids: a few bytes per token) must also equal what this slot holds.
    """
    done = set()
    for k, shard in enumerate(plan):
        path = out_dir / shard_name(k)
        if not path.exists():
            continue
        if shard_fingerprint(path) != fingerprint:
            raise FileExistsError(
                f"{path} was captured with other settings (target, data, layers or dtype): "
                f"choose a new capture.out_dir or delete {out_dir}"
            )
        expected = token_tensors([samples[i] for i in shard], shard, vision)
        with open_shard(path) as f:
            if not all(torch.equal(f.get_tensor(key), value) for key, value in expected.items()):
                raise ShardError(f"{path} has this capture's fingerprint but not the samples of shard {k}; {RECAPTURE}")
        done.add(k)
    return done


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
