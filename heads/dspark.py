"""DSpark: a block drafter whose anchor slot drafts too, plus a Markov head and a confidence head
(DeepSeek's DeepSpec, arXiv 2607.05147).

The layout is the one vLLM 0.32 serves as ``method: dspark`` (``qwen3_dspark.py``, architecture
``Qwen3DSparkModel``, on top of the DFlash Qwen3 backbone of ``heads/block.py``):

- The block at anchor a is [x_a, mask, ..., mask] at positions a .. a + B - 1 over the context strictly before a,
  bidirectional, and every slot drafts: slot k the token at a + k + 1 (vLLM's ``sample_from_anchor``). B slots
  draft B tokens; vLLM serves ``num_speculative_tokens`` = B.
- ``markov_head``: a low-rank transition bias from the previous token, added to slot k's logits left to right,
  markov_w2(markov_w1[x_{k-1}]) with ``markov_w1`` [V, r] (an embedding of the target's vocabulary) and
  ``markov_w2`` [V_draft, r]; the previous token of slot 0 is the anchor, of slot k the token slot k - 1 drafted.
  The backbone drafts every slot at once; the bias gives the draft its dependence inside the block.
- ``confidence_head.proj`` [1, H + r] with a bias: sigmoid of slot k's output and the Markov embedding of its
  previous token, the chance the target accepts slot k's token given that it accepted the ones before; the
  product along a draft estimates that it survives, which decides where to stop drafting.

The loss is DeepSpec's (``loss``): 0.1 x cross-entropy to the data's next tokens + 0.9 x the L1 distance of the
draft's distribution to the target's + 1.0 x the confidence head's binary cross-entropy to the acceptance
rate 1 - TV(draft, target), with the previous tokens teacher-forced from the data and slot k weighted
exp(-k / loss_gamma) (or by D-PACE).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from headstart.core.settings import Count, Float, Positive
from headstart.heads.block import BlockDrafter
from headstart.heads.block_options import BlockOptions, only
from headstart.heads.block_training import slot_losses, weighted_slot_loss
from headstart.heads.head_config import HeadConfig
from headstart.heads.losses import chain_metrics
from headstart.heads.registry import Drafting, HeadType

Weight = Annotated[Float, Field(ge=0)]


class DsparkOptions(BlockOptions):
    type: Literal["dspark"] = "dspark"
    block_size: Annotated[int, Field(ge=2)] = 7  # slots = drafted tokens: the anchor + 6 masks (DeepSpec's)
    # The mask slots hold the embedding row of mask_token_id; the key stays in every saved config (false).
    mask_embedding: Annotated[
        Literal[False],
        only(False, "vLLM's DSpark ignores a learned mask vector (it masks with the embedding row of mask_token_id)"),
    ] = False
    loss_gamma: Positive = 4.0  # slot k's (k = 0..) loss weight exp(-k / 4), DeepSpec's
    markov_rank: Count = 256  # r of the Markov head's markov_w1 [V, r] and markov_w2 [V_draft, r]
    confidence_head: bool = True  # the acceptance estimate that stops a draft (eval --min-confidence)
    ce_weight: Weight = 0.1  # cross-entropy to the data's next token (DeepSpec's ce_loss_alpha)
    tv_weight: Weight = 0.9  # L1 distance of the draft's distribution to the target's (l1_loss_alpha)
    confidence_weight: Weight = 1.0  # the confidence head's binary cross-entropy (confidence_head_alpha)

    def trained_depth(self) -> int:
        return self.block_size  # every slot drafts, the anchor's too


class MarkovHead(nn.Module):
    """The transition bias markov_w2(markov_w1[previous token]) over the draft vocabulary (vLLM's names)."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab_size, bias=False)
        # The bias starts at 0, so the head starts as its backbone drafts; markov_w1 keeps the unit-scale
        # embedding init, from which markov_w2 learns at once (a zero w2 leaves w1's first gradient 0).
        nn.init.zeros_(self.markov_w2.weight)

    def forward(self, previous: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(previous))


class ConfidenceHead(nn.Module):
    """proj([hidden; markov_w1[previous]]): the logit of the chance the target accepts the slot's token."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        # In the head's own dtype (bf16 on a GPU, where the whole head is cast); the logit in fp32 for the BCE
        # and the log-survival sums.
        dtype = self.proj.weight.dtype
        features = torch.cat((hidden.to(dtype), markov_embedding.to(dtype)), -1)
        return self.proj(features)[..., 0].float()


class DSparkHead(BlockDrafter[DsparkOptions]):
    head_type = "dspark"
    options_model = DsparkOptions
    shape_keys = (*BlockDrafter.shape_keys, "markov_rank", "confidence_head")
    first_drafting_slot = 0

    def __init__(self, config: HeadConfig[DsparkOptions]):
        super().__init__(config)
        options, hidden = config.options, config.arch.hidden_size
        draft_vocab = options.draft_vocab_size or config.vocab_size
        self.markov_head = MarkovHead(config.vocab_size, draft_vocab, options.markov_rank)
        self.confidence_head = ConfidenceHead(hidden, options.markov_rank) if options.confidence_head else None

    def markov_logits(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [..., V_draft] of slots with normed outputs ``hidden`` [..., H] whose previous tokens
        (target ids) are ``previous`` [...]: the backbone's logits plus the Markov bias."""
        logits = self.draft_logits(hidden)
        return logits + self.markov_head(previous).to(logits.dtype)

    def walk_logits(self, hidden: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        return self.to_target_vocab(self.markov_logits(hidden, parents))

    def confidence_logit(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """The confidence head's logit [...] for slots with outputs ``hidden`` and previous tokens ``previous``."""
        if self.confidence_head is None:
            raise ValueError("this DSpark head was trained without a confidence head (head.confidence_head: false)")
        return self.confidence_head(hidden, self.markov_head.markov_w1(previous))

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """DeepSpec's DSpark loss over random anchors (``block_states``): per scored slot,

            ce_weight x CE(draft, the data's token) + tv_weight x |p_draft - p_target|_1
            + confidence_weight x BCE(confidence logit, 1 - |p_draft - p_target|_1 / 2)

        with p_draft the slot's distribution after the Markov bias of the data's previous token (teacher forcing)
        and p_target the target's over the draft vocabulary (its logits one position earlier, from
        ``last_hidden``); the confidence label is detached (the chance a draft from p_draft passes verification
        against p_target), its input is not. A block is scored up to its first unlabelled slot (the teacher-forced
        tokens must all be real), slot k weighted exp(-k / loss_gamma), the weighted mean over every scored slot;
        with ``loss_weighting: dpace``, D-PACE's weights instead. Over a reduced draft vocabulary a data token
        outside it adds no cross-entropy. Metrics: ``chain_metrics`` (the chain with the Markov bias), and
        ``confidence_bce`` and ``confidence_gap`` (mean predicted minus mean label), with a confidence head.

        With ``loss: lk``, the LK hybrid of the soft cross-entropy to p_target and the acceptance rate replaces the
        cross-entropy and L1 terms; with ``loss: variable_prefix``, each block shows a variable prefix of real
        tokens (``BlockDrafter.shown_prefix``) and slot k's weight counts from the first slot after it.
        """
        options = self.config.options
        states = self.block_states(batch)
        shown = states.step < 0  # a variable prefix: neither cuts the block nor is scored
        labelled = (states.labelled | shown).long().cumprod(-1).bool() & ~shown
        rows = labelled.nonzero(as_tuple=True)
        terms = self.scored_slots(batch, states.hidden, rows, states.label_at)
        per_slot = slot_losses(terms, options.loss)
        total, slot_loss = weighted_slot_loss(per_slot, rows, labelled, states.step, terms["confidence"], options, True)
        metrics = {k: v.detach().mean() for k, v in terms.items() if k.startswith("confidence_") or k == "acceptance"}
        return total, metrics | chain_metrics(slot_loss, rows, labelled, terms["hit"], shown)

    def slot_terms(
        self,
        batch: dict[str, torch.Tensor],
        states: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """The per-slot terms (``BlockDrafter.slot_terms``): DeepSpec's cross-entropy and L1 terms as
        ``divergence``, the confidence head's BCE as ``auxiliary``, and ``confidence_bce`` and ``confidence_gap``
        (predicted minus label) with a confidence head."""
        options, ids = self.config.options, batch["input_ids"]
        previous, tokens = ids[sample, positions - 1], ids[sample, positions]
        logits = self.markov_logits(states, previous)
        target_probs = self.target_probs(batch, sample, positions)
        log_probs = logits.float().log_softmax(-1)
        l1 = (log_probs.exp() - target_probs).abs().sum(-1)
        terms = self.distribution_terms(batch, logits, sample, positions, target_probs) | {
            "divergence": options.tv_weight * l1 + options.ce_weight * self.token_cross_entropy(logits, tokens),
            "hit": self.greedy_hits(logits, greedy),
            "confidence": self.draft_confidence(log_probs.detach(), greedy),
        }
        if self.confidence_head is not None:
            label = (1 - l1.detach() / 2).clamp(0, 1)
            confidence = self.confidence_logit(states, previous)
            bce = F.binary_cross_entropy_with_logits(confidence, label, reduction="none")
            terms |= {
                "auxiliary": options.confidence_weight * bce,
                "confidence_bce": bce.detach(),
                "confidence_gap": confidence.detach().sigmoid() - label,
            }
        return terms

    def token_cross_entropy(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Cross-entropy [R] of draft-vocab ``logits`` [R, V_draft] to the target ids ``tokens`` [R]; 0 where a
        token is outside the draft vocabulary (the draft can never draft it)."""
        if self.lm_head is None:
            return F.cross_entropy(logits.float(), tokens, reduction="none")
        in_vocab = self.t2d[tokens]
        draft_index = (self.t2d.long().cumsum(0) - 1)[tokens].clamp(min=0)  # the draft vocabulary keeps id order
        return in_vocab * F.cross_entropy(logits.float(), draft_index, reduction="none")


HEAD_TYPE = HeadType(
    name="dspark",
    head=DSparkHead,
    trainer="eagle",
    fuses_layers=True,
    drafting=Drafting("dspark", "DSpark"),
)
