"""The target a head drafts for: its layer shape, the families EAGLE heads serve, whether a saved head
(and the tokenizer it was trained with) fits it, and the frozen parts a head borrows from it.

A head is built from the target's config once (``arch_from_target``); the shape goes into the head's
``config.json``, so a saved head rebuilds without the target's config and is checked against the target
it is loaded on (``check_compatible``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig, PreTrainedModel

from headstart.heads.config import DraftArch, HeadConfig

# Target families whose EAGLE draft layer the engines build (docs/EXPORT.md, "Target families"): a Llama
# decoder layer sized from the target, with the family's q/k/v biases (Qwen2) or q/k RMSNorm (Qwen3)
# where an engine builds them: ``arch.qkv_bias`` and ``arch.qk_norm`` describe the draft's layer,
# and each head keeps only what its engines have (``EagleHead``/``Eagle3Head.make_config``).
EAGLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Gemma-3 text targets (Gemma3ForCausalLM) for EAGLE-3 only: SGLang serves them with its plain Llama
# draft (``gemma3_causal.py`` ``set_eagle3_layers_to_capture`` + ``llama_eagle3.py``), so the draft layer is
# the Llama one whatever Gemma's own layer is ((1 + w) RMSNorm, GELU MLP, q/k norm): see ``LLAMA_DRAFT_FAMILIES``.
EAGLE3_FAMILIES = (*EAGLE_FAMILIES, "gemma3_text")
# Families whose EAGLE draft is the plain Llama layer with a SiLU-gated MLP, not the family's: the engines'
# Llama MLP refuses any other activation (vLLM and SGLang ``llama.py`` ``LlamaMLP``), so Gemma's GELU stays
# the target's.
LLAMA_DRAFT_FAMILIES = ("gemma3_text",)
_GEMMA_DRAFT = (
    "no serving engine has an EAGLE draft for {family} targets (vLLM's speculative registry and SGLang have "
    "none), and a Llama draft layer would differ from Gemma's: embeddings scaled by sqrt(hidden), (1 + w) "
    "RMSNorm, GELU MLP; train a Medusa head (head.type: medusa) instead"
)
# Families refused by the EAGLE heads, with the reason. (Medusa reads only the last hidden state and the
# target's lm_head, so it trains on any causal LM.)
UNSERVED_FAMILIES = {family: _GEMMA_DRAFT.format(family=family) for family in ("gemma", "gemma2")}
UNSERVED_FAMILIES["gemma3"] = (
    "this is the multimodal Gemma-3 checkpoint (Gemma3ForConditionalGeneration); EAGLE-3 heads train on the "
    "text model (model_type gemma3_text, Gemma3ForCausalLM, as the 1B checkpoint is), whose aux hidden states "
    "SGLang captures"
)
# EAGLE-1 on Gemma-3: the draft concatenates the raw embedding with the target's last hidden state, and
# neither engine has an EAGLE-1 draft tested for Gemma-3 targets (docs/EXPORT.md, "Gemma-3").
UNSERVED_EAGLE1 = {
    "gemma3_text": "no engine serves an EAGLE-1 draft for Gemma-3 targets; train an EAGLE-3 head (head.type: eagle3)"
}


def arch_from_target(cfg: PretrainedConfig) -> DraftArch:
    """The draft decoder layer's shape, from the target's config (``family`` is its ``model_type``)."""
    rope = _rope(cfg)
    # transformers < 5 kept rope_theta beside rope_scaling (whose type key was once "type").
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    # Gemma configs name it hidden_activation.
    hidden_act = getattr(cfg, "hidden_act", None) or cfg.hidden_activation
    return DraftArch(
        family=cfg.model_type,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        hidden_act="silu" if cfg.model_type in LLAMA_DRAFT_FAMILIES else hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rope=rope,
        vocab_size=cfg.vocab_size,
        num_hidden_layers=cfg.num_hidden_layers,
        qkv_bias=_qkv_bias(cfg),
        qk_norm=cfg.model_type == "qwen3",
    )


def _rope(cfg: PretrainedConfig) -> dict[str, Any]:
    """The target's rotary settings. Targets mixing sliding-window and global layers keep one set per layer
    type (Gemma-3 in transformers 5: ``{"sliding_attention": ..., "full_attention": ...}``); the one-layer
    draft attends over the whole context, so it takes the global layers' set (their theta and scaling)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    return dict(rope["full_attention"]) if "full_attention" in rope else rope


def _qkv_bias(cfg: PretrainedConfig) -> bool:
    """Whether the target's q/k/v projections have biases: always for Qwen2, else the config says so
    (``qkv_bias``, as vLLM and SGLang's Llama layer read it, then Llama's ``attention_bias``)."""
    if cfg.model_type == "qwen2":
        return True
    qkv_bias = getattr(cfg, "qkv_bias", None)
    return bool(getattr(cfg, "attention_bias", False) if qkv_bias is None else qkv_bias)


def check_eagle_family(cfg: PretrainedConfig, head_type: str) -> None:
    """NotImplementedError naming the target's family when an EAGLE head cannot be built (and served) for it."""
    family = cfg.model_type
    families = EAGLE3_FAMILIES if head_type == "eagle3" else EAGLE_FAMILIES
    reason = UNSERVED_FAMILIES.get(family) or (UNSERVED_EAGLE1.get(family) if head_type == "eagle" else None)
    if reason:
        raise NotImplementedError(f"{head_type} heads for {family} targets are not supported: {reason}")
    if family not in families:
        raise NotImplementedError(
            f"{head_type} heads for {family} targets are not supported: "
            f"the draft layer is known for {', '.join(families)} targets only (docs/EXPORT.md); "
            "Medusa heads (head.type: medusa) train on any causal LM"
        )
    if getattr(cfg, "attention_bias", False) and getattr(cfg, "qkv_bias", None) is None and family != "qwen2":
        raise NotImplementedError(
            f"{head_type} heads for a {family} target with attention_bias: true (an o_proj bias) are not supported"
        )


def check_compatible(head_config: HeadConfig, target_config: PretrainedConfig, head_type: str | None = None) -> None:
    """Raise ValueError naming every way the saved head does not fit this target (or the expected type)."""
    problems = []
    if head_type is not None and head_config.type != head_type:
        problems.append(f"head type {head_config.type!r} vs {head_type!r}")
    target = arch_from_target(target_config)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        ours, theirs = getattr(head_config.arch, key), getattr(target, key)
        if ours != theirs:
            problems.append(f"{key.replace('_', ' ')} {ours} vs {theirs}")
    # The sizes the head's own tensors are built from (fc's input, Medusa's blocks, d2t/t2d), beside the arch's;
    # named when they differ from it (an edited config.json), as a mismatch with the arch's is named above.
    for key, arch_key in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        ours, theirs = getattr(head_config, key), getattr(target, arch_key)
        if ours != theirs and ours != getattr(head_config.arch, arch_key):
            problems.append(f"{key} {ours} vs {theirs}")
    draft_vocab = getattr(head_config.options, "draft_vocab_size", None)
    if draft_vocab is not None and draft_vocab > target.vocab_size:
        problems.append(
            f"draft_vocab_size {draft_vocab} vs vocab size {target.vocab_size}: "
            "the draft vocabulary must not be larger than the target's"
        )
    layers = target.num_hidden_layers
    bad_layers = [i for i in getattr(head_config.options, "layer_ids", None) or [] if not 0 <= i < layers]
    if bad_layers:
        problems.append(f"layer ids {bad_layers} outside the target's {layers} layers")
    if problems:
        raise ValueError(
            f"head built for {head_config.target!r} does not fit this target "
            f"({getattr(target_config, '_name_or_path', '') or 'unnamed'}): "
            + "; ".join(problems)
            + " (head vs target)"
        )


def check_tokenizer(
    head_config: HeadConfig,
    target_hash: str | None,
    where: Any,
    allow_other: bool = False,
    remedy: str = "pass --allow-other-tokenizer if you know the two tokenizers agree",
) -> None:
    """Refuse a head trained with another tokenizer than the target's (``target_hash``): same vocabulary size or
    not, its ids would stand for other tokens. ``allow_other`` makes that a warning; a head that records no
    tokenizer (trained before heads recorded it) loads with a warning, as nothing can be checked.
    """
    recorded = head_config.tokenizer_hash
    if recorded is None:
        warnings.warn(
            f"{where}: the head records no tokenizer hash (trained before heads recorded one): "
            "cannot check that the target's tokenizer is the one it was trained with",
            stacklevel=2,
        )
        return
    if recorded == target_hash:
        return
    message = (
        f"{where}: the head was trained with another tokenizer than the target's "
        f"(tokenizer hash {recorded} in the head, {target_hash} in the target)"
    )
    if not allow_other:
        raise ValueError(
            f"{message}: the same ids would mean other tokens (or another chat template); use the target it was "
            f"trained for, or {remedy}"
        )
    warnings.warn(f"{message}; going on as asked", stacklevel=2)


@dataclass
class TargetParts:
    """Frozen modules borrowed from the target. A plain attribute, not a submodule: they are never saved
    with the head, never trained, and ``head.to(dtype)`` does not cast the target's own weights.

    ``logit_softcap``: the target's ``final_logit_softcapping`` (Gemma), None where it has none."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    logit_softcap: float | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Rows of the target's embedding table, as the engines embed a draft's tokens: they share the table
        (vLLM ``_maybe_share_embeddings``, SGLang ``set_embed_and_head``), never a scale the target's own
        forward applies. Gemma's module (``Gemma3TextScaledWordEmbedding``) multiplies by sqrt(hidden) in
        transformers, vLLM and SGLang alike, and that scale is the target's, not the draft's. It matters
        where the embedding enters unnormed: DFlash's residual stream starts at it, EAGLE-1 concatenates it
        raw. EAGLE-3 normalises it first (``input_layernorm``), which removes a constant scale up to the
        norm's eps (x / sqrt(mean(x^2) + eps): the scale moves eps by a factor of hidden), so the unscaled
        rows are what the served draft computes exactly.
        """
        return F.embedding(input_ids, self.embed_tokens.weight)

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits of its last (normed) hidden states: ``lm_head``, then the target's final
        soft-cap, c * tanh(logits / c), where its config sets one (Gemma's ``final_logit_softcapping``, which
        transformers, vLLM and SGLang apply before sampling and verification). The soft labels are these."""
        logits = self.lm_head(last_hidden.to(self.lm_head.weight.dtype))
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def target_parts(target_model: PreTrainedModel) -> TargetParts:
    # transformers types both as any module; a causal LM's are an Embedding (or a subclass: Gemma's scaled
    # one) and a Linear, whose .weight the heads read.
    embed_tokens = cast(nn.Embedding, whole(target_model.get_input_embeddings()))
    lm_head = cast(nn.Linear, whole(target_model.get_output_embeddings()))
    return TargetParts(embed_tokens, lm_head, getattr(target_model.config, "final_logit_softcapping", None))


def whole(module: nn.Module) -> nn.Module:
    """``module`` itself, or, when tensor parallelism split its weight across ranks (a DTensor), a plain copy
    holding the whole weight: a head on a split target drafts on every rank of the group with the same full
    embedding and lm_head (one such copy per rank, counted in ``core.memory``)."""
    weight = module.weight
    if not isinstance(weight, DTensor):
        return module
    full = weight.full_tensor()
    if isinstance(module, nn.Embedding):
        return nn.Embedding.from_pretrained(full, freeze=True)
    linear = nn.Linear(full.shape[1], full.shape[0], bias=False, device=full.device, dtype=full.dtype)
    linear.weight = nn.Parameter(full, requires_grad=False)
    return linear
