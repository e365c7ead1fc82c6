"""The one on-disk format for captured hidden states: safetensors shards plus ``manifest.json``.

A shard holds several samples concatenated along the token axis (no padding on disk):

    input_ids      [T] int32        token ids
    loss_mask      [T] uint8        1 on assistant tokens
    aux_hidden     [T, k*H] dtype   EAGLE-3: the k fused target layers, ascending (absent when k = 0)
    last_hidden    [T, H] dtype     the target's final hidden state after its final norm (what lm_head reads)
    *_scale        [T, k] float32   fp8 shards only: each token's and layer's scale (``quantize_fp8``)
    sample_offsets [n+1] int64      sample i spans tokens offsets[i]:offsets[i+1]
    sample_ids     [n] int64        index of each sample in the recipe's output (proves nothing is duplicated)
    image_mask     [T] uint8        vision-language targets only: 1 on image placeholder rows (context, never trained)
    position_ids   [T] int64        mrope targets only (Qwen-VL): each row's rotary position as the draft sees it
                                    (``data_recipes.states.VisionRows``); absent, a sample's rows count from 0

The manifest's ``vision`` entry (``{"image_token_id", "positions": "sequence" | "mrope"}``) says a capture holds
them; a text capture has neither the entry nor the tensors, byte for byte as before.

Each shard is written to a temporary file and renamed, so a shard file that exists is complete.
``manifest.json`` is written last and describes the whole capture (each shard's samples, tokens,
bytes and sha256); readers refuse a directory without it. ``ShardDataset`` memory-maps the shards:
nothing is loaded whole into RAM.

What is checked when. Opening a ``ShardDataset`` (every training run) costs a ``stat`` and a header
read per shard: each shard must have the manifest's size, fingerprint, sample and token counts, and
the sample ids of all shards must be exactly 0..samples-1. A sample read is checked to hold token ids
inside the target's vocabulary. Flipped bits in the hidden states pass these checks; only the sha256
finds them, which reads every byte: ``verify_capture`` (``python -m data_recipes.shards DIR``), which
capture also runs before it calls a finished capture complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from headstart.core.config_files import run_command
from headstart.core.io import atomic_path, atomic_write_text

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
FP8 = torch.float8_e4m3fn
HIDDEN_KEYS = ("last_hidden", "aux_hidden")


class ManifestMismatch(ValueError):
    """Captured shards that do not belong to the target (or tokenizer, or head) they are used with."""


class ShardError(ValueError):
    """A shard that is not what its capture's manifest says: missing, truncated, corrupt, foreign or misplaced."""


class StatesError(ValueError):
    """A sample's hidden states that must not be stored: rows not its tokens', another width, not float, or not
    finite."""


# How to repair a capture with a bad shard: capture resumes and re-captures exactly the shards missing.
RECAPTURE = (
    "delete that shard (and manifest.json, if any) and run data_recipes.capture again: it re-captures what is missing"
)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def write_shard(path: Path, tensors: dict[str, torch.Tensor], fingerprint: str) -> None:
    """Write one shard atomically; ``fingerprint`` ties it to the capture settings that made it."""
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"fingerprint": fingerprint})


class WriteBehind:
    """Shard writes on one writer thread, while the caller computes the next shard (``with WriteBehind() as w:
    w.put(write_shard, path, tensors, fingerprint)``). One write at most is in flight: ``put`` first waits for the
    last one, raising its error (a full disk stops the run at the next shard, not after all of them), so the host
    holds two shards at most. Leaving the block waits for the last write and raises its error."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending: Future | None = None

    def put(self, write: Callable[..., object], *args: Any) -> None:
        self.wait()
        self._pending = self._pool.submit(write, *args)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, error_type: type[BaseException] | None, *rest: object) -> None:
        try:
            if error_type is None:
                self.wait()
        finally:
            self._pool.shutdown(wait=True)  # a write under way ends (atomically) before the error goes on


def open_shard(path: Path) -> safe_open:
    """``safe_open`` whose errors name the file (a truncated file or a corrupt header fails here)."""
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise ShardError(f"{path} is missing; {RECAPTURE}") from None
    except SafetensorError as err:
        raise ShardError(f"{path} is truncated or corrupt ({err}); {RECAPTURE}") from err


def shard_fingerprint(path: Path) -> str | None:
    with open_shard(path) as f:
        return (f.metadata() or {}).get("fingerprint")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, where: str) -> None:
    """ShardError unless every id is a token of the target (an id past its embedding would crash the step)."""
    if not len(input_ids):
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ShardError(
            f"{where}: token id {high if high >= vocab_size else low} is outside the target's vocabulary "
            f"(0..{vocab_size - 1}): captured with another tokenizer, or corrupt"
        )


def check_states(
    states: dict[str, torch.Tensor],
    tokens: int,
    hidden_size: int | None,
    aux_layers: int,
    what: str,
    finite: bool = True,
) -> None:
    """StatesError unless ``states`` are what a shard may store for a sample of ``tokens`` tokens: ``last_hidden``
    [tokens, H] and, with ``aux_layers`` k > 0, ``aux_hidden`` [tokens, k*H], float, every value finite.
    ``hidden_size`` None: H is ``last_hidden``'s width. Checked before a shard is written: the shard itself
    cannot tell one sample's extra rows from the next sample's missing ones. ``finite`` False leaves the values'
    check (which waits for the device) to the caller."""
    if hidden_size is None:
        last = states.get("last_hidden")
        hidden_size = last.shape[-1] if last is not None and last.ndim == 2 else 0
    widths = {"last_hidden": hidden_size} | ({"aux_hidden": aux_layers * hidden_size} if aux_layers else {})
    if set(states) != set(widths):
        raise StatesError(f"{what}: the states are {sorted(states)}, a shard stores {sorted(widths)}")
    for key, width in widths.items():
        value = states[key]
        if tuple(value.shape) != (tokens, width):
            raise StatesError(
                f"{what}: {key} has shape {list(value.shape)}, not [{tokens}, {width}] (the sample's {tokens} "
                f"tokens by {width // max(hidden_size, 1)} layer(s) of the target's hidden size {hidden_size})"
            )
        if not value.dtype.is_floating_point:
            raise StatesError(f"{what}: {key} is {value.dtype}, not a float dtype")
        if finite and value.dtype != FP8:  # fp8 values come scaled into range (quantize_fp8); scales are checked
            check_finite(value, f"{what}: {key}")


def check_finite(value: torch.Tensor, what: str) -> None:
    """StatesError naming the first token of ``value`` [tokens, ...] with a NaN or an infinity."""
    bad = ~torch.isfinite(value)
    if bad.any():
        token = int(bad.flatten(1).any(1).nonzero()[0])
        raise StatesError(f"{what} holds {int(bad.sum())} NaN or infinite values, the first at token {token}")


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
    weights_hash: str | None = None,
    aux_layers: list[int] | None = None,
    allow_other_weights: bool = False,
) -> None:
    """Fail clearly when shards were captured from another target, tokenizer, layer choice or weights.

    ``weights_hash`` (``core.fingerprint.weights_hash``: the config, the tensor inventory and the borrowed
    tensors' bytes, in the compute dtype) tells a fine-tuned or perturbed checkpoint of the same shape apart;
    ``allow_other_weights`` turns that refusal into a warning.
    """
    problems = []
    if manifest["hidden_size"] != hidden_size:
        problems.append(f"hidden size {manifest['hidden_size']} in the shards, {hidden_size} in the target")
    if manifest["num_hidden_layers"] != num_hidden_layers:
        problems.append(f"{manifest['num_hidden_layers']} layers in the shards' target, {num_hidden_layers} here")
    if manifest["tokenizer_hash"] != tokenizer_hash:
        problems.append(
            f"the tokenizer differs from the one the shards were captured with "
            f"(tokenizer hash {manifest['tokenizer_hash']} in the shards, {tokenizer_hash} here)"
        )
    if aux_layers is not None and list(manifest["aux_layers"]) != sorted(set(aux_layers)):
        problems.append(f"captured layers {manifest['aux_layers']}, the head needs {sorted(set(aux_layers))}")
    captured_from = manifest.get("target_weights_hash")
    if weights_hash is not None and captured_from is not None and captured_from != weights_hash:
        weights = (
            f"the target's weights differ from those the shards were captured from (weights hash {captured_from} "
            f"in the shards, {weights_hash} here; the hash covers the config, the tensor names, the embedding, "
            f"final norm and lm_head, and the compute dtype, so another target.dtype than the capture's "
            f"{manifest.get('compute_dtype')} differs too)"
        )
        if allow_other_weights:
            warnings.warn(f"{weights}: training on them anyway (capture.allow_other_weights)", stacklevel=2)
        else:
            problems.append(
                f"{weights}: re-capture from this target, or set capture.allow_other_weights: true if the "
                "states of that other checkpoint are what you mean to train on"
            )
    if problems:
        raise ManifestMismatch(f"shards from {manifest['target']} do not match: " + "; ".join(problems))


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, groups*H] -> (fp8 e4m3 values, float32 scale [T, groups]): each token's layer scaled to e4m3's range.

    A scale per token and layer, because the residual stream's magnitude grows with depth and varies
    between tokens (a few outlier tokens carry norms far above the rest): one scale per tensor would leave
    most rows with a handful of the 8 bits.
    """
    rows = x.float().unflatten(-1, (groups, -1))
    scale = rows.abs().amax(-1).clamp_min(1e-12) / torch.finfo(FP8).max
    return (rows / scale[..., None]).to(FP8).flatten(-2), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of ``quantize_fp8``, in ``dtype``."""
    rows = values.float().unflatten(-1, (scale.shape[-1], -1)) * scale[..., None]
    return rows.flatten(-2).to(dtype)


def store_hidden(states: dict[str, torch.Tensor], store_dtype: torch.dtype, aux_layers: int) -> dict[str, torch.Tensor]:
    """Hidden states [..., groups*H] as a shard stores them: cast, or fp8 values plus ``<key>_scale``."""
    if store_dtype != FP8:
        return {key: value.to(store_dtype) for key, value in states.items()}
    out = {}
    for key, value in states.items():
        out[key], out[f"{key}_scale"] = quantize_fp8(value, aux_layers if key == "aux_hidden" else 1)
    return out


@dataclass(frozen=True)
class _SampleRef:
    shard: str
    start: int
    end: int
    sample_id: int


class ShardDataset(torch.utils.data.Dataset):
    """Samples of a finished capture, read lazily through safetensors' memory map.

    Opening it runs the cheap checks of every shard against the manifest (see the module docstring);
    with ``vocab_size``, every sample read is checked to hold only ids of the target's vocabulary.
    """

    def __init__(self, out_dir: str | Path, vocab_size: int | None = None):
        self.dir = Path(out_dir)
        self.manifest = read_manifest(self.dir)
        self.vocab_size = vocab_size
        self.refs: list[_SampleRef] = []
        for entry in self.manifest["shards"]:
            offsets, ids = _read_index(self.dir / entry["file"], entry, self.manifest)
            self.refs += [_SampleRef(entry["file"], s, e, i) for s, e, i in zip(offsets[:-1], offsets[1:], ids)]
        _check_sample_ids(self.refs, self.manifest["samples"], self.dir)
        self.hidden_keys = ["last_hidden"] + (["aux_hidden"] if self.manifest["aux_layers"] else [])
        self.fp8 = self.manifest["store_dtype"] == str(FP8).removeprefix("torch.")
        scales = [f"{key}_scale" for key in self.hidden_keys] if self.fp8 else []
        self.keys = ["input_ids", "loss_mask", *self.hidden_keys, *scales, *vision_keys(self.manifest)]
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.refs)

    def _handle(self, shard: str) -> safe_open:
        # One open handle per shard and per process (DataLoader workers get their own copy).
        if shard not in self._handles:
            self._handles[shard] = open_shard(self.dir / shard)
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ref = self.refs[index]
        f = self._handle(ref.shard)
        sample = {key: f.get_slice(key)[ref.start : ref.end] for key in self.keys}
        if self.fp8:  # training sees bf16 states, as from a bf16 capture
            for key in self.hidden_keys:
                sample[key] = dequantize_fp8(sample[key], sample.pop(f"{key}_scale"))
        if self.vocab_size is not None:
            check_token_ids(sample["input_ids"], self.vocab_size, f"{self.dir / ref.shard}, sample {ref.sample_id}")
        for key in ("input_ids", "loss_mask", *vision_keys(self.manifest)):
            sample[key] = sample[key].long()
        sample["sample_id"] = torch.tensor(ref.sample_id)
        return sample

    def token_rows(self, indices: list[int]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of samples ``indices``, shard by shard, without reading any hidden state."""
        by_shard = defaultdict(list)
        for i in indices:
            by_shard[self.refs[i].shard].append(self.refs[i])
        for shard, refs in by_shard.items():
            with open_shard(self.dir / shard) as f:
                ids, mask = f.get_tensor("input_ids"), f.get_tensor("loss_mask")
            if self.vocab_size is not None:
                check_token_ids(ids, self.vocab_size, str(self.dir / shard))
            for ref in refs:
                yield ids[ref.start : ref.end], mask[ref.start : ref.end]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}


def vision_keys(manifest: dict[str, Any]) -> list[str]:
    """The per-token tensors a vision-language capture adds (the module docstring); none for text."""
    vision = manifest.get("vision")
    if not vision:
        return []
    return ["image_mask"] + (["position_ids"] if vision["positions"] == "mrope" else [])


def _read_index(path: Path, entry: dict[str, Any], manifest: dict[str, Any]) -> tuple[list[int], list[int]]:
    """A shard's sample offsets and ids, once its size and header agree with its manifest entry, and every
    tensor's rows with the tokens its samples' offsets span (``_row_problems``)."""
    fingerprint = manifest["fingerprint"]
    if not path.is_file():
        raise ShardError(f"{path} is missing; {RECAPTURE}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise ShardError(
            f"{path} is {size} bytes, the manifest records {entry['bytes']}: truncated or replaced; {RECAPTURE}"
        )
    with open_shard(path) as f:
        found = (f.metadata() or {}).get("fingerprint")
        offsets = f.get_tensor("sample_offsets").tolist()
        ids = f.get_tensor("sample_ids").tolist()
        problems = _row_problems(f, manifest, offsets)
    if found != fingerprint:
        raise ShardError(
            f"{path} belongs to another capture (fingerprint {found}, this capture's is {fingerprint}); {RECAPTURE}"
        )
    if len(ids) != entry["samples"] or len(offsets) != len(ids) + 1 or offsets[-1] != entry["tokens"]:
        raise ShardError(
            f"{path} holds {len(ids)} samples of {offsets[-1]} tokens, the manifest records {entry['samples']} "
            f"of {entry['tokens']}; {RECAPTURE}"
        )
    if problems:
        raise ShardError(f"{path}: " + "; ".join(problems) + f": the rows do not line up with the samples; {RECAPTURE}")
    return offsets, ids


def _row_problems(f: safe_open, manifest: dict[str, Any], offsets: list[int]) -> list[str]:
    """What in an open shard's header disagrees with its sample offsets: offsets that do not start at 0 and
    rise, and each tensor whose rows are not the tokens they span (token ids, loss mask, hidden states, fp8
    scales) or whose width is not the manifest's (hidden size, layers). Header reads only."""
    if not offsets or offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
        return [f"the sample offsets {offsets[:8]}... do not rise from 0"]
    tokens, hidden, k = offsets[-1], manifest["hidden_size"], len(manifest["aux_layers"])
    layers = {"last_hidden": 1} | ({"aux_hidden": k} if k else {})
    shapes = {key: [tokens] for key in ("input_ids", "loss_mask", *vision_keys(manifest))}
    shapes |= {key: [tokens, n * hidden] for key, n in layers.items()}
    if manifest["store_dtype"] == str(FP8).removeprefix("torch."):
        shapes |= {f"{key}_scale": [tokens, n] for key, n in layers.items()}
    problems, keys = [], set(f.keys())
    for key, want in shapes.items():
        if key not in keys:
            problems.append(f"it has no {key}")
            continue
        shape = list(f.get_slice(key).get_shape())
        if shape != want:
            problems.append(f"{key} has shape {shape}, its {len(offsets) - 1} samples' offsets make it {want}")
    return problems


def _check_sample_ids(refs: list[_SampleRef], samples: int, out_dir: Path) -> None:
    """Every sample id 0..samples-1 in exactly one shard (a shard copied from elsewhere breaks this)."""
    shard_of: dict[int, str] = {}
    for ref in refs:
        if ref.sample_id in shard_of:
            raise ShardError(
                f"sample {ref.sample_id} is in both {out_dir / shard_of[ref.sample_id]} and {out_dir / ref.shard}: "
                f"one of them was copied in from elsewhere; {RECAPTURE}"
            )
        if not 0 <= ref.sample_id < samples:
            raise ShardError(
                f"{out_dir / ref.shard} holds sample {ref.sample_id}, outside this capture's 0..{samples - 1}; "
                f"{RECAPTURE}"
            )
        shard_of[ref.sample_id] = ref.shard
    missing = sorted(set(range(samples)) - shard_of.keys())
    if missing:
        raise ShardError(f"samples {missing[:8]} ({len(missing)} in all) are in no shard of {out_dir}; {RECAPTURE}")


def verify_capture(out_dir: str | Path) -> ShardDataset:
    """The cheap checks of ``ShardDataset``, then every shard's sha256 against the manifest (reads every byte).

    Captures made before the manifest recorded checksums get the cheap checks only.
    """
    dataset = ShardDataset(out_dir)
    for entry in dataset.manifest["shards"]:
        path = dataset.dir / entry["file"]
        if "sha256" in entry and file_sha256(path) != entry["sha256"]:
            raise ShardError(
                f"{path}: its sha256 differs from the one the manifest recorded at capture time: the file changed "
                f"since (flipped bits, or another file copied over it); {RECAPTURE}"
            )
    return dataset


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


def pack_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The samples end to end in one row, no padding (``train.pack``): ``position_ids`` restart at 0 for each
    sample (or are the samples' own, from an mrope capture), ``segment_ids`` number them 0.. along the row, and the
    heads keep each sample's attention and labels to itself (``heads.losses.label_mask``, ``sample_mask``,
    ``same_sample``; ``heads.sparse_attention``)."""
    batch = {key: torch.cat([s[key] for s in samples])[None] for key in samples[0] if samples[0][key].ndim}
    batch |= {key: torch.stack([s[key] for s in samples]) for key in samples[0] if not samples[0][key].ndim}
    lengths, device = [s["input_ids"].shape[0] for s in samples], samples[0]["input_ids"].device
    if "position_ids" not in batch:
        batch["position_ids"] = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
    batch["segment_ids"] = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])[None]
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    return batch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Verify a finished capture: every shard against its manifest.")
    parser.add_argument("out_dir", help="the capture's folder (capture.out_dir)")
    args = parser.parse_args(argv)
    try:
        dataset = verify_capture(args.out_dir)
    except (ShardError, ManifestMismatch, FileNotFoundError) as err:
        parser.exit(1, f"verify failed: {err}\n")
    print(f"{args.out_dir}: {len(dataset)} samples in {len(dataset.manifest['shards'])} shards, all as recorded")


if __name__ == "__main__":
    run_command(main, "python -m data_recipes.shards")
