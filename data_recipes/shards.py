"""The one on-disk format for captured hidden states: safetensors shards plus ``manifest.json``.

A shard holds several samples concatenated along the token axis (no padding on disk):

    input_ids      [T] int32        token ids
    loss_mask      [T] uint8        1 on assistant tokens
    aux_hidden     [T, k*H] dtype   EAGLE-3: the k fused target layers, ascending (absent when k = 0)
    last_hidden    [T, H] dtype     the target's final hidden state after its final norm (what lm_head reads)
    sample_offsets [n+1] int64      sample i spans tokens offsets[i]:offsets[i+1]
    sample_ids     [n] int64        index of each sample in the recipe's output (proves nothing is duplicated)

Each shard is written to a temporary file and renamed, so a shard file that exists is complete.
``manifest.json`` is written last and describes the whole capture; readers refuse a directory
without it. ``ShardDataset`` memory-maps the shards: nothing is loaded whole into RAM.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from core.io import atomic_path, atomic_write_text

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class ManifestMismatch(ValueError):
    """Captured shards that do not belong to the target (or tokenizer, or head) they are used with."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    """Write one shard atomically; ``fingerprint`` ties it to the capture settings that made it."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"fingerprint": fingerprint})


def shard_fingerprint(path: Path) -> str | None:
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("fingerprint")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    atomic_write_text(out_dir / MANIFEST, json.dumps({"format_version": FORMAT_VERSION, **manifest}, indent=1))


def read_manifest(out_dir: str | Path) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {out_dir} is not a finished capture (run data_recipes.capture again to complete it)"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ManifestMismatch(f"{path}: format_version {manifest.get('format_version')}, expected {FORMAT_VERSION}")
    return manifest


def check_manifest(
    manifest: dict[str, Any],
    *,
    hidden_size: int,
    num_hidden_layers: int,
    tokenizer_hash: str,
    aux_layers: list[int] | None = None,
) -> None:
    """Fail clearly when shards were captured from another target, tokenizer or layer choice."""
    problems = []
    if manifest["hidden_size"] != hidden_size:
        problems.append(f"hidden size {manifest['hidden_size']} in the shards, {hidden_size} in the target")
    if manifest["num_hidden_layers"] != num_hidden_layers:
        problems.append(f"{manifest['num_hidden_layers']} layers in the shards' target, {num_hidden_layers} here")
    if manifest["tokenizer_hash"] != tokenizer_hash:
        problems.append("the tokenizer differs from the one the shards were captured with")
    if aux_layers is not None and list(manifest["aux_layers"]) != sorted(set(aux_layers)):
        problems.append(f"captured layers {manifest['aux_layers']}, the head needs {sorted(set(aux_layers))}")
    if problems:
        raise ManifestMismatch(f"shards from {manifest['target']} do not match: " + "; ".join(problems))


@dataclass(frozen=True)
class _SampleRef:
    shard: str
    start: int
    end: int
    sample_id: int


class ShardDataset(torch.utils.data.Dataset):
    """Samples of a finished capture, read lazily through safetensors' memory map."""

    def __init__(self, out_dir: str | Path):
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir)
        self.refs: list[_SampleRef] = []
        for shard in self.manifest["shards"]:
            with safe_open(str(self.dir / shard["file"]), framework="pt") as f:
                offsets = f.get_tensor("sample_offsets").tolist()
                ids = f.get_tensor("sample_ids").tolist()
            self.refs += [_SampleRef(shard["file"], s, e, i) for s, e, i in zip(offsets[:-1], offsets[1:], ids)]
        self.keys = ["input_ids", "loss_mask", "last_hidden"] + (["aux_hidden"] if self.manifest["aux_layers"] else [])
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.refs)

    def _handle(self, shard: str):
        # One open handle per shard and per process (DataLoader workers get their own copy).
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.dir / shard), framework="pt")
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ref = self.refs[index]
        f = self._handle(ref.shard)
        sample = {key: f.get_slice(key)[ref.start : ref.end] for key in self.keys}
        sample["input_ids"] = sample["input_ids"].long()
        sample["loss_mask"] = sample["loss_mask"].long()
        sample["sample_id"] = torch.tensor(ref.sample_id)
        return sample

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}


def pad_collate(samples: list[dict[str, torch.Tensor]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad a list of samples to one batch; ``attention_mask`` marks the real tokens."""
    length = max(s["input_ids"].shape[0] for s in samples)
    batch: dict[str, torch.Tensor] = {}
    for key in samples[0]:
        if samples[0][key].ndim == 0:
            batch[key] = torch.stack([s[key] for s in samples])
            continue
        fill = pad_id if key == "input_ids" else 0
        first = samples[0][key]
        out = first.new_full((len(samples), length, *first.shape[1:]), fill)
        for row, s in enumerate(samples):
            out[row, : s[key].shape[0]] = s[key]
        batch[key] = out
    lengths = torch.tensor([s["input_ids"].shape[0] for s in samples])
    batch["attention_mask"] = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return batch
