"""Fingerprints of what decides an artifact's contents: the target's weights, its tokenizer, a settings dict.

They are recorded where an artifact is made (a capture's manifest, a head's config, regeneration's
parts) and compared where it is used, so that shards, heads and replies never meet a target other
than the one they came from without saying so. ``data_recipes`` and ``heads`` both import them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from headstart.core.runtime import resolve_dtype
from headstart.core.weights import checkpoint_folder, meta_model, read_borrowed, target_config, tensor_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Vocabulary, merges, special tokens and chat template: what decides the ids a head sees."""
    backend = tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab())
    return hashlib.sha256((backend + str(tokenizer.chat_template)).encode()).hexdigest()[:16]


def weights_hash(path: str | Path, dtype: str | torch.dtype) -> str:
    """The fingerprint of a target checkpoint loaded in ``dtype``, read without its decoder layers.

    Over the config, the names of every tensor in the checkpoint (from the index or the one file's header) and
    every byte of the tensors a head borrows (embedding, final norm, lm_head) as stored: what training from
    shards loads anyway, so the check costs one pass over a few GB at most, even for a 140 GB target. A
    checkpoint whose borrowed tensors, shapes or tensor inventory changed hashes differently, and so does the
    same checkpoint in another compute dtype; a fine-tune that changed decoder layers only does not
    (docs/RELIABILITY.md, "Which weights a fingerprint covers").
    """
    folder = checkpoint_folder(path)
    config = json.loads((folder / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    digest.update(str(resolve_dtype(dtype)).encode())
    digest.update("\n".join(sorted(tensor_files(folder))).encode())
    for role, tensor in read_borrowed(folder, meta_model(target_config(folder))).items():
        digest.update(f"{role}{tuple(tensor.shape)}{tensor.dtype}".encode())
        # numpy arrays are buffers (no copy of a GB-sized table); numpy 2.4 does not type them as such
        digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    return digest.hexdigest()[:16]


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """One short hash of a JSON-able settings dict (key order does not matter)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
