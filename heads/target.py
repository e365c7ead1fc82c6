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

from headstart.heads.head_config import DraftArch, HeadConfig
from headstart.heads.sparse_attention import query_chunk

# The draft decoder layer belongs to the head, not to the target: EAGLE-1/2, EAGLE-3, P-EAGLE and DFlash build
# one dense layer (the engines' Llama layer, or Qwen3's with q/k norm) sized from the target's hidden size,
# heads and rotary settings, whatever the target's own blocks are (MoE, MLA, sliding-window, linear attention,
# Mamba): the draft reads only post-block hidden states. docs/EXPORT.md, "Target families", lists who serves what.
#
# Families whose own attention normalises each head's query and key: the head's "target" draft layer is the
# engines' Qwen3 layer for them (vLLM's Eagle3Qwen3ForCausalLM), the Llama layer for every other family.
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "qwen3_next")
# Families whose EAGLE-1 layer keeps the target's own q/k/v biases, as the engines' Llama layer builds them from
# the draft config (``attention_bias``/``qkv_bias``): every other family's draft layer has none.
BIAS_FAMILIES = ("llama", "mistral", "qwen2")
# Families whose fused aux states the EAGLE-3 draft normalises before ``fc`` by default (``head.norm_before_fc``,
# vLLM's ``norm_before_fc``): gpt-oss's hidden states are large enough that the fusion explodes without it
# (speculators PR #337, whose gpt-oss recipe sets it).
NORM_BEFORE_FC_FAMILIES = ("gpt_oss",)
# An MLA target (DeepSeek-V2/V3, Kimi-K2: ``kv_lora_rank``) has no per-head keys and values to copy: the draft's
# Llama attention takes heads of the target's value width (hidden / v_head_dim of them) sharing this many key/value
# heads, the shape SpecForge's DeepSeek-V3 draft has (56 heads of 128, 8 key/value heads) and vLLM's and SGLang's
# Llama EAGLE-3 drafts serve on those targets.
MLA_DRAFT_KV_HEADS = 8
# The experts' count, under each family's name for it: a target with experts has no dense MLP to size the draft's
# from, unless some of its layers are dense (``dense_mlp_width``).
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_GEMMA_DRAFT = (
    "no serving engine has an EAGLE draft for {family} targets (vLLM's speculative registry and SGLang have "
    "none), and a Llama draft layer would differ from Gemma's: embeddings scaled by sqrt(hidden), (1 + w) "
    "RMSNorm, GELU MLP; train a Medusa head (head.type: medusa) instead"
)
# Families refused by the EAGLE heads, with the reason. (Medusa reads only the last hidden state and the
# target's lm_head, so it trains on any causal LM.)
UNSERVED_FAMILIES = {family: _GEMMA_DRAFT.format(family=family) for family in ("gemma", "gemma2")}
# EAGLE-1 on Gemma-3: the draft concatenates the raw embedding with the target's last hidden state, and
# neither engine has an EAGLE-1 draft tested for Gemma-3 targets (docs/EXPORT.md, "Gemma-3").
UNSERVED_EAGLE1 = {
    "gemma3_text": "no engine serves an EAGLE-1 draft for Gemma-3 targets; train an EAGLE-3 head (head.type: eagle3)"
}


def draft_target_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config a draft is built from and checked against: a vision-language target's text model (the draft is
    text-only, as vLLM's EAGLE-3 drafts for those targets are: it reads the text model's hidden states and token
    embeddings, images included only as the placeholder rows' states), else the target's own. Gemma-3's multimodal
    checkpoint so gives its ``gemma3_text`` model, whose heads the exports refuse where vLLM serves none."""
    if getattr(config, "vision_config", None) is None:
        return config
    return config.get_text_config()


def arch_from_target(cfg: PretrainedConfig) -> DraftArch:
    """The draft decoder layer's shape for this target (``family`` is its ``model_type``): the engines' dense
    Llama layer (Qwen3's for ``QK_NORM_FAMILIES``) with the target's hidden size, heads and rotary settings, a
    SiLU-gated MLP as wide as the target's dense one (``dense_mlp_width``: 0 where it has none, and a head that
    builds the layer takes ``head.intermediate_size``: ``draft_mlp_width``)."""
    rope = _rope(cfg)
    # transformers < 5 kept rope_theta beside rope_scaling (whose type key was once "type").
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    heads, kv_heads, head_dim = _attention_shape(cfg)
    return DraftArch(
        family=cfg.model_type,
        hidden_size=cfg.hidden_size,
        intermediate_size=dense_mlp_width(cfg) or 0,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        # Nemotron-H names its RMSNorm's epsilon layer_norm_epsilon.
        rms_norm_eps=getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_epsilon", None) or 1e-6,
        hidden_act="silu",  # the engines' Llama and Qwen3 MLPs refuse any other activation (vLLM ``LlamaMLP``)
        max_position_embeddings=cfg.max_position_embeddings,
        rope=rope,
        vocab_size=cfg.vocab_size,
        num_hidden_layers=cfg.num_hidden_layers,
        qkv_bias=_qkv_bias(cfg),
        qk_norm=cfg.model_type in QK_NORM_FAMILIES,
    )


def _attention_shape(cfg: PretrainedConfig) -> tuple[int, int, int]:
    """(heads, key/value heads, head dim) of the draft's attention: the target's, or for an MLA target
    (``MLA_DRAFT_KV_HEADS``) heads of its value width."""
    if getattr(cfg, "kv_lora_rank", None):
        head_dim = cfg.v_head_dim
        heads = cfg.hidden_size // head_dim
        return heads, MLA_DRAFT_KV_HEADS if heads % MLA_DRAFT_KV_HEADS == 0 else heads, head_dim
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads


def _rope(cfg: PretrainedConfig) -> dict[str, Any]:
    """The target's rotary settings for the draft layer. Targets mixing sliding-window and global layers keep one
    set per layer type (Gemma-3 in transformers 5: ``{"sliding_attention": ..., "full_attention": ...}``); the
    one-layer draft attends over the whole context, so it takes the global layers' set (their theta and
    scaling). The draft rotates its whole head, as the engines' draft layer does: a target's partial rotary
    (Qwen3-Next rotates a quarter of each head) is its own, not the draft's."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope = dict(rope["full_attention"]) if "full_attention" in rope else rope
    rope.pop("partial_rotary_factor", None)
    # A Qwen-VL target's 3-D split of each head (mrope) is its own too: the text-only draft rotates one position per
    # row, the temporal one (data_recipes.states.VisionRows), which vLLM feeds a draft whose config has no mrope.
    for key in ("mrope_section", "mrope_interleaved"):
        rope.pop(key, None)
    return rope


def _qkv_bias(cfg: PretrainedConfig) -> bool:
    """Whether the draft's q/k/v projections have biases: always for Qwen2, for the other ``BIAS_FAMILIES``
    as the config says (``qkv_bias``, as vLLM and SGLang's Llama layer read it, then Llama's
    ``attention_bias``), never for another family (gpt-oss's biases are its own layer's)."""
    if cfg.model_type == "qwen2":
        return True
    if cfg.model_type not in BIAS_FAMILIES:
        return False
    qkv_bias = getattr(cfg, "qkv_bias", None)
    return bool(getattr(cfg, "attention_bias", False) if qkv_bias is None else qkv_bias)


def experts(cfg: PretrainedConfig) -> int:
    """The target's routed experts per MoE layer (0 for a dense target)."""
    return max((getattr(cfg, key, None) or 0 for key in EXPERT_KEYS), default=0)


def dense_mlp_width(cfg: PretrainedConfig) -> int | None:
    """The width of the dense MLP the target's layers use, or None where every layer routes to experts (gpt-oss,
    Mixtral, Qwen3-MoE as published). An MoE family's dense layers: DeepSeek-V3's first ``first_k_dense_replace``,
    Qwen3-MoE/Next's ``mlp_only_layers`` (or every ``decoder_sparse_step``-th layer but one), Nemotron-H's "-"
    blocks (``mlp`` in ``layers_block_type``)."""
    if not experts(cfg):
        return cfg.intermediate_size
    dense_layers = (
        (getattr(cfg, "first_k_dense_replace", None) or 0) > 0
        or bool(getattr(cfg, "mlp_only_layers", None))
        or (getattr(cfg, "decoder_sparse_step", None) or 1) > 1
        or "mlp" in (getattr(cfg, "layers_block_type", None) or ())
    )
    return cfg.intermediate_size if dense_layers else None


def draft_mlp_width(cfg: PretrainedConfig, option: int | None, head_type: str) -> int:
    """The draft layer's MLP width: ``head.intermediate_size`` when set, else the target's dense MLP's; ValueError
    for a target with experts only, which has none to take."""
    width = option or dense_mlp_width(cfg)
    if width is None:
        raise ValueError(
            f"a {head_type} head for this {cfg.model_type} target needs head.intermediate_size: the target's "
            f"{experts(cfg)} experts replace its dense MLP in every layer, so there is no dense width to copy for "
            f"the draft's one dense layer (published drafts for MoE targets use about 6 x hidden_size, "
            f"{6 * cfg.hidden_size} here)"
        )
    return width


def check_eagle_family(cfg: PretrainedConfig, head_type: str) -> None:
    """NotImplementedError naming the target's family when no engine serves an EAGLE draft for it."""
    family = cfg.model_type
    reason = UNSERVED_FAMILIES.get(family) or (UNSERVED_EAGLE1.get(family) if head_type == "eagle" else None)
    if reason:
        raise NotImplementedError(f"{head_type} heads for {family} targets are not supported: {reason}")
    bias_o = getattr(cfg, "attention_bias", False) and getattr(cfg, "qkv_bias", None) is None
    if family in BIAS_FAMILIES and family != "qwen2" and bias_o:
        raise NotImplementedError(
            f"{head_type} heads for a {family} target with attention_bias: true (an o_proj bias) are not supported"
        )


def check_compatible(head_config: HeadConfig, target_config: PretrainedConfig, head_type: str | None = None) -> None:
    """Raise ValueError naming every way the saved head does not fit this target (or the expected type)."""
    problems = []
    if head_type is not None and head_config.type != head_type:
        problems.append(f"head type {head_config.type!r} vs {head_type!r}")
    target = arch_from_target(target_config)
    # The draft layer's heads are the head's own (arch_from_target sizes them once); what must fit is the width of
    # the states it reads and the vocabulary it drafts in.
    for key in ("hidden_size", "vocab_size"):
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

    ``logit_softcap``: the target's ``final_logit_softcapping`` (Gemma), None where it has none;
    ``logit_divisor``: its ``logits_scaling`` (Granite divides its logits by it), 1 where it has none."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    logit_softcap: float | None = None
    logit_divisor: float = 1.0

    def greedy(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's greedy token after each of its last hidden states [..., H] -> [...]: the argmax of its whole
        vocabulary's logits, a chunk of rows at a time (none kept; no gradient)."""
        rows = last_hidden.reshape(-1, last_hidden.shape[-1])
        chunk = query_chunk(len(rows), self.lm_head.out_features, 1, rows.device)
        with torch.no_grad():  # max(.., 1): an empty input still gives its (empty) shape
            greedy = [self.logits(rows[a : a + chunk]).argmax(-1) for a in range(0, max(len(rows), 1), chunk)]
        return torch.cat(greedy).view(last_hidden.shape[:-1])

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

    def logits(self, last_hidden: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The target's own logits of its last (normed) hidden states: ``lm_head``, divided by Granite's
        ``logits_scaling``, then the target's final soft-cap, c * tanh(logits / c), where its config sets one
        (Gemma's ``final_logit_softcapping``, which transformers, vLLM and SGLang apply before sampling and
        verification). The soft labels are these. ``ids``: only those tokens' logits (a draft vocabulary's: the
        lm_head's rows for them, not the whole matmul)."""
        weight: torch.Tensor = self.lm_head.weight
        bias: torch.Tensor | None = self.lm_head.bias
        if ids is not None:
            weight, bias = weight[ids], None if bias is None else bias[ids]
        # As rows: a [1, n, H] input would go through bmm, which copies a bf16 lm_head transposed on every call.
        rows = last_hidden.reshape(-1, last_hidden.shape[-1]).to(weight.dtype)
        logits = F.linear(rows, weight, bias).view(*last_hidden.shape[:-1], weight.shape[0])
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.logit_softcap:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits


def target_parts(target_model: PreTrainedModel) -> TargetParts:
    # transformers types both as any module; a causal LM's are an Embedding (or a subclass: Gemma's scaled
    # one) and a Linear, whose .weight the heads read.
    embed_tokens = cast(nn.Embedding, whole(target_model.get_input_embeddings()))
    lm_head = cast(nn.Linear, whole(target_model.get_output_embeddings()))
    config = target_model.config
    softcap = getattr(config, "final_logit_softcapping", None)
    return TargetParts(embed_tokens, lm_head, softcap, float(getattr(config, "logits_scaling", None) or 1.0))


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
