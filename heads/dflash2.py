"""DFlash-2: the DFlash block drafter with a dynamic convolution around each sublayer and a candidate selector that
ranks each slot's top tokens given the token before it.

The layout is the one vLLM 0.32 serves as ``DFlash2DraftModel`` (``qwen3_dflash2.py``, launched as ``method:
dflash``), on top of the DFlash Qwen3 backbone of ``heads/block.py`` (the block [x_a, mask, ...] over the context
strictly before a; slot k >= 1 drafts the token at a + k):

- ``layers.{i}.attention_conv`` and ``layers.{i}.mlp_conv``: a two-sided grouped depthwise convolution of ``taps``
  taps along the block, around the attention and the MLP sublayer. Its kernel is ``base_kernel`` [2, taps, H] plus
  a per-slot, per-group delta that ``kernel_projection`` [2 * taps * H / group_size, H] reads from the sublayer's
  normed input; side 0 convolves that input, side 1 the sublayer's output with the same input's delta. Tap t reads
  the slot t earlier in the same block (never across a block start). The context's keys and values bypass it.
- ``candidate_selector``: slot k's candidates are the top ``selector_top_k`` tokens of its logits through the
  target's lm_head (the whole vocabulary), each scored by its logit plus a rank-r bilinear term
  sum_r predecessor_codebook[previous][r] * hidden_projection(slot)[r] * successor_codebook[candidate][r], with
  ``previous`` the anchor for slot 1 and the token slot k - 1 drafted after it. vLLM walks the chain greedily.

The loss is the public trainers' (speculators, SpecForge, NeMo; the authors published none): DFlash's soft
cross-entropy of every slot to the target's distribution plus ``selector_weight`` x the cross-entropy of the
selector over the slot's candidates to the target's greedy token, with the data's previous token (teacher
forcing) and the same position weights; a target token outside the candidates replaces the weakest one.
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError
from torch import nn
from transformers import PretrainedConfig

from headstart.core.settings import Count, Float
from headstart.heads.block import BlockDrafter
from headstart.heads.block_options import BlockOptions, only
from headstart.heads.head_config import DraftArch, HeadConfig, HeadSettings
from headstart.heads.layers import BlockLayer
from headstart.heads.registry import Drafting, HeadType


class Dflash2Options(BlockOptions):
    type: Literal["dflash2"] = "dflash2"
    # The whole vocabulary: the key stays in the options a run saves (null).
    draft_vocab_size: Annotated[
        None,
        only(
            None,
            "DFlash-2 picks its candidates over the target's whole vocabulary (vLLM's selector reads the target's "
            "lm_head and has no d2t)",
        ),
    ] = None
    conv_kernel_size: Count = 2  # taps of each sublayer's convolution (vLLM's dflash_config key; the public drafts' 2)
    conv_group_size: Count = 16  # channels sharing one kernel delta: must divide the hidden size
    selector_rank: Count = 256  # r of the selector's codebooks [V, r] and hidden_projection [r, H]
    selector_top_k: Annotated[int, Field(ge=2)] = 16  # candidates per slot, from the target lm_head's logits
    selector_weight: Annotated[Float, Field(ge=0)] = 1.0  # the selector's cross-entropy beside the block loss

    @model_validator(mode="after")
    def _kernel_within_the_block(self) -> Dflash2Options:
        # Tap t reads slot i - t of the same block: taps past the block read nothing, and past the whole layout
        # the convolution's shapes no longer line up (a RuntimeError mid-step, after the target has loaded).
        if self.conv_kernel_size > self.block_size:
            raise PydanticCustomError(
                "section_rule",
                "conv_kernel_size ({kernel}) must not exceed block_size ({block}): a tap reads an earlier slot of "
                "the same block",
                {"kernel": self.conv_kernel_size, "block": self.block_size},
            )
        return self


class GroupedConv(nn.Module):
    """The two-sided dynamic depthwise convolution around a sublayer (vLLM's ``DFlashGroupedConv``): tap t of slot i
    reads slot i - t of the same block with weight base_kernel[side, t] + the slot's delta for the channel's group.
    It starts as the identity (tap 0 = 1, no delta), so the head starts as a DFlash."""

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.base_kernel.data[:, 0] = 1
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved sublayer input, the output side's delta) of normed inputs ``x`` [B, n, H], blocks of
        ``block`` slots laid out one after another."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))  # [B, n, 2, taps, groups]
        return self.convolve(x, delta[:, :, 0], 0, block), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor, block: int) -> torch.Tensor:
        return self.convolve(y, delta, 1, block)

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int, block: int) -> torch.Tensor:
        base = self.base_kernel[side].unflatten(-1, (self.groups, -1))  # [taps, groups, group_size]
        kernel = (base + delta[..., None].to(base.dtype)).flatten(-2).to(x.dtype)  # [B, n, taps, H]
        slot = torch.arange(x.shape[1], device=x.device) % block
        out = kernel[:, :, 0] * x
        for tap in range(1, self.taps):
            earlier = F.pad(x[:, :-tap], (0, 0, tap, 0)) * (slot >= tap)[:, None]
            out = out + kernel[:, :, tap] * earlier
        return out


class DFlash2Layer(BlockLayer):
    """The backbone's layer with each sublayer's input and output convolved along the block (``GroupedConv``)."""

    def __init__(self, arch: DraftArch, taps: int, group_size: int):
        super().__init__(arch)
        self.attention_conv = GroupedConv(arch.hidden_size, taps, group_size)
        self.mlp_conv = GroupedConv(arch.hidden_size, taps, group_size)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: tuple[torch.Tensor, torch.Tensor],
        context_visible: torch.Tensor | None,
        causal: bool,
    ) -> torch.Tensor:
        block = x.shape[1] // (1 if context_visible is None else context_visible.shape[1])
        normed, delta = self.attention_conv.prepare(self.input_layernorm(x), block)
        attended = self.attend(normed, cos, sin, context_kv, context_visible, causal)
        x = x + self.attention_conv.finish(attended, delta, block)
        normed, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        return x + self.mlp_conv.finish(self.mlp(normed), delta, block)


class CandidateSelector(nn.Module):
    """The bilinear pair score of a candidate after a previous token, given the slot (vLLM's names)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def forward(self, hidden: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Pair scores [R, c] of ``candidates`` [R, c] after the tokens ``previous`` [R], slot outputs ``hidden``
        [R, H]."""
        query = self.predecessor_codebook[previous] * self.hidden_projection(
            hidden.to(self.hidden_projection.weight.dtype)
        )
        return torch.einsum("rd,rcd->rc", query, self.successor_codebook[candidates])


class DFlash2Head(BlockDrafter[Dflash2Options]):
    head_type = "dflash2"
    options_model = Dflash2Options
    shape_keys = (*BlockDrafter.shape_keys, "conv_kernel_size", "conv_group_size", "selector_rank")
    first_drafting_slot = 1  # DFlash's block: the newest token's slot drafts nothing

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig[Dflash2Options]:
        config = super().make_config(settings, target_config)
        options, hidden = config.options, config.arch.hidden_size
        if hidden % options.conv_group_size:
            raise ValueError(f"head.conv_group_size {options.conv_group_size} must divide the hidden size {hidden}")
        if options.selector_top_k > config.vocab_size:
            raise ValueError(
                f"head.selector_top_k {options.selector_top_k} exceeds the vocabulary ({config.vocab_size})"
            )
        return config

    def __init__(self, config: HeadConfig[Dflash2Options]):
        super().__init__(config)
        hidden, rank = config.arch.hidden_size, config.options.selector_rank
        self.candidate_selector = CandidateSelector(hidden, config.vocab_size, rank)

    def new_layer(self) -> DFlash2Layer:
        options = self.config.options
        return DFlash2Layer(self.config.arch, options.conv_kernel_size, options.conv_group_size)

    def candidates(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [..., k], token ids [..., k]) of the top ``selector_top_k`` tokens of slots with outputs
        ``hidden``, through the target's lm_head."""
        return self.draft_logits(hidden).topk(self.config.options.selector_top_k, dim=-1)

    def walk_logits(self, hidden: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits [P, V] of the slot after each parent token [P]: its candidates' logits plus their
        pair scores after the parent, -inf off the candidates."""
        unary, candidates = self.candidates(hidden)
        rows = candidates.expand(len(parents), -1)
        scores = unary + self.candidate_selector(hidden.expand(len(parents), -1), parents, rows)
        out = scores.new_full((len(parents), self.config.vocab_size), float("-inf"))
        return out.scatter(1, rows, scores)

    def slot_terms(
        self,
        batch: dict[str, torch.Tensor],
        states: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """DFlash's per-slot terms (``DFlashHead.slot_terms``), the selector's in them: ``auxiliary`` is
        ``selector_weight`` x the selector's cross-entropy over the slot's top-k candidates, scored after the data's
        previous token (the anchor for slot 1), to the target's greedy token, which replaces the weakest candidate
        where it is not one (the loss only); ``hit`` and ``confidence`` (D-PACE's) are the selector's choice and
        its probability of the target's token, what the walk drafts when the slots before were right. Metrics:
        ``selector_ce`` and ``candidate_recall`` (the target's token among the candidates)."""
        options = self.config.options
        logits = self.draft_logits(states)
        target_probs = self.target_probs(batch, sample, positions)
        gold = greedy[:, None]  # the whole vocabulary: target ids
        unary, candidates = logits.topk(options.selector_top_k, dim=-1)
        previous = batch["input_ids"][sample, positions - 1]
        pair = self.candidate_selector(states, previous, torch.cat((candidates, gold), -1))
        scores = torch.cat((unary, logits.gather(1, gold)), -1) + pair  # [R, k + 1]: the candidates, then the gold
        found = candidates == gold
        recalled, place = found.any(-1), found.long().argmax(-1)  # the gold's place among the candidates, if there
        # The k-way choice with the gold in the last place where it is missing.
        choice = torch.where(recalled[:, None], scores[:, :-1], torch.cat((scores[:, :-2], scores[:, -1:]), -1))
        label = torch.where(recalled, place, options.selector_top_k - 1)
        selector_ce = F.cross_entropy(choice.float(), label, reduction="none")
        terms = self.distribution_terms(batch, logits, sample, positions, target_probs)
        with torch.no_grad():
            walk = scores[:, :-1].float().softmax(-1)
            hit = found.gather(1, walk.argmax(-1, keepdim=True))[:, 0]
            confidence = walk.gather(1, place[:, None])[:, 0] * recalled
        return terms | {
            "divergence": terms["soft_ce"],
            "auxiliary": options.selector_weight * selector_ce,
            "hit": hit,
            "confidence": confidence,
            "selector_ce": selector_ce.detach(),
            "candidate_recall": recalled.float(),
        }


HEAD_TYPE = HeadType(
    name="dflash2",
    head=DFlash2Head,
    trainer="eagle",
    fuses_layers=True,
    drafting=Drafting("dflash2", "DFlash-2"),
)
