"""MTP heads <-> the target checkpoint's own MTP layer, under the family's names (``heads.mtp.MTP_FAMILIES``).

The ``vllm`` layout is a folder vLLM serves with ``method: mtp``: the target's config.json (vLLM's
``SpeculativeConfig.hf_config_override`` turns it into the family's MTP model, ``MiMoMTPModel`` or
``ErnieMTPModel``) and the tensors that model loads (``load_weights`` keeps the ``mtp`` layer's, ``embed_tokens``
and ``lm_head``): the tuned layer under the checkpoint's names, with the target's own embedding and lm_head beside
it. ``export --stitch`` instead writes a copy of the target with the tuned layer in place of its own
(``export.stitch``), which vLLM serves with ``method: mtp`` and no draft model at all.

Import (``--from mtp``) reads the layer back from any folder holding it under the family's names: such an export, a
stitched copy, or the target itself (its untuned layer: the baseline a tuned one is compared against).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from headstart.core.weights import borrowed_names, meta_model, read_named
from headstart.core.weights import target_config as read_target_config
from headstart.export.card import ENGINES, code_block, served_schedule, served_steps, vllm_command
from headstart.export.layouts import EngineFiles, Imported, not_written
from headstart.heads import WEIGHTS_NAME, HeadConfig
from headstart.heads.head_config import resolved
from headstart.heads.mtp import MTP_FAMILIES, MtpFamily, MtpHead, mtp_family

LAYOUTS: tuple[str, ...] = ("vllm",)
SOURCES: tuple[str, ...] = ("mtp",)
FILES: tuple[str, ...] = (WEIGHTS_NAME,)
SERVED = True


def refusal(fmt: str) -> str:
    return not_written("mtp", fmt, LAYOUTS, {"sglang": "headstart writes MTP layers for vLLM's *_mtp models only"})


def checkpoint_tensors(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The head's tensors under the target checkpoint's names (the first MTP layer's: the one vLLM serves)."""
    family = mtp_family_of(config)
    return {family.checkpoint_name(name): tensor for name, tensor in state.items()}


def mtp_family_of(config: HeadConfig) -> MtpFamily:
    return MTP_FAMILIES[resolved(config.options.family, "family")]


def shared_tensors(target: str, target_config: PretrainedConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The target's embedding and lm_head (the embedding alone where they are tied), under its names, in ``dtype``:
    what vLLM's MTP model loads beside the layer."""
    names = borrowed_names(meta_model(target_config))
    wanted = [names["embed"]]
    if not target_config.get_text_config().tie_word_embeddings:
        wanted.append(names["lm_head"])
    return {name: tensor.to(dtype) for name, tensor in read_named(target, wanted).items()}


def export_files(
    config: HeadConfig, state: dict[str, torch.Tensor], fmt: str, target: str, target_config: PretrainedConfig
) -> EngineFiles:
    """The target's config.json and the MTP model's tensors: the tuned layer, the target's embedding and lm_head."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    tensors = checkpoint_tensors(config, state) | shared_tensors(target, target_config, dtype)
    engine_config = target_config.to_dict()
    engine_config["num_nextn_predict_layers"] = max(1, engine_config.get("num_nextn_predict_layers") or 0)
    return EngineFiles(engine_config, tensors)


def extra_files(config: HeadConfig, state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {}


def import_files(kind: str, src: Path, target_config: PretrainedConfig) -> Imported:
    """(options, the layer's shape, our tensors) of the MTP layer that ``src`` holds under the target family's
    names; ``src``'s own config must be of the target's family."""
    family = mtp_family(target_config)
    source_family = mtp_family(read_target_config(src))
    if source_family is not family:
        raise ValueError(f"{src} holds a {source_family.name} MTP layer; the target's family is {family.name}")
    config = MtpHead.make_config({"type": "mtp", "family": family.name}, target_config)
    with torch.device("meta"):
        ours = list(MtpHead(config).state_dict())
    names = {name: family.checkpoint_name(name) for name in ours}
    tensors = read_named(src, list(names.values()))
    state = {name: tensors[theirs] for name, theirs in names.items()}
    return Imported({"type": "mtp", "family": family.name}, config.arch, state)


def layout(fmt: str, short: bool = False) -> str:
    return "the target's MTP layer, as vLLM's *_mtp models load it" if not short else "target MTP layout"


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    family = mtp_family_of(config)
    return [
        ("MTP family", f"{family.name} (vLLM's {family.vllm_model})"),
        ("draft steps trained", f"{config.options.steps}, weights {config.options.step_decay}^j"),
    ]


def serve(config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    schedule = served_schedule(head_dir)
    command = vllm_command(target, draft, "mtp", served_steps(schedule), schedule=schedule)
    return (
        f"{ENGINES['vllm']}:\n\n{code_block(command)}\n\nOr serve the target with the tuned layer in place (the "
        'folder `export --stitch` writes) with `--speculative-config \'{"method": "mtp"}\'` and no draft model.'
    )
