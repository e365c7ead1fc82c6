"""Draft-head modules: EAGLE-1/2, EAGLE-3, Medusa and DFlash (built on the shared core only).

head = build_head({"type": "eagle3", "draft_vocab_size": 8000}, target_model, tokenizer)
head.config.options.layer_ids, head.config.arch.hidden_size, head.hidden_layers
head.save_pretrained("runs/x/head")
head = load_head("runs/x/head", target_model, tokenizer)   # checks the head fits this target and tokenizer
check_head_config(read_head_config("runs/x/head"), target_config, "runs/x/head/config.json")  # the same, no weights

One file per job: ``config`` (the typed head config and its config.json), ``target`` (the target's layer
shape, the families served, compatibility and tokenizer checks), ``base`` (``DraftHead``: build, save,
load), ``layers`` (the Llama draft layer: norm, rotary, attention over the KV cache, MLP), ``losses``
(label alignment, soft cross-entropy), and one file per head: ``eagle``, ``eagle3``, ``medusa``, ``dflash``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.heads.base import WEIGHTS_NAME, DraftHead, state_problems
from headstart.heads.config import CONFIG_NAME, DraftArch, HeadConfig, HeadFolder, read_head_config, read_head_folder
from headstart.heads.dflash import DFlashHead
from headstart.heads.eagle import EagleHead
from headstart.heads.eagle3 import Eagle3Head, build_vocab_mapping, ttt_attention_mask
from headstart.heads.layers import KVCache
from headstart.heads.medusa import MedusaHead, medusa2_wrap, medusa_loss, medusa_weight_at
from headstart.heads.target import arch_from_target, check_compatible, check_tokenizer

HEADS: dict[str, type[DraftHead]] = {cls.head_type: cls for cls in (EagleHead, Eagle3Head, MedusaHead, DFlashHead)}

__all__ = [
    "CONFIG_NAME",
    "HEADS",
    "WEIGHTS_NAME",
    "DFlashHead",
    "DraftArch",
    "DraftHead",
    "Eagle3Head",
    "EagleHead",
    "HeadConfig",
    "HeadFolder",
    "KVCache",
    "MedusaHead",
    "arch_from_target",
    "build_head",
    "build_vocab_mapping",
    "check_compatible",
    "check_head_config",
    "check_tokenizer",
    "load_head",
    "medusa2_wrap",
    "meta_head",
    "medusa_loss",
    "medusa_weight_at",
    "read_head_config",
    "read_head_folder",
    "state_problems",
    "ttt_attention_mask",
]


def _head_class(head_type: str) -> type[DraftHead]:
    if head_type not in HEADS:
        raise ValueError(f"unknown head type {head_type!r}; known: {sorted(HEADS)}")
    return HEADS[head_type]


def build_head(
    head_cfg: dict[str, Any], target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> DraftHead:
    """A fresh head of ``head_cfg["type"]`` for ``target_model``; the other keys are that head's options.

    ``tokenizer`` (the target's) is recorded in the head's config, for ``load_head`` to check.
    """
    return _head_class(head_cfg["type"]).build(head_cfg, target_model, tokenizer)


def meta_head(head_cfg: dict[str, Any], target_config: PretrainedConfig) -> DraftHead:
    """The head ``build_head`` would build for a target of ``target_config``, on the meta device: its parameters
    without memory, for sizing a run before anything is loaded (``core.memory``)."""
    head_class = _head_class(head_cfg["type"])
    with torch.device("meta"):
        return head_class(head_class.make_config(head_cfg, target_config))


def check_head_config(config: HeadConfig, target_config: PretrainedConfig, where: str | Path) -> None:
    """Refuse a saved head config (``where``: its config.json) that does not fit this target or that its head
    type's build would not make for it (``DraftHead.check_fits``): what loading checks, without the weights."""
    _head_class(config.type).check_fits(config, target_config, where)


def load_head(
    head: str | Path | HeadFolder,
    target_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None = None,
    allow_other_tokenizer: bool = False,
) -> DraftHead:
    """The head saved in ``head`` (a folder, or a ``HeadFolder`` whose config.json was read already), checked
    against and attached to ``target_model``.

    With the target's ``tokenizer``, a head trained with another one is refused (``check_tokenizer``).
    """
    folder = head if isinstance(head, HeadFolder) else read_head_folder(head)
    head_class = _head_class(folder.config.type)
    return head_class.from_pretrained(folder.path, target_model, tokenizer, allow_other_tokenizer, folder.config)
