"""DFlash: the block drafter of ``heads/block.py`` as vLLM 0.32 serves it as ``method: dflash`` (``qwen3_dflash.py``,
architecture ``DFlashDraftModel``).

Slot 0 of the block anchored at a holds x_a and drafts nothing; slot k >= 1 predicts the token at its own position
a + k. Serving: a = the newest token (vLLM's bonus token), the context every token the target has verified before
it, k = 1 .. num_speculative_tokens. The loss is the soft cross-entropy of every slot to the target's
distribution (``slot_terms``), or with ``loss: lk`` the LK hybrid of it and the acceptance rate.
"""

from __future__ import annotations

from typing import Literal

import torch

from headstart.heads.block import BlockDrafter
from headstart.heads.block_options import BlockOptions
from headstart.heads.registry import Drafting, HeadType


class DflashOptions(BlockOptions):
    type: Literal["dflash"] = "dflash"


class DFlashHead(BlockDrafter[DflashOptions]):
    head_type = "dflash"
    options_model = DflashOptions
    first_drafting_slot = 1

    def slot_terms(
        self,
        batch: dict[str, torch.Tensor],
        states: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """``loss``: the soft cross-entropy of each slot to the target's distribution over the token it drafts (its
        logits one position earlier, from ``last_hidden`` through the frozen lm_head). Soft labels rather than the
        data tokens: acceptance is decided by the target's distribution, and the data need not be the target's own
        text (over a reduced draft vocabulary: that distribution renormalised over it, a target token outside it a
        miss). ``hit``: the slot's argmax is the target's greedy token."""
        target_probs = self.target_probs(batch, sample, positions)
        logits = self.draft_logits(states)
        terms = self.distribution_terms(batch, logits, sample, positions, target_probs)
        return terms | {
            "divergence": terms["soft_ce"],
            "hit": self.greedy_hits(logits, greedy),
            "confidence": self.draft_confidence(logits.detach().float().log_softmax(-1), greedy),
        }


HEAD_TYPE = HeadType(
    name="dflash",
    head=DFlashHead,
    trainer="eagle",
    fuses_layers=True,
    drafting=Drafting("dflash", "DFlash"),
)
