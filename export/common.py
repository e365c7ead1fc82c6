"""What every format shares: the draft decoder's Llama-style config, reading published checkpoints."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, PretrainedConfig

from headstart.core.weights import checkpoint_roots, file_inside  # the one rule: core owns it, export uses it
from headstart.heads import DraftArch, HeadConfig, arch_from_target

# The draft's own layer shape (heads.target: the draft layer is the head's), taken from a published checkpoint's
# config on import: its MLP width, attention shape, norms and rotary.
DRAFT_ARCH_KEYS = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "rope",
    "max_position_embeddings",
    "qkv_bias",
    "qk_norm",
)


# Target families vLLM cannot serve a draft for that reads the target's aux hidden states (EAGLE-3, DFlash), with
# the reason (docs/EXPORT.md, "Gemma-3"). Refused for the formats only vLLM serves: vllm, speculators.
VLLM_UNSERVED_FAMILIES = {
    "gemma3_text": (
        "vLLM 0.32's Gemma3ForCausalLM (vllm/model_executor/models/gemma3.py) does not implement SupportsEagle3, "
        "so vLLM cannot capture the target's aux hidden states for the draft (gpu_model_runner.py: 'Model does "
        "not support EAGLE3 interface'); vLLM's Gemma-3 EAGLE-3 is still an open PR (vllm-project/vllm#49560)"
    )
}


# The target families whose aux hidden states (what EAGLE-3, P-EAGLE and DFlash drafts read) each engine captures
# with its own model class: vLLM 0.32.0's implements SupportsEagle3 (vllm/model_executor/models/), SGLang 0.5.23's
# set_eagle3_layers_to_capture (srt/models/); read from the two wheels. docs/EXPORT.md's "Families by engine" table
# is this one (tests/heads/test_target_families.py). vLLM serves any other family through its Transformers backend
# (``--model-impl transformers``: its model class captures aux states for every model), which the serve command
# then names; SGLang has no such fallback.
AUX_CAPTURE: dict[str, tuple[str, ...]] = {
    "llama": ("vllm", "sglang"),
    "mistral": ("vllm", "sglang"),
    "phi3": ("vllm",),
    "qwen2": ("vllm", "sglang"),
    "qwen2_moe": ("sglang",),
    "qwen3": ("vllm", "sglang"),
    "qwen3_moe": ("vllm", "sglang"),
    "qwen3_next": ("vllm", "sglang"),
    "gpt_oss": ("vllm", "sglang"),
    "deepseek_v2": ("vllm", "sglang"),
    "deepseek_v3": ("vllm", "sglang"),
    "minimax_m2": ("vllm", "sglang"),
    "glm4_moe": ("sglang",),
    "gemma3_text": ("sglang",),
    "gemma4_text": ("vllm", "sglang"),
    "granite": ("vllm",),
    "nemotron_h": ("vllm",),
    "granitemoehybrid": (),
    "mixtral": (),
}


def captures_natively(family: str | None, engine: str) -> bool:
    """Whether ``engine``'s own model class for ``family`` captures aux hidden states (``AUX_CAPTURE``)."""
    return engine in AUX_CAPTURE.get(family or "", ())


def check_vllm_serves_family(config: HeadConfig, fmt: str, instead: str) -> None:
    """Refuse a layout of an aux-state head for an engine that cannot capture this target family's aux states: a
    vLLM-read one (vllm, speculators) for ``VLLM_UNSERVED_FAMILIES``, SGLang's for a family SGLang has no capturing
    class for (``AUX_CAPTURE``); ``instead`` says what to do for vLLM's."""
    family = config.arch.family
    if fmt in ("vllm", "speculators") and family in VLLM_UNSERVED_FAMILIES:
        raise ValueError(
            f"cannot export a {config.type} head for a {family} target as {fmt!r}: "
            f"{VLLM_UNSERVED_FAMILIES[family]}; {instead}"
        )
    if fmt == "sglang" and family is not None and not captures_natively(family, "sglang"):
        raise ValueError(
            f"cannot export a {config.type} head for a {family} target as 'sglang': SGLang 0.5.23 has no {family} "
            "model class that captures the aux hidden states the draft reads (set_eagle3_layers_to_capture); "
            "export it with --format vllm (docs/EXPORT.md, 'Families by engine')"
        )


# vLLM 0.32 keeps a draft's own embed_tokens only where it differs from the target's (``llm_base_proposer.py``
# ``_maybe_share_embeddings``, for every EAGLE-style draft: it shares the target's table when the checkpoint has none,
# or when the one it has is ``torch.equal`` to the target's as both are loaded, in the serving dtype). SGLang's EAGLE
# workers always put the target's in (``eagle_worker.py``: ``set_embed`` for EAGLE-3, ``set_embed_and_head`` else).
OWN_EMBEDDING = "embed_tokens.weight"


def keep_own_embedding(options: dict[str, Any], state: dict[str, torch.Tensor], target_embedding: torch.Tensor) -> None:
    """Apply vLLM's rule to an imported checkpoint's ``embed_tokens`` in place: a copy of the target's rows (compared
    in the checkpoint's dtype, as vLLM compares them served in it) is dropped, the head reading the target's; a table
    of its own stays, and the head drafts with it (option ``own_embedding``)."""
    theirs = state.get(OWN_EMBEDDING)
    if theirs is None:
        return
    if theirs.shape == target_embedding.shape and torch.equal(theirs, target_embedding.to(theirs.dtype)):
        del state[OWN_EMBEDDING]
    else:
        options["own_embedding"] = True


def check_sglang_embedding(config: HeadConfig, fmt: str) -> None:
    """Refuse SGLang's layout for a head drafting with its own embedding: SGLang would draft with the target's."""
    if fmt == "sglang" and config.options.own_embedding:
        raise ValueError(
            f"this {config.type} head drafts with its own embedding (own_embedding), which SGLang 0.5.23 replaces by "
            "the target's (eagle_worker.py set_embed): export it with --format vllm, which keeps it"
        )


def dtype_name(state: dict[str, torch.Tensor]) -> str:
    """The floating dtype the weights are stored in, as config.json spells it ("bfloat16")."""
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    return str(dtype).removeprefix("torch.")


def rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta`` + ``rope_scaling`` (null for plain RoPE): the spelling every transformers version,
    the EAGLE repo and speculators' converter read (transformers 5 turns it into ``rope_parameters``)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": rope["rope_theta"], "rope_scaling": None if scaling["rope_type"] == "default" else scaling}


def decoder_config(arch: DraftArch, dtype: str) -> dict[str, Any]:
    """A one-layer config of the draft's decoder layer (vocab = the target's): Llama's, or Qwen3's when
    the layer has q/k norm (``model_type`` picks the engine's layer class).

    q/k/v biases (``arch.qkv_bias``) are spelled as vLLM's and SGLang's Llama layer read them
    (llama.py: ``attention_bias`` sets the o_proj bias and, unless ``qkv_bias`` is given, the q/k/v ones).
    """
    bias = {"qkv_bias": True} if arch.qkv_bias else {}
    return {
        "model_type": "qwen3" if arch.qk_norm else "llama",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "hidden_act": arch.hidden_act,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        **rope_fields(arch.rope),
        "vocab_size": arch.vocab_size,
        "attention_bias": False,
        **bias,
        "mlp_bias": False,
        # SGLang's LlamaForCausalLMEagle3 makes lm_head the embedding when this is true.
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def check_full_attention(config: dict[str, Any], target_config: PretrainedConfig) -> None:
    """Refuse a draft layer that attends through a sliding window shorter than the target's context.

    headstart's draft layers attend to the whole context. A ``sliding_attention`` layer (speculators 0.9.0's
    trainer default: a 2048-token window) whose window is at least the target's ``max_position_embeddings`` sees
    every key the target's context can hold, as vLLM serves it (a query at position p keeps keys p - window + 1
    .. p): exactly full attention. A shorter window would drop keys the head attends to."""
    layer_types = config.get("layer_types") or []
    others = set(layer_types) - {"full_attention", "sliding_attention"}
    if others:
        raise ValueError(f"layer_types {layer_types}: headstart's draft layers attend to the whole context only")
    if "sliding_attention" not in layer_types:
        return
    window, context = config.get("sliding_window"), target_config.max_position_embeddings
    if window is None or window < context:
        raise ValueError(
            f"the draft layer is a sliding_attention layer with a {window}-token window, shorter than the target's "
            f"{context}-token context (max_position_embeddings): headstart's draft layers attend to the whole "
            "context, which a window of at least the context is (train the draft with full attention: "
            "speculators' --full-attention-indices 0)"
        )


def arch_from_decoder(config: dict[str, Any], target_config: PretrainedConfig) -> DraftArch:
    """Our draft arch read from a published draft's decoder config (family and layer count: the target's).

    The draft's own layer count and ``layer_types`` are left out: transformers checks one against the other, and
    speculators 0.9.0 writes ``layer_types`` for its one layer without ``num_hidden_layers`` (LlamaConfig's default
    is 32). Its window is left out too, once ``check_full_attention`` finds it covers the target's context."""
    check_full_attention(config, target_config)
    skip = {"architectures", "auto_map", "num_hidden_layers", "model_type", "layer_types", "sliding_window"}
    arch = arch_from_target(LlamaConfig(**{k: v for k, v in config.items() if k not in skip}))
    arch.family, arch.num_hidden_layers = target_config.model_type, target_config.num_hidden_layers
    return arch


def check_out(
    out: Path, src: Path, what: str, overwrite: bool = False, replaceable: frozenset[str] = frozenset()
) -> None:
    """Refuse an ``out`` whose writing would lose files: it is replaced whole (``core.io.atomic_dir``).

    ``out`` may be missing, empty, or hold only ``replaceable`` names (an earlier output of the same
    command); anything else needs ``overwrite``. Never ``src`` (the ``what`` being read) or a folder holding it.
    """
    out_abs, src_abs = out.resolve(), src.resolve()
    if out_abs == src_abs:
        raise ValueError(f"--out {out} is the {what} itself")
    if src_abs.is_relative_to(out_abs):
        raise ValueError(f"--out {out} holds the {what} {src}: replacing it would delete it")
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    stray = sorted(p.name for p in out.iterdir() if p.name not in replaceable)
    if stray and not overwrite:
        more = f" and {len(stray) - 5} more" if len(stray) > 5 else ""
        raise ValueError(
            f"--out {out} exists and holds {stray[:5]}{more}, which replacing it would delete: "
            "pick another folder, or pass --overwrite to replace it whole"
        )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file from elsewhere (an engine's config.json, an index); ValueError naming the file when
    it is not UTF-8 JSON or not an object."""
    if not path.is_file():
        raise FileNotFoundError(f"missing {path.name} in {path.parent}")
    try:
        found = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not UTF-8 JSON ({err})") from None
    if not isinstance(found, dict):
        raise ValueError(f"{path}: a JSON {type(found).__name__}, where a JSON object was expected")
    return found


def load_pickled_tensors(source: Path | bytes, where: str | Path) -> Any:
    """``torch.load(weights_only=True)`` of a file from elsewhere (a ``.bin``, a ``mask_embedding.pt``): never
    runs code from it. A crafted pickle or a file that is not torch's is a ValueError naming ``where``, not
    torch's bare error, which names no file (and suggests ``weights_only=False``, which would run the code)."""
    try:
        return torch.load(
            io.BytesIO(source) if isinstance(source, bytes) else source, map_location="cpu", weights_only=True
        )
    # Broken bytes fail in the unpickler, the zip reader or the legacy reader: UnpicklingError, RuntimeError,
    # EOFError, KeyError, whichever comes first; every one means the same here.
    except Exception as err:
        reason = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()
        raise ValueError(
            f"{where} is not a tensor file loadable with torch.load(weights_only=True) "
            f"({type(err).__name__}: {reason[0] if reason else 'no detail'}): a crafted pickle, another format "
            "or a damaged file; nothing in it was run"
        ) from None


def _load_one(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors in ``path``, read as its ``name`` says (a hub cache blob that it links to has no suffix)."""
    if name.endswith(".safetensors"):
        return load_file(str(path))
    # weights_only: a .bin from the hub is a pickle; never run code from it.
    return load_pickled_tensors(path, path)


def read_checkpoint(
    src: Path, names: tuple[str, ...] = ("model.safetensors", "pytorch_model.bin")
) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: the first of ``names`` present, or its sharded ``.index.json``.

    Every file read must lie inside ``src`` (``file_inside``), whatever the index names.
    """
    roots = checkpoint_roots(src)
    for name in names:
        if (src / name).is_file():
            return _load_one(file_inside(src / name, roots), name)
        index = src / f"{name}.index.json"
        if index.is_file():
            weight_map = read_json(file_inside(index, roots))["weight_map"]
            first_entry = {shard: tensor for tensor, shard in reversed(weight_map.items())}
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(first_entry):
                what = f"{index.name}: weight_map entry {first_entry[shard]!r} -> {shard!r}"
                state.update(_load_one(file_inside(src / shard, roots, what), shard))
            return state
    raise FileNotFoundError(f"no weights in {src}: expected one of {', '.join(names)} (or a sharded .index.json)")


def rename_prefixes(state: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    """``state`` with each key's first matching prefix in ``renames`` replaced (keys without one kept as they are)."""
    out = {}
    for name, tensor in state.items():
        for old, new in renames.items():
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        out[name] = tensor
    return out
