"""Draft-head modules: EAGLE-1/2, EAGLE-3, Medusa, DFlash, DSpark, DFlash-2, Domino and MTP (built on the shared core
only).

head = build_head({"type": "eagle3", "draft_vocab_size": 8000}, target_model, tokenizer)
head.config.options.layer_ids, head.config.arch.hidden_size, head.hidden_layers
head.save_pretrained("runs/x/head")
head = load_head("runs/x/head", target_model, tokenizer)   # checks the head fits this target and tokenizer
check_head_config(read_head_config("runs/x/head"), target_config, "runs/x/head/config.json")  # the same, no weights

One file per job: ``registry`` (the head types: one ``HeadType`` entry each), ``config`` (the typed head config
and its config.json), ``target`` (the target's layer shape, the families served, compatibility and tokenizer
checks), ``base`` (``DraftHead``: build, save, load), ``layers`` (the Llama draft layer: norm, rotary, attention
over the KV cache, MLP), ``losses`` (label alignment, soft cross-entropy), ``block`` (``BlockDrafter``: the
backbone DFlash, DSpark, DFlash-2 and Domino share), and one file per head type, which declares its options, module
and ``HEAD_TYPE`` entry: ``eagle``, ``eagle3``, ``medusa``, ``dflash``, ``dspark``, ``dflash2``, ``domino``, ``mtp``. A
head type's own classes and functions are imported from its file (``heads.eagle3.Eagle3Head``); this package names
what works for every head type.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.settings import TaggedUnion
from headstart.heads import dflash, dflash2, domino, dspark, eagle, eagle3, medusa, mtp
from headstart.heads.base import WEIGHTS_NAME, DraftHead, NonFiniteWeights, check_finite, state_problems
from headstart.heads.head_config import (
    CONFIG_NAME,
    DraftArch,
    HeadConfig,
    HeadFolder,
    HeadOptions,
    HeadSettings,
    read_head_config,
    read_head_folder,
)
from headstart.heads.layers import KVCache
from headstart.heads.registry import (
    HEAD_TYPES,
    Drafting,
    HeadType,
    drafting_of,
    drafting_owner,
    draftings,
    head_options_models,
    head_type,
    method_needs,
    register,
    registered,
    trainers,
)
from headstart.heads.sparse_attention import ttt_attention_mask
from headstart.heads.target import arch_from_target, check_compatible, check_tokenizer, draft_target_config

# The head types of this package, one line each, in the order every list of them follows (a head type from
# elsewhere: heads.register(its HEAD_TYPE)).
register(eagle.HEAD_TYPE)
register(eagle3.HEAD_TYPE)
register(medusa.HEAD_TYPE)
register(dflash.HEAD_TYPE)
register(dspark.HEAD_TYPE)
register(dflash2.HEAD_TYPE)
register(mtp.HEAD_TYPE)
register(domino.HEAD_TYPE)

# The config's head: section: its ``type`` picks the registered options model, so a key is checked against that
# head's options.
if TYPE_CHECKING:
    Head = HeadOptions
else:
    Head = Annotated[HeadOptions, TaggedUnion(head_options_models)]

__all__ = [
    "CONFIG_NAME",
    "HEAD_TYPES",
    "Drafting",
    "HeadType",
    "drafting_of",
    "drafting_owner",
    "draftings",
    "head_type",
    "method_needs",
    "register",
    "registered",
    "trainers",
    "Head",
    "HeadOptions",
    "HeadSettings",
    "WEIGHTS_NAME",
    "DraftArch",
    "DraftHead",
    "NonFiniteWeights",
    "HeadConfig",
    "HeadFolder",
    "KVCache",
    "arch_from_target",
    "build_head",
    "check_compatible",
    "check_finite",
    "check_head_config",
    "check_tokenizer",
    "head_options",
    "load_head",
    "meta_head",
    "read_head_config",
    "read_head_folder",
    "state_problems",
    "ttt_attention_mask",
]


def _type_of(settings: HeadSettings) -> str:
    # A mapping without a type names none of the head types: head_type refuses "" with the known ones.
    return settings.type if isinstance(settings, HeadOptions) else settings.get("type", "")


def _head_class(name: str) -> type[DraftHead]:
    return head_type(name).head


def build_head(
    settings: HeadSettings, target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
) -> DraftHead:
    """A fresh head for ``target_model``: ``settings`` is a config's validated ``head:`` section, or a mapping
    whose ``type`` names the head and whose other keys are its options.

    ``tokenizer`` (the target's) is recorded in the head's config, for ``load_head`` to check.
    """
    return _head_class(_type_of(settings)).build(settings, target_model, tokenizer)


def head_options(settings: HeadSettings) -> HeadOptions:
    """The validated options of the head type ``settings`` names (a copy: ``DraftHead.options_of``)."""
    return _head_class(_type_of(settings)).options_of(settings)


def meta_head(settings: HeadSettings, target_config: PretrainedConfig) -> DraftHead:
    """The head ``build_head`` would build for a target of ``target_config``, on the meta device: its parameters
    without memory, for sizing a run before anything is loaded (``core.memory``)."""
    head_class = _head_class(_type_of(settings))
    with torch.device("meta"):
        return head_class(head_class.make_config(settings, draft_target_config(target_config)))


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
