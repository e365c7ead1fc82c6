"""Memory up front: what one rank of capture, training or evaluation needs, from the configs alone, checked
against what its device has before a single weight is loaded.

Like the storage estimate of a capture, the point is to refuse in the first second, with the numbers, rather
than after an hour of loading: a 70B target (141 GB in bf16) on one 80 GB GPU, or a CPU rank without room for
its share. Every figure is counted from the target's and the head's module trees built on the meta device
(parameters exactly) and from the run's batch settings (activations, an estimate: the formulas are below and
in docs/TRAINING.md, "Memory per rank"; ``scripts/bench/scale.py`` measures them against the peak).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from headstart.core.runtime import env_count
from headstart.core.weights import borrowed_names, meta_model

SCORE_BUDGET = 1 << 24  # elements one chunk of attention scores or loss logits holds on a CPU (heads.sparse_attention)
# On a GPU chunks 16x larger (2^28 fp32 scores, 1 GiB): a GPU runs a CPU-sized chunk in microseconds, so launching
# its kernels would bound the step (measured on an H200: docs/BENCHMARKS.md, "Training memory against the sample
# length"), while the chunk stays a small part of its memory.
GPU_SCORE_SCALE = 16

GB = 1e9


def score_budget(device: torch.device | str) -> int:
    """The elements one chunk of scores or logits holds on ``device``: ``SCORE_BUDGET``, times ``GPU_SCORE_SCALE``
    on an accelerator (read at the call, so that tests can shrink it)."""
    return SCORE_BUDGET * (1 if torch.device(device).type == "cpu" else GPU_SCORE_SCALE)


class InsufficientMemoryError(MemoryError):
    """A rank's device cannot hold what the stage needs; the message lists every part and the device's room."""


@dataclass
class MemoryNeed:
    """Bytes one rank needs, part by part, for ``stage`` (capture, training, evaluation)."""

    stage: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        parts = " + ".join(f"{name} {size / GB:.2f} GB" for name, size in self.parts.items() if size)
        return f"{self.stage} needs per rank: {parts} = {self.total / GB:.2f} GB"


@dataclass(frozen=True)
class TargetSizes:
    """Parameter counts of a target, from its config alone: all of them, and those a head borrows."""

    parameters: int
    borrowed: int  # embedding, final norm, lm_head (once when tied)
    config: PretrainedConfig

    @classmethod
    def of(cls, config: PretrainedConfig) -> TargetSizes:
        model = meta_model(config)
        borrowed = {id(model.get_parameter(name)): model.get_parameter(name) for name in borrowed_names(model).values()}
        return cls(_count(model), sum(p.numel() for p in borrowed.values()), config)

    def target_share(self, dtype: torch.dtype, tp_size: int) -> int:
        """This rank's slice of the whole target (transformers splits every matrix, embedding and lm_head too)."""
        return self.parameters * dtype.itemsize // tp_size

    def borrowed_bytes(self, dtype: torch.dtype) -> int:
        return self.borrowed * dtype.itemsize


def head_training_parts(head: nn.Module, zero_stage: int, world: int, bf16: bool) -> dict[str, int]:
    """A head's trained weights, gradients and AdamW state under ZeRO (``head`` built on the meta device).

    fp32 weights (the master copy), fp32 gradients (split across ranks from ZeRO-2), two fp32 moments (split from
    ZeRO-1); bf16 training adds the bf16 working copy.
    """
    n = _count(head, trainable=True)
    frozen = _count(head) - n
    return {
        "head": 4 * n + 4 * frozen + (2 * n if bf16 else 0),
        "gradients": 4 * n // (world if zero_stage >= 2 else 1),
        "optimizer": 8 * n // (world if zero_stage >= 1 else 1),
    }


def capture_activations(
    config: PretrainedConfig, batch_tokens: int, max_length: int, n_aux: int, dtype: torch.dtype, tp_size: int
) -> int:
    """One capture batch of ``batch_tokens`` tokens through the decoder: per token the residual stream and its
    temporaries (8 x hidden), the kept layers (n_aux x hidden) and this rank's MLP slice (3 x intermediate / tp);
    per sequence one attention score per head (this rank's) and key pair, the CPU kernel's worst case."""
    text = config.get_text_config()
    per_token = (8 + n_aux) * text.hidden_size + 3 * text.intermediate_size // tp_size
    scores = batch_tokens * min(max_length, batch_tokens) * (text.num_attention_heads // tp_size)
    return (batch_tokens * per_token + scores) * dtype.itemsize


def head_activations(
    config: PretrainedConfig,
    tokens: int,
    n_aux: int,
    depth: int,
    draft_vocab: int | None,
    dtype: torch.dtype,
    recompute: bool = False,
    device: torch.device | str = "cpu",
) -> int:
    """One training micro-batch of ``tokens`` tokens through a head: the states it reads ((n_aux + 1) x hidden),
    per drafted depth what the step keeps for backward, 48 x hidden values (24 x hidden where the steps are
    recomputed in backward, plus 16 x hidden once for the step being rebuilt: measured, docs/BENCHMARKS.md, "Training
    memory against the sample length"), all in ``dtype``, and the chunks of the sparse attention and of the losses'
    logits over the whole and the draft vocabulary, each bounded by ``score_budget(device)`` elements (fp32, with
    their softmax and gradient: 3x). Linear in the length; the vocabulary only counts below one chunk."""
    text = config.get_text_config()
    vocab = text.vocab_size + (draft_vocab or text.vocab_size)
    inputs = (n_aux + 1) * text.hidden_size * dtype.itemsize
    kept = 24 if recompute else 48
    per_token = inputs + (depth * kept + (16 if recompute else 0)) * text.hidden_size * dtype.itemsize
    budget = score_budget(device)
    chunks = 3 * 4 * (min(tokens * vocab, budget) + budget)
    return tokens * per_token + chunks


# Layer types whose cache is a fixed-size recurrent state, not keys and values growing with the context.
RECURRENT_LAYER_TYPES = ("linear_attention", "mamba")


def kv_cache_bytes(config: PretrainedConfig, tokens: int, dtype: torch.dtype, tp_size: int) -> int:
    """Keys and values of ``tokens`` positions in every attention layer (a hybrid's linear-attention and Mamba
    layers keep a fixed state instead), this rank's heads only. transformers' MLA (DeepSeek-V2/V3) caches one
    compressed latent per position, kv_lora_rank + qk_rope_head_dim values, shared by every head (whole on each
    rank)."""
    text = config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ["attention"] * text.num_hidden_layers
    layers = sum(kind not in RECURRENT_LAYER_TYPES for kind in kinds)
    if getattr(text, "kv_lora_rank", None):
        return layers * (text.kv_lora_rank + text.qk_rope_head_dim) * tokens * dtype.itemsize
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * layers * kv_heads // tp_size * head_dim * tokens * dtype.itemsize


def decoding_memory(
    config: PretrainedConfig, dtype: torch.dtype, tp_size: int, drafters: int, context_tokens: int
) -> MemoryNeed:
    """One rank of a decoding command: its target share, the drafters (``drafters`` bytes: heads, a draft
    model), with a split target the whole embedding and lm_head the heads draft with, and the KV cache of the
    longest context (a tree's worth of nodes included)."""
    sizes = TargetSizes.of(config)
    return MemoryNeed(
        "evaluation",
        {
            "target share": sizes.target_share(dtype, tp_size),
            "whole borrowed tensors": sizes.borrowed_bytes(dtype) if tp_size > 1 and drafters else 0,
            "drafters": drafters,
            "KV cache": kv_cache_bytes(config, context_tokens, dtype, tp_size),
        },
    )


def device_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this rank may use, and where that figure comes from: the GPU's free memory, or the CPU's available
    memory shared by the ranks torchrun started on this node."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)} ({device})"
    ranks = env_count("LOCAL_WORLD_SIZE", 1)
    available = _meminfo_available()
    share = f", shared by {ranks} ranks on this node" if ranks > 1 else ""
    return available // ranks, f"available of this machine's memory (MemAvailable{share})"


def check_memory(need: MemoryNeed, device: torch.device, remedy: str) -> str:
    """The one line saying what ``need`` takes of ``device``; InsufficientMemoryError with every part when it does
    not fit (``remedy``: what this stage's user can change)."""
    room, where = device_memory(device)
    line = f"{need.describe()}; {room / GB:.2f} GB {where}"
    if need.total > room:
        raise InsufficientMemoryError(f"{line}: it does not fit; {remedy}")
    return line


def _count(module: nn.Module, trainable: bool = False) -> int:
    unique = {id(p): p for p in module.parameters() if p.requires_grad or not trainable}
    return sum(p.numel() for p in unique.values())


def _meminfo_available() -> int:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
