"""Medusa heads: K heads on the target's last hidden state, head k guessing the token k+2 ahead.

Layout of the Medusa repo (``medusa/model/medusa_model.py``): ``medusa_head.{k}`` is a Sequential of
``num_layers`` residual blocks x + SiLU(Linear(x)) (weight zero-initialised, so a fresh head starts
near the target's own next-token guess) and a bias-free ``Linear(H -> V)`` initialised from the
target's ``lm_head``. Unlike the repo, each block has its own weights (the repo repeats one block
object, so its checkpoints only represent num_layers > 1 when all blocks are equal).

Alignment: the last hidden state at position i comes from input_ids[:i+1]; the target's lm_head there
predicts input_ids[i+1] and head k predicts input_ids[i+k+2].

Medusa-1 trains the heads on a frozen target (``MedusaHead.loss``). Medusa-2 trains them together with
the target through LoRA (``medusa2_wrap``): base LM loss + medusa_weight * sum_k decay**k * head loss,
with ``medusa_weight`` warming up from 0 (``medusa_weight_at``) so the fresh heads' large gradients
do not wreck the target early on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from pydantic import Field
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.settings import Count, Decay, Float, NonNegative, NonNegativeFloat, Positive, Section
from headstart.heads.base import DraftHead
from headstart.heads.head_config import HeadConfig, HeadOptions, HeadSettings, parse_section
from headstart.heads.losses import acceptance_rate, label_mask, lk_loss, shift_left, soft_cross_entropy
from headstart.heads.registry import Drafting, HeadType


class MedusaOptions(HeadOptions):
    type: Literal["medusa"] = "medusa"
    num_heads: Count = 4  # head k guesses the token k+2 ahead
    num_layers: NonNegative = 1  # residual blocks per head
    decay: Decay = 0.8  # loss weight decay**k for head k

    def trained_depth(self) -> int:
        return self.num_heads


class Lora(Section):
    """Medusa-2: present -> the target trains jointly through LoRA adapters."""

    r: Count = 16
    alpha: Positive = 32.0
    dropout: Annotated[Float, Field(ge=0, lt=1)] = 0.05
    target_modules: Annotated[list[str], Field(min_length=1)] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    head_weight: NonNegativeFloat = 0.2  # weight of the Medusa heads' loss beside the LM loss
    head_weight_warmup: NonNegative = 0  # steps over which that weight rises from 0


class ResBlock(nn.Module):
    """Medusa's block x + SiLU(Wx + b); W starts at zero (as in Medusa), so a fresh block only adds SiLU(b)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHead(DraftHead):
    head_type = "medusa"
    options_model = MedusaOptions
    shape_keys = (*DraftHead.shape_keys, "num_heads", "num_layers")
    config: HeadConfig[MedusaOptions]

    def __init__(self, config: HeadConfig[MedusaOptions]):
        super().__init__(config)
        hidden, vocab, options = config.target_hidden_size, config.vocab_size, config.options
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden) for _ in range(options.num_layers)], nn.Linear(hidden, vocab, bias=False))
            for _ in range(options.num_heads)
        )

    @classmethod
    def build(
        cls, settings: HeadSettings, target_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> MedusaHead:
        """Fresh heads whose lm_heads start as copies of the target's (then trained, and saved with the head)."""
        head = super().build(settings, target_model, tokenizer)
        weight = head.target.lm_head.weight
        with torch.no_grad():
            for lm_head in head.lm_heads():
                lm_head.weight.copy_(weight)
        return head

    def lm_heads(self) -> list[nn.Linear]:
        """Each head's last layer, its lm_head."""
        return [cast(nn.Linear, list(seq.children())[-1]) for seq in self.medusa_head]

    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Logits [B,S,K,V] of every head at every position of ``last_hidden`` [B,S,H]."""
        x = last_hidden.to(self.lm_heads()[0].weight.dtype)
        return torch.stack([head(x) for head in self.medusa_head], dim=2)

    def draft(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """Log-probs [B,K,V] from the last hidden state [B,H] of the newest verified token."""
        return self(last_hidden[:, None])[:, 0].float().log_softmax(-1)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Medusa-1 loss on a batch with ``input_ids``, ``loss_mask``, ``attention_mask``, ``last_hidden``; with
        ``loss: lk``, against the target's own logits there (``medusa_loss``)."""
        target_logits = None
        if self.config.options.loss == "lk":
            with torch.no_grad():
                target_logits = self.target.logits(batch["last_hidden"])
        return medusa_loss(self(batch["last_hidden"]), batch, self.config.options.decay, lk_target_logits=target_logits)


def _token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor], offset: int) -> tuple[torch.Tensor, ...]:
    """Mean cross-entropy and top-1 accuracy of ``logits`` [B,S,V] at position i against input_ids[i+offset]."""
    labels = shift_left(batch["input_ids"], offset)
    mask = label_mask(batch, offset).float()
    count = mask.sum().clamp(min=1)
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view_as(mask)
    acc = ((logits.argmax(-1) == labels).float() * mask).sum() / count
    return (ce * mask).sum() / count, acc.detach()


def _lk_token_loss(
    logits: torch.Tensor, batch: dict[str, torch.Tensor], offset: int, target_logits: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The LK loss (``heads.losses.lk_loss``) of ``logits`` [B,S,V] at position i to the target's distribution
    over input_ids[i+offset] (its ``target_logits`` [B,S,V] at position i+offset-1, what verification reads), its
    mean acceptance rate, and the top-1 accuracy against the data's token, as ``_token_loss``."""
    mask = label_mask(batch, offset).float()
    count = mask.sum().clamp(min=1)
    target_probs = shift_left(target_logits, offset - 1).float().softmax(-1)
    cross_entropy = (soft_cross_entropy(logits, target_probs) * mask).sum() / count
    acceptance = (acceptance_rate(logits, target_probs) * mask).sum() / count
    labels = shift_left(batch["input_ids"], offset)
    acc = ((logits.argmax(-1) == labels).float() * mask).sum() / count
    return lk_loss(cross_entropy, acceptance, acceptance), acc.detach(), acceptance.detach()


def medusa_loss(
    head_logits: torch.Tensor,
    batch: dict[str, torch.Tensor],
    decay: float = 0.8,
    lm_logits: torch.Tensor | None = None,
    medusa_weight: float = 1.0,
    lk_target_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """medusa_weight * sum_k decay**k * CE(head k) [+ the base LM loss when ``lm_logits`` are given: Medusa-2].

    ``head_logits`` [B,S,K,V] from ``MedusaHead.forward``; ``lm_logits`` [B,S,V] from the (LoRA) target.
    A position counts for a head when its label token has loss_mask 1 (see ``label_mask``). With
    ``lk_target_logits`` [B,S,V] (the target's, detached: ``loss: lk``), head k's loss is the LK hybrid of its soft
    cross-entropy to the target's distribution and its acceptance rate (``_lk_token_loss``) instead of the
    data token's cross-entropy. Metrics (detached): loss_k, acc_k per head (and acceptance_k with LK), and lm_loss
    for Medusa-2.
    """
    total: torch.Tensor | float = 0.0
    metrics = {}
    for k in range(head_logits.shape[2]):
        if lk_target_logits is None:
            loss_k, metrics[f"acc_{k}"] = _token_loss(head_logits[:, :, k], batch, k + 2)
        else:
            loss_k, metrics[f"acc_{k}"], metrics[f"acceptance_{k}"] = _lk_token_loss(
                head_logits[:, :, k], batch, k + 2, lk_target_logits
            )
        metrics[f"loss_{k}"] = loss_k.detach()
        total = total + decay**k * loss_k
    total = medusa_weight * total
    if lm_logits is not None:
        lm_loss, _ = _token_loss(lm_logits, batch, 1)
        metrics["lm_loss"] = lm_loss.detach()
        total = total + lm_loss
    return cast(torch.Tensor, total), metrics  # a tensor from the first head's loss on


def medusa_weight_at(step: int, warmup_steps: int, final_weight: float = 1.0) -> float:
    """Medusa-2's head-loss weight: rises linearly from 0 to ``final_weight`` over ``warmup_steps``."""
    if warmup_steps <= 0:
        return final_weight
    return final_weight * min(step / warmup_steps, 1.0)


def medusa2_wrap(target: PreTrainedModel, lora: Lora | dict[str, Any]) -> PeftModel:
    """The target with LoRA adapters (peft): only the adapters train; the base weights stay frozen.

    ``lora`` is a config's ``lora:`` section (``Lora``, or a mapping of its keys). The target is modified in
    place, as peft does.
    """
    settings = lora if isinstance(lora, Lora) else parse_section(Lora, lora, "lora")
    config = LoraConfig(
        r=settings.r,
        lora_alpha=cast(int, settings.alpha),  # peft annotates it int; it only divides it by r, as it does a float
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(target, config)


HEAD_TYPE = HeadType(
    name="medusa",
    head=MedusaHead,
    trainer="medusa",
    fuses_layers=False,
    drafting=Drafting("medusa", "Medusa"),
)
