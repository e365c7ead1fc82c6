"""Domino: the DFlash block drafter plus a causal correction head, a GRU over the block's earlier tokens whose state
shifts each draft's logits (Domino, arXiv 2605.29707).

The backbone is DFlash's (``heads/block.py``: the block [x_a, mask, ...] over the context strictly before a), and
so is its layout: a DFlash draft whose ``dflash_config.projector_type`` is ``domino``, with its own tensors beside the
backbone's, as the Domino-capable vLLM code reads it (``DominoHead``, a pull request after 0.32, not in a vLLM release;
docs/EXPORT.md, "Domino").

The block, as the public drafts set it (``shift_label: true``, ``pure_draft_prefix_len: 1``): the anchor's slot
drafts the token at a + 1 and slot k the one at a + k + 1; k drafts come from a block of k + 1 slots, as vLLM and
SGLang serve it, so the last slot drafts nothing served (``spare_slots``): training scores it only with
``train_last_slot``, as the public trainers do. With ``shift_label: false`` it is
DFlash's block, slot k >= 1 drafting the token at a + k. Either way the block's draft j (the token at a + 1 + j)
is corrected when j >= ``pure_draft_prefix_len``, and drafted from the backbone's logits alone before that.

- ``prefix_gru``: a one-layer GRU without biases, input the target's embedding [H] of each token, state
  [``gru_hidden_dim``]. It starts from zeros at the block's first token (the newest committed one) and reads the
  block's tokens in order: draft j's state has read the tokens at a .. a + j (the data's in training, the drafted
  ones when drafting), what the parallel slots cannot see of each other.
- ``embed_proj``: Linear [H + gru_hidden_dim -> ``emb_dim``], SiLU, Linear [emb_dim -> V], no biases, on
  [the slot's normed output, its GRU state]: a correction added to the slot's logits through the target's lm_head.
  Both layers start as the public trainers' do, normal with std 0.02.

The loss is the public trainers' (SpecForge, Model-Optimizer, NeMo), with DFlash's soft cross-entropy to the target's
distribution in place of their hard labels: (1 - lambda) x that of the corrected logits + lambda x that of the
backbone's own, with lambda falling linearly from ``lambda_base_start`` to 0 over the first ``lambda_base_decay``
of training (their base-anchored curriculum: the parallel backbone learns first, then the correction). An
uncorrected draft's two terms are both the backbone's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError
from torch import nn

from headstart.core.settings import Count, Float
from headstart.heads.block import BlockDrafter
from headstart.heads.block_options import BlockOptions, only
from headstart.heads.head_config import HeadConfig
from headstart.heads.losses import soft_cross_entropy
from headstart.heads.registry import Drafting, HeadType

CORRECTION_INIT_STD = 0.02  # the correction layers' initial weights, as the public drafts' trainers draw them


class DominoOptions(BlockOptions):
    type: Literal["domino"] = "domino"
    # The whole vocabulary: the key stays in the options a run saves (null).
    draft_vocab_size: Annotated[
        None,
        only(None, "Domino's correction covers the target's whole vocabulary (vLLM's embed_proj has V rows, no d2t)"),
    ] = None
    gru_hidden_dim: Count = 1024  # the GRU's state (the public drafts': 1024)
    emb_dim: Count = 256  # the correction's bottleneck (the public drafts': 256)
    lambda_base_start: Annotated[Float, Field(ge=0, le=1)] = 1.0  # the backbone's own loss share at step 0
    lambda_base_decay: Annotated[Float, Field(gt=0, le=1)] = 1.0  # the share of training over which it falls to 0
    # vLLM's dflash_config keys, the public drafts' values. shift_label: the anchor's slot drafts the next token and
    # slot k the token after its own position (false: DFlash's block, slot k drafting the token at its position).
    # pure_draft_prefix_len: how many first drafts take the backbone's logits alone. Heads saved before these keys
    # trained false and 0 (DFlash's block, every draft corrected).
    shift_label: bool = True
    pure_draft_prefix_len: Annotated[int, Field(ge=0)] = 1
    # Training scores the shifted block's last slot too (the token after the served chain), as the public trainers
    # do: off, as it lowers GSM8K tau here (0.985x over two seeds; docs/BENCHMARKS.md, "Domino against DFlash-2").
    train_last_slot: bool = False
    saved_before: ClassVar[dict[str, Any]] = {"shift_label": False, "pure_draft_prefix_len": 0}

    @model_validator(mode="after")
    def _a_corrected_draft(self) -> DominoOptions:
        if self.pure_draft_prefix_len >= self.trained_depth():
            raise PydanticCustomError(
                "domino_prefix",
                "pure_draft_prefix_len {p} leaves none of the block's {k} drafts corrected: it must be below {k}",
                {"p": self.pure_draft_prefix_len, "k": self.trained_depth()},
            )
        return self

    @model_validator(mode="after")
    def _a_last_slot_to_train(self) -> DominoOptions:
        if self.train_last_slot and not self.shift_label:
            raise PydanticCustomError(
                "domino_last_slot",
                "train_last_slot needs shift_label: true (DFlash's block has no slot past the served drafts to train)",
            )
        return self


class DominoHead(BlockDrafter[DominoOptions]):
    head_type = "domino"
    options_model = DominoOptions
    shape_keys = (*BlockDrafter.shape_keys, "gru_hidden_dim", "emb_dim")
    # The correction learns with AdamW while Muon trains the backbone: with Muon on the GRU and the bottleneck too,
    # it barely moves the loss in 160 steps (docs/BENCHMARKS.md, "Domino against DFlash-2").
    adamw_under_muon = ("prefix_gru", "embed_proj")

    def __init__(self, config: HeadConfig[DominoOptions]):
        super().__init__(config)
        hidden, options = config.arch.hidden_size, config.options
        # Shifted labels: the anchor's slot drafts, and k drafts come from a block of k + 1 slots, as vLLM and
        # SGLang serve it (the last slot drafts the token no served chain reaches). Else DFlash's block.
        self.first_drafting_slot, self.spare_slots = (0, 1) if options.shift_label else (1, 0)
        self.trains_spare_slots = options.train_last_slot
        self.prefix_gru = nn.GRU(hidden, options.gru_hidden_dim, batch_first=True, bias=False)
        bottleneck = nn.Linear(hidden + options.gru_hidden_dim, options.emb_dim, bias=False)
        correction = nn.Linear(options.emb_dim, config.vocab_size, bias=False)
        # The public trainers' initialisation (SpecForge, Model-Optimizer): small and random, not zero; a zero last
        # layer leaves the GRU and the bottleneck without a gradient until it has grown.
        for layer in (bottleneck, correction):
            nn.init.normal_(layer.weight, std=CORRECTION_INIT_STD)
        self.embed_proj = nn.Sequential(bottleneck, nn.SiLU(), correction)

    def lambda_base(self) -> float:
        """The backbone's own loss share at this point of training (``training_progress``)."""
        options = self.config.options
        return options.lambda_base_start * max(0.0, 1.0 - self.training_progress / options.lambda_base_decay)

    def prefix_states(self, previous: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        """GRU states [.., n, G] after each of the tokens ``previous`` [.., n] in turn, from ``state`` [.., G]
        (None: the block's start, zeros)."""
        embeds = self.embed(previous)  # the head's dtype, its GRU's
        rows = embeds.flatten(0, -3) if embeds.dim() > 2 else embeds[None]
        initial = None if state is None else state.reshape(1, len(rows), -1).to(embeds.dtype)
        out, _ = self.prefix_gru(rows, initial)
        return out.view(*previous.shape, -1)

    def draft_logits_at(self, index: int, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits [.., V] of the block's draft ``index`` (0: the first), from its normed output ``hidden``
        and GRU state ``state``: the backbone's alone for the first ``pure_draft_prefix_len``, else corrected."""
        if index < self.config.options.pure_draft_prefix_len:
            return self.logits(hidden)
        return self.corrected_logits(hidden, state)

    def corrected_logits(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits [.., V] of slots with normed outputs ``hidden`` [.., H] and GRU states ``state``
        [.., G]: the backbone's through the target's lm_head plus the correction."""
        return self.logits(hidden) + self.correction(hidden, state)

    def correction(self, hidden: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The shift [.., V] that ``embed_proj`` adds to the backbone's logits of the same slots."""
        shift = self.embed_proj(torch.cat((hidden, state.to(hidden.dtype)), -1).to(self.fc.weight.dtype))
        return shift.to(hidden.dtype)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``BlockDrafter.loss`` with each drafting slot's teacher-forced GRU state beside its output, and whether
        its logits are corrected: the block's draft j (the token at a + 1 + j) has read the data's tokens at a .. a + j
        (``slot_terms`` splits them again)."""
        slots = self.block_states(batch)
        ids, label_at = batch["input_ids"], slots.label_at
        previous = ids.gather(1, (label_at - 1).clamp(max=ids.shape[1] - 1).flatten(1)).view_as(label_at)
        states = self.prefix_states(previous)  # a slot past the sample's end reads garbage, never scored
        drafts = torch.arange(label_at.shape[-1], device=label_at.device)
        corrected = (drafts >= self.config.options.pure_draft_prefix_len).expand_as(label_at)[..., None]
        extra = torch.cat((states, corrected), -1).to(slots.hidden.dtype)
        return self.block_loss(batch, slots._replace(hidden=torch.cat((slots.hidden, extra), -1)))

    def slot_terms(
        self,
        batch: dict[str, torch.Tensor],
        states: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """``divergence``: (1 - lambda) x the soft cross-entropy of the corrected logits to the target's distribution,
        and ``auxiliary``: lambda x that of the backbone's (``lambda_base``); with ``loss: lk`` the corrected logits'
        LK term replaces the first. ``hit`` and ``confidence`` (D-PACE's) are the corrected logits', what drafting
        draws from when the slots before were right. Metrics: ``final_ce``, ``base_ce``, ``base_hit`` (the
        backbone's argmax is the target's greedy token)."""
        sizes = (self.config.arch.hidden_size, self.config.options.gru_hidden_dim, 1)
        hidden, prefix, corrected = states.split(sizes, -1)
        target_probs = self.target_probs(batch, sample, positions)
        base = self.draft_logits(hidden)
        final = torch.where(corrected.bool(), base + self.correction(hidden, prefix), base)  # one lm_head pass
        terms = self.distribution_terms(batch, final, sample, positions, target_probs)
        base_ce = soft_cross_entropy(base, target_probs)
        share = self.lambda_base()
        return terms | {
            "divergence": (1 - share) * terms["soft_ce"],
            "auxiliary": share * base_ce,
            "hit": self.greedy_hits(final, greedy),
            "confidence": self.draft_confidence(final.float().log_softmax(-1).detach(), greedy),
            "final_ce": terms["soft_ce"].detach(),
            "base_ce": base_ce.detach(),
            "base_hit": self.greedy_hits(base, greedy).float(),
        }


HEAD_TYPE = HeadType(
    name="domino",
    head=DominoHead,
    trainer="eagle",
    fuses_layers=True,
    drafting=Drafting("domino", "Domino"),
)
