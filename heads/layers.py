"""The Llama building blocks of the draft layers: RMSNorm, rotary embeddings, GQA attention over a KV cache,
SwiGLU MLP, the EAGLE heads' decoder layer and the block drafters' (``BlockLayer``: attention over the block and
the context's keys and values), each sized by the head's ``DraftArch``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from headstart.heads.head_config import DraftArch
from headstart.heads.sparse_attention import block_attention, ttt_attention


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


def rope_config(arch: DraftArch) -> LlamaConfig:
    """The draft layer's rotary settings as transformers' RoPE functions read them."""
    return LlamaConfig(
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=arch.max_position_embeddings,
        rope_parameters=dict(arch.rope),
    )


def rope_parameters(config: LlamaConfig, kind: str, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention scaling) of the target's rotary type ``kind`` (the config's
    ``rope_type``), by transformers' own functions (``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, longrope,
    llama3; Llama's for the default).

    ``seq_len`` matters to the types whose frequencies follow the sequence length (dynamic, longrope).
    """
    if kind == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    elif kind in ROPE_INIT_FUNCTIONS:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    else:
        raise NotImplementedError(
            f"rotary embedding type {kind!r} is not supported by the draft heads "
            f"(default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))} are)"
        )
    if 2 * inv_freq.numel() != config.head_dim:
        raise NotImplementedError(
            f"the target rotates {2 * inv_freq.numel()} of each head's {config.head_dim} dims (partial rotary); "
            "the draft heads rotate the whole head"
        )
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """cos/sin of the target's rotary type, scaled by its attention factor (yarn, longrope), as transformers'
    own rotary embedding computes them. Dynamic NTK and longrope switch to other frequencies for sequences
    past the pretraining length, the sequence being as long as the largest position asked for, plus one."""

    def __init__(self, arch: DraftArch):
        super().__init__()
        self.config = rope_config(arch)
        self.kind = arch.rope["rope_type"]
        # Plain attributes, not buffers: ``head.to(bf16)`` must not round the frequencies.
        self.inv_freq, self.attention_scaling = rope_parameters(self.config, self.kind)
        # Sequences longer than this get other frequencies (None: every length gets the same ones).
        self.short_len = {
            "dynamic": arch.max_position_embeddings,
            "longrope": arch.rope.get("original_max_position_embeddings"),
        }.get(self.kind)
        self.long: tuple[int, torch.Tensor] | None = None  # (sequence length, frequencies), the last used

    def frequencies(self, position_ids: torch.Tensor) -> torch.Tensor:
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        if self.short_len is None:
            return self.inv_freq
        seq_len = int(position_ids.max()) + 1
        if seq_len <= self.short_len:
            return self.inv_freq
        if self.kind == "longrope":
            seq_len = self.short_len + 1  # one long set for every length past the pretraining one
        if self.long is None or self.long[0] != seq_len:
            self.long = (seq_len, rope_parameters(self.config, self.kind, seq_len)[0].to(position_ids.device))
        return self.long[1]

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [B, n, head_dim] for ``position_ids`` [B, n] (angles computed in fp32)."""
        freqs = position_ids.float()[..., None] * self.frequencies(position_ids)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, heads, n, d] by cos/sin [B, n, d] (the half-split layout HF Llama checkpoints use)."""
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """The draft layer's keys and values for drafting, [B, kv_heads, length, head_dim].

    Kept in buffers allocated on the first append and doubled when a sequence outgrows them (as gpt-fast
    does), so a draft step writes its new keys in place instead of copying the whole cache; ``crop`` only
    moves the length. In-place writes would break autograd, so training-time test uses ``StepKVCache``.
    """

    def __init__(self, min_capacity: int = 256):
        self.min_capacity = min_capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    @property
    def k(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def v(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    def _reserve(self, k: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers holding at least ``length`` positions of keys shaped like ``k``, the cached ones copied over."""
        if self._k is not None and self._v is not None and length <= self._k.shape[2]:
            return self._k, self._v
        capacity = max(length, self.min_capacity, 2 * (0 if self._k is None else self._k.shape[2]))
        b, heads, _, dim = k.shape
        new_k, new_v = k.new_empty(b, heads, capacity, dim), k.new_empty(b, heads, capacity, dim)
        if self._k is not None and self._v is not None:
            new_k[:, :, : self.length], new_v[:, :, : self.length] = (
                self._k[:, :, : self.length],
                self._v[:, :, : self.length],
            )
        self._k, self._v = new_k, new_v
        return new_k, new_v

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new positions' keys and values; return all cached ones."""
        end = self.length + k.shape[2]
        keys, values = self._reserve(k, end)
        keys[:, :, self.length : end], values[:, :, self.length : end] = k, v
        self.length = end
        return keys[:, :, :end], values[:, :, :end]

    def crop(self, length: int) -> None:
        """Forget everything after the first ``length`` positions (rejected drafts)."""
        if length < 0:
            raise ValueError(f"cannot crop the draft cache to a negative length ({length})")
        self.length = min(self.length, length)

    def keep(self, indices: torch.Tensor) -> None:
        """Keep only the cache slots ``indices`` ([n] for every row, or [B, n]), in that order.

        After a tree is verified this commits the accepted path: keep(arange(prefix) ++ accepted slots).
        """
        if self._k is None or self._v is None:
            return
        cached_k, cached_v = self._k[:, :, : self.length], self._v[:, :, : self.length]
        if indices.dim() == 1:
            k, v = cached_k[:, :, indices], cached_v[:, :, indices]
        else:
            index = indices[:, None, :, None].expand(-1, self._k.shape[1], -1, self._k.shape[3])
            k, v = cached_k.gather(2, index), cached_v.gather(2, index)
        self.length = 0
        self.append(k, v)


class StepKVCache:
    """Training-time test's keys and values, one [B, kv_heads, S, head_dim] pair per step, kept in the autograd
    graph (never written in place): step j's queries see step 0's keys causally and their own key of each step
    1..j (``heads.sparse_attention.ttt_attention``; the dense form is ``ttt_step_mask`` there)."""

    def __init__(
        self,
        keys: list[torch.Tensor] | None = None,
        values: list[torch.Tensor] | None = None,
        segments: torch.Tensor | None = None,
        fused: bool = False,
    ) -> None:
        self.keys: list[torch.Tensor] = list(keys or [])  # the earlier steps' (a copy: appending leaves them be)
        self.values: list[torch.Tensor] = list(values or [])
        self.segments = segments  # [B, S] sample of each position in a packed row: none sees another's
        self.fused = fused  # ttt_attention_fused: the device's fused kernel (train.attention: fused)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Add this step's keys and values; its queries' attention output [B, heads, S, head_dim]."""
        self.keys.append(k)
        self.values.append(v)
        return ttt_attention(q, self.keys, self.values, segments=self.segments, fused=self.fused)


def default_positions(input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """Positions [B, n] of ``input_ids`` continuing ``cache``: its length onwards (0 onwards without one)."""
    start = 0 if cache is None else cache.length
    batch, n = input_ids.shape
    return torch.arange(start, start + n, device=input_ids.device).expand(batch, n)


def causal_mask(n: int, past: int, device: torch.device) -> torch.Tensor:
    """Bool [n, past + n]: new token i sees the whole cache and new tokens 0..i."""
    return torch.ones(n, past + n, dtype=torch.bool, device=device).tril(diagonal=past)


class Attention(nn.Module):
    """Llama GQA self-attention; ``in_features`` is 2H for EAGLE-3's (embedding, feature) input.

    ``arch.qkv_bias``: biases on q/k/v, not o (Qwen2's attention; vLLM's Llama layer with ``qkv_bias``).
    ``arch.qk_norm``: RMSNorm over each head's query and key before rotary (Qwen3's attention).
    """

    def __init__(self, arch: DraftArch, in_features: int):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.q_proj = nn.Linear(in_features, self.n_heads * self.head_dim, bias=arch.qkv_bias)
        self.k_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=arch.qkv_bias)
        self.v_proj = nn.Linear(in_features, self.n_kv * self.head_dim, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, arch.hidden_size, bias=False)
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | StepKVCache | None = None,
    ) -> torch.Tensor:
        """Attend from ``x``'s tokens over the cache and themselves; the new keys are added to ``cache`` (a
        ``StepKVCache``: training-time test's sparse pattern, ``mask`` unused).

        ``mask`` (bool, True = attend, or additive float; broadcast to [B, heads, n, past + n]) defaults to causal.
        """
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if isinstance(cache, StepKVCache):
            return self.o_proj(cache.attend(q, k, v).transpose(1, 2).flatten(2))
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if mask is None:
            mask = causal_mask(n, past, x.device)
        elif mask.is_floating_point():
            mask = mask.to(q.dtype)
        # enable_gqa: each key/value head serves its group of query heads without a repeated copy of the cache.
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class MLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x))."""

    def __init__(self, arch: DraftArch):
        super().__init__()
        hidden, inner = arch.hidden_size, arch.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = ACT2FN[arch.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer (with the family's attention options, see ``Attention``). EAGLE-1's only
    layer skips ``input_layernorm``: its input is ``fc``'s output, and vLLM replaces that norm by
    Identity (llama_eagle.py), so a trained norm would be dropped on export."""

    def __init__(self, arch: DraftArch, input_norm: bool = True):
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps) if input_norm else nn.Identity()
        self.self_attn = Attention(arch, arch.hidden_size)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
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


class BlockLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the context's keys and values."""

    def __init__(self, arch: DraftArch):
        super().__init__()
        hidden, eps = arch.hidden_size, arch.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(arch, hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = MLP(arch)

    def key_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, then rotary) and values [B, kv_heads, n, head_dim] of the inputs ``x`` [B, n, H]."""
        attn = self.self_attn
        b, n, _ = x.shape
        k = attn.k_norm(attn.k_proj(x).view(b, n, attn.n_kv, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(b, n, attn.n_kv, attn.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def attend(
        self,
        normed: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        context_visible: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        """The attention sublayer's output (after o_proj) for its normed inputs [B, n, H]: ``block_attention``."""
        attn = self.self_attn
        b, n, _ = normed.shape
        q = attn.q_norm(attn.q_proj(normed).view(b, n, attn.n_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rotary(q, cos, sin)
        k, v = self.key_values(normed, cos, sin)
        out = block_attention(q, k, v, *context_kv, context_visible, causal)
        return attn.o_proj(out.transpose(1, 2).flatten(2))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        context_visible: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        x = x + self.attend(self.input_layernorm(x), cos, sin, context_kv, context_visible, causal)
        return x + self.mlp(self.post_attention_layernorm(x))
