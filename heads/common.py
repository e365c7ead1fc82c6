"""Pieces every draft head shares: the target's layer shape, norms, rotary attention, KV cache, save/load.

A head is built from the target's config once (``arch_from_target``); the resulting plain dict goes
into the head's ``config.json``, so a saved head rebuilds without the target's config and is checked
against the target it is loaded on (``check_compatible``).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase
from transformers.activations import ACT2FN

from core.fingerprint import tokenizer_hash
from core.io import atomic_dir

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


# Target families whose EAGLE draft layer the engines build (docs/EXPORT.md, "Target families"): a Llama
# decoder layer sized from the target, with the family's q/k/v biases (Qwen2) or q/k RMSNorm (Qwen3)
# where an engine builds them: ``arch["qkv_bias"]`` and ``arch["qk_norm"]`` describe the draft's layer,
# and each head keeps only what its engines have (``EagleHead``/``Eagle3Head.make_config``).
EAGLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Families refused by the EAGLE heads, with the reason. (Medusa reads only the last hidden state and the
# target's lm_head, so it trains on any causal LM.)
UNSERVED_FAMILIES = {
    family: (
        "no serving engine has an EAGLE draft for Gemma-style targets (vLLM's speculative registry and SGLang "
        "have none), and a Llama draft layer would differ from Gemma's: embeddings scaled by sqrt(hidden), "
        "(1 + w) RMSNorm, GELU MLP; train a Medusa head (head.type: medusa) instead"
    )
    for family in ("gemma", "gemma2", "gemma3", "gemma3_text")
}


def arch_from_target(cfg: PretrainedConfig) -> dict[str, Any]:
    """The decoder-layer shape of the target, as a JSON-able dict (``family`` is its ``model_type``)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    # transformers < 5 kept rope_theta beside rope_scaling (whose type key was once "type").
    rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")
    return {
        "family": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Gemma configs name it hidden_activation.
        "hidden_act": getattr(cfg, "hidden_act", None) or cfg.hidden_activation,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope": rope,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "qkv_bias": _qkv_bias(cfg),
        "qk_norm": cfg.model_type == "qwen3",  # RMSNorm over each head's q and k, before rotary
    }


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
    if family in UNSERVED_FAMILIES:
        raise NotImplementedError(
            f"{head_type} heads for {family} targets are not supported: {UNSERVED_FAMILIES[family]}"
        )
    if family not in EAGLE_FAMILIES:
        raise NotImplementedError(
            f"{head_type} heads for {family} targets are not supported: "
            f"the draft layer is known for {', '.join(EAGLE_FAMILIES)} targets only (docs/EXPORT.md); "
            "Medusa heads (head.type: medusa) train on any causal LM"
        )
    if getattr(cfg, "attention_bias", False) and getattr(cfg, "qkv_bias", None) is None and family != "qwen2":
        raise NotImplementedError(
            f"{head_type} heads for a {family} target with attention_bias: true (an o_proj bias) are not supported"
        )


def check_compatible(
    head_config: dict[str, Any], target_config: PretrainedConfig, head_type: str | None = None
) -> None:
    """Raise ValueError naming every way the saved head does not fit this target (or the expected type)."""
    problems = []
    if head_type is not None and head_config.get("type") != head_type:
        problems.append(f"head type {head_config.get('type')!r} vs {head_type!r}")
    target = arch_from_target(target_config)
    for key in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        if head_config["arch"][key] != target[key]:
            problems.append(f"{key.replace('_', ' ')} {head_config['arch'][key]} vs {target[key]}")
    bad_layers = [i for i in head_config.get("layer_ids", []) if not 0 <= i < target["num_hidden_layers"]]
    if bad_layers:
        problems.append(f"layer ids {bad_layers} outside the target's {target['num_hidden_layers']} layers")
    if problems:
        raise ValueError(
            f"head built for {head_config.get('target')!r} does not fit this target "
            f"({getattr(target_config, '_name_or_path', '') or 'unnamed'}): "
            + "; ".join(problems)
            + " (head vs target)"
        )


def check_tokenizer(
    head_config: dict[str, Any],
    target_hash: str | None,
    where: Any,
    allow_other: bool = False,
    remedy: str = "pass --allow-other-tokenizer if you know the two tokenizers agree",
) -> None:
    """Refuse a head trained with another tokenizer than the target's (``target_hash``): same vocabulary size or
    not, its ids would stand for other tokens. ``allow_other`` makes that a warning; a head that records no
    tokenizer (trained before heads recorded it) loads with a warning, as nothing can be checked.
    """
    recorded = head_config.get("tokenizer_hash")
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
    with the head, never trained, and ``head.to(dtype)`` does not cast the target's own weights."""

    embed_tokens: nn.Module
    lm_head: nn.Module


def target_parts(target_model: nn.Module) -> TargetParts:
    return TargetParts(target_model.get_input_embeddings(), target_model.get_output_embeddings())


def save_head(head: nn.Module, config: dict[str, Any], out_dir: str | Path) -> None:
    """``config.json`` + ``model.safetensors``, written atomically (a reader never sees half a head)."""
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})


def read_head_config(head_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(head_dir) / CONFIG_NAME).read_text())


def load_head_weights(head: nn.Module, head_dir: str | Path, device: torch.device) -> nn.Module:
    """Load the saved tensors into ``head`` and move it to ``device`` in the dtype it was saved in."""
    state = load_file(str(Path(head_dir) / WEIGHTS_NAME))
    head.load_state_dict(state, strict=True)
    dtype = next(t.dtype for t in state.values() if t.is_floating_point())
    return head.to(device=device, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the target does, so bf16 heads see the same statistics.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(rope: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies for the target's rotary type: default, linear or llama3."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    kind = rope["rope_type"]
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise NotImplementedError(
        f"rotary embedding type {kind!r} is not supported by the draft heads (default, linear, llama3 are)"
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: dict[str, Any], head_dim: int):
        super().__init__()
        # A plain attribute, not a buffer: ``head.to(bf16)`` must not round the frequencies.
        self.inv_freq = rope_inv_freq(rope, head_dim)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, n, head_dim] for ``position_ids`` [B, n] (angles computed in fp32)."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, heads, n, d] by cos/sin [B, n, d] (the half-split layout HF Llama checkpoints use)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """The draft layer's keys and values, [B, kv_heads, length, head_dim], grown one draft step at a time."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        """Forget everything after the first ``length`` positions (rejected drafts)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the cache slots ``indices`` ([n] for every row, or [B, n]), in that order.

        After a tree is verified this commits the accepted path: keep(arange(prefix) ++ accepted slots).
        """
        if self.k is None:
            return
        if indices.dim() == 1:
            self.k, self.v = self.k[:, :, indices], self.v[:, :, indices]
            return
        index = indices[:, None, :, None].expand(-1, self.k.shape[1], -1, self.k.shape[3])
        self.k, self.v = self.k.gather(2, index), self.v.gather(2, index)


def causal_mask(n: int, past: int, device: torch.device) -> torch.Tensor:
    """Bool [n, past + n]: new token i sees the whole cache and new tokens 0..i."""
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)


class Attention(nn.Module):
    """Llama GQA self-attention; ``in_features`` is 2H for EAGLE-3's (embedding, feature) input.

    ``arch["qkv_bias"]``: biases on q/k/v, not o (Qwen2's attention; vLLM's Llama layer with ``qkv_bias``).
    ``arch["qk_norm"]``: RMSNorm over each head's query and key before rotary (Qwen3's attention).
    Heads saved before these flags existed are plain Llama layers.
    """

    def __init__(self, arch: dict[str, Any], in_features: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            arch["num_attention_heads"],
            arch["num_key_value_heads"],
            arch["head_dim"],
        )
        qkv_bias = arch.get("qkv_bias", False)
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, arch["hidden_size"], bias=False)
        if arch.get("qk_norm", False):
            self.q_norm = RMSNorm(self.head_dim, arch["rms_norm_eps"])
            self.k_norm = RMSNorm(self.head_dim, arch["rms_norm_eps"])
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries and keys, and values, each [B, heads, n, head_dim]."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """SDPA over all given keys; ``mask`` is bool (True = attend) or additive float, broadcast to scores."""
        groups = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).flatten(2))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Causal over the cache and the new tokens unless ``mask`` ([B, 1, n, past + n]) says otherwise."""
        q, k, v = self.project(x, cos, sin)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if mask is None:
            mask = causal_mask(x.shape[1], past, x.device)
        return self.attend(q, k, v, mask)


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, arch: dict[str, Any]):
        super().__init__()
        hidden, inner = arch["hidden_size"], arch["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = ACT2FN[arch["hidden_act"]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer (with the family's attention options, see ``Attention``). EAGLE-1's only
    layer skips ``input_layernorm``: its input is ``fc``'s output, and vLLM replaces that norm by
    Identity (llama_eagle.py), so a trained norm would be dropped on export."""

    def __init__(self, arch: dict[str, Any], input_norm: bool = True):
        super().__init__()
        eps = arch["rms_norm_eps"]
        self.input_layernorm = RMSNorm(arch["hidden_size"], eps) if input_norm else nn.Identity()
        self.self_attn = Attention(arch, arch["hidden_size"])
        self.post_attention_layernorm = RMSNorm(arch["hidden_size"], eps)
        self.mlp = MLP(arch)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class ResBlock(nn.Module):
    """Medusa's block x + SiLU(Wx + b); W starts at zero (as in Medusa), so a fresh block only adds SiLU(b)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


def shift_left(x: torch.Tensor, k: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, i + k] at position i along dim 1; the last k positions are ``fill``."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat((x[:, k:], pad), dim=1)


def label_mask(batch: dict[str, torch.Tensor], offset: int) -> torch.Tensor:
    """Bool [B, S]: position i's prediction of token ``input_ids[i + offset]`` is trained.

    A label counts when it exists (i + offset < S), is not padding, and ``loss_mask`` is 1 at the
    label's own position (the data pipeline marks the tokens to learn, e.g. assistant replies).
    """
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    return shift_left(valid, offset, False)


def default_positions(batch_size: int, n: int, device: torch.device, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, device=device).expand(batch_size, n)


class DraftHead(nn.Module):
    """What every head shares: its JSON config, the borrowed target parts, build/save/load.

    Subclasses set ``head_type`` and ``defaults`` (the head options a user may set, from the head's
    options model in ``core.schema``, where their ranges live) and take the full config
    (``make_config``'s output) in ``__init__``.
    """

    head_type: str
    defaults: dict[str, Any]

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.config = config
        self.target: TargetParts | None = None

    @classmethod
    def make_config(cls, head_cfg: dict[str, Any], target_config: PretrainedConfig) -> dict[str, Any]:
        options = {k: v for k, v in head_cfg.items() if k != "type"}
        unknown = sorted(set(options) - set(cls.defaults))
        if unknown:
            raise ValueError(f"unknown {cls.head_type} head options {unknown}; known: {sorted(cls.defaults)}")
        return {
            "type": cls.head_type,
            "target": getattr(target_config, "_name_or_path", "") or None,
            "target_hidden_size": target_config.hidden_size,
            "vocab_size": target_config.vocab_size,
            **cls.defaults,
            **options,
            "arch": arch_from_target(target_config),
        }

    @classmethod
    def build(
        cls, head_cfg: dict[str, Any], target_model: nn.Module, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> DraftHead:
        """A fresh head for ``target_model``, on the target's device (fp32; the trainer picks precision).

        ``tokenizer``, the target's, is recorded as its hash in the config, so loading the head on a target
        with another tokenizer fails (``check_tokenizer``).
        """
        config = cls.make_config(head_cfg, target_model.config)
        if tokenizer is not None:
            config["tokenizer_hash"] = tokenizer_hash(tokenizer)
        head = cls(config)
        head.attach(target_model)
        return head.to(target_model.get_input_embeddings().weight.device)

    def attach(self, target_model: nn.Module) -> None:
        self.target = target_parts(target_model)

    def save_pretrained(self, out_dir: str | Path) -> None:
        save_head(self, self.config, out_dir)

    @classmethod
    def from_pretrained(
        cls,
        head_dir: str | Path,
        target_model: nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        allow_other_tokenizer: bool = False,
    ) -> DraftHead:
        """The saved head, checked against ``target_model`` (shapes) and, when given, its ``tokenizer``."""
        config = read_head_config(head_dir)
        check_compatible(config, target_model.config, cls.head_type)
        if tokenizer is not None:
            check_tokenizer(config, tokenizer_hash(tokenizer), head_dir, allow_other_tokenizer)
        head = cls(config)
        load_head_weights(head, head_dir, target_model.get_input_embeddings().weight.device)
        head.attach(target_model)
        return head
