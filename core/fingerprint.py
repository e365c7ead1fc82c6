"""Fingerprints of what decides an artifact's contents: the target's weights, its tokenizer, a settings dict.

They are recorded where an artifact is made (a capture's manifest, a head's config, regeneration's
parts) and compared where it is used, so that shards, heads and replies never meet a target other
than the one they came from without saying so. ``data_recipes`` and ``heads`` both import them.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Vocabulary, merges, special tokens and chat template: what decides the ids a head sees."""
    backend = tokenizer.backend_tokenizer.to_str() if tokenizer.is_fast else json.dumps(tokenizer.get_vocab())
    return hashlib.sha256((backend + str(tokenizer.chat_template)).encode()).hexdigest()[:16]


def weights_hash(model: nn.Module) -> str:
    """A cheap fingerprint of the weights: names, shapes and a strided sample of every tensor's values.

    Taken over the weights as loaded, so the same checkpoint loaded in another dtype hashes differently.
    """
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def settings_fingerprint(settings: dict[str, Any]) -> str:
    """One short hash of a JSON-able settings dict (key order does not matter)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
