"""What a capture will write, fixed before the target runs: the samples, their order and shards, the settings
that fingerprint them, which shards a previous run already finished, and the storage and memory it needs.

Samples are ordered deterministically (longest first, so batches pad little) and cut into shards of
``shard_samples``; each shard is stamped with a fingerprint of everything that determines its contents
(``CaptureJob.settings``). A shard already on disk with the same fingerprint that holds its slot's samples is done
(``finished_shards``): a re-run captures only the others, so a killed capture continues where it died. Running the
target and writing the shards is ``data_recipes.capture``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, ProcessorMixin

from headstart.core.config_files import ConfigError, save_config
from headstart.core.fingerprint import settings_fingerprint, tokenizer_hash, weights_hash
from headstart.core.io import OutOfSpaceError, check_writable, free_space_problem
from headstart.core.memory import MemoryNeed, TargetSizes, capture_activations
from headstart.core.runtime import Ranks, resolve_dtype
from headstart.core.settings import as_dict
from headstart.data_recipes.recipes import Sample, load_samples, require_samples
from headstart.data_recipes.settings import CaptureConfig
from headstart.data_recipes.shards import FP8, RECAPTURE, ShardError, open_shard, shard_fingerprint, shard_name
from headstart.data_recipes.states import VisionRows, resolve_aux_layers

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

    def shards_to_capture(self, done: set[int]) -> list[int]:
        """This process's shards not ``done`` yet: data parallelism across tensor-parallel groups, group g captures
        the shards k with k % groups == g."""
        ranks = self.ranks
        return [k for k in range(len(self.plan)) if k % ranks.dp_world == ranks.dp_rank and k not in done]


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


def finished_shards(
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
