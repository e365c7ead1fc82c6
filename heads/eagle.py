"""EAGLE-1/2 feature predictor: fc(cat(embedding, feature)) -> one Llama decoder layer -> next feature.

Matches vLLM's ``llama_eagle.py`` (``EagleLlamaForCausalLM``): ``fc`` reads the token embedding first,
then the target feature; the layer lives at ``layers.0`` and has no ``input_layernorm``; there is no
final norm, and logits come from the target's own (frozen) ``lm_head``. The layer has q/k/v biases
when the target family does (Qwen2: SGLang's ``Qwen2ForCausalLMEagle``, vLLM's Llama layer with
``qkv_bias``). EAGLE-2 is the same head drafting a dynamic tree, which is the eval engine's business.

Alignment (the same in training and drafting): the feature f_i is the target's last hidden state
(after its final norm, what ``lm_head`` reads) at position i, computed from input_ids[:i+1]. The head
pairs f_i with the embedding of input_ids[i+1], at rotary position i, and predicts f_{i+1}, whose
``lm_head`` distribution is the one over input_ids[i+2].
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from headstart.core.settings import NonNegativeFloat
from headstart.heads.base import EmbeddingDrafter
from headstart.heads.head_config import FeatureOptions, HeadConfig, HeadSettings
from headstart.heads.layers import DecoderLayer, KVCache, RotaryEmbedding, default_positions
from headstart.heads.losses import (
    acceptance_rate,
    batch_positions,
    label_mask,
    lk_loss,
    sample_mask,
    shift_left,
    soft_cross_entropy,
)
from headstart.heads.registry import Drafting, HeadType
from headstart.heads.target import check_eagle_family


class EagleOptions(FeatureOptions):
    type: Literal["eagle"] = "eagle"
    # EAGLE-1's loss weights: 1.0 * feature regression (smooth L1) + 0.1 * token cross-entropy.
    vloss_weight: NonNegativeFloat = 1.0
    ploss_weight: NonNegativeFloat = 0.1
    fc_bias: bool = False  # vLLM's fc has no bias (a bias in the checkpoint would be silently skipped there)


class EagleHead(EmbeddingDrafter):
    head_type = "eagle"
    options_model = EagleOptions
    shape_keys = (*EmbeddingDrafter.shape_keys, "arch.intermediate_size", "fc_bias")
    config: HeadConfig[EagleOptions]

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig[EagleOptions]:
        check_eagle_family(target_config, cls.head_type)
        config = super().make_config(settings, target_config)
        # No engine's EAGLE-1 layer has Qwen3's q/k norm: vLLM serves EagleLlamaForCausalLM only.
        config.arch.qk_norm = False
        return config

    def __init__(self, config: HeadConfig[EagleOptions]):
        super().__init__(config)
        arch = config.arch
        self.fc = nn.Linear(2 * arch.hidden_size, arch.hidden_size, bias=config.options.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(arch, input_norm=False)])
        self.rotary = RotaryEmbedding(arch)

    def first_features(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The head's input features from the target's states: its last (post-norm) hidden state."""
        return last_hidden.to(self.fc.weight.dtype)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits (fp32) of features, through the target's frozen ``lm_head``."""
        lm_head = self.target.lm_head
        return lm_head(features.to(lm_head.weight.dtype)).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B,n,V], predicted features [B,n,H]) for tokens ``input_ids`` [B,n] paired with ``features``.

        ``position_ids`` default to continuing the cache; ``mask`` (bool or additive, [B,1,n,past+n])
        defaults to causal.
        """
        dtype = self.fc.weight.dtype
        if position_ids is None:
            position_ids = default_positions(input_ids, cache)
        x = self.fc(torch.cat((self.embed(input_ids), features.to(dtype)), dim=-1))
        cos, sin = self.rotary(position_ids, dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache)
        return self.logits(x), x

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """EAGLE-1 training loss on one batch (keys ``input_ids``, ``loss_mask``, ``attention_mask``, ``last_hidden``).

        Position i reads (f_i, input_ids[i+1]) and is scored on f_{i+1} (smooth L1) and on the target's
        distribution over input_ids[i+2] (soft cross-entropy; with ``loss: lk``, the LK hybrid of it and the
        acceptance rate); it counts when input_ids[i+2] is a label. Metrics are detached 0-d tensors: vloss,
        ploss, acc (argmax agreement with the target), and with LK acceptance (the mean acceptance rate).
        """
        features = self.first_features(batch["last_hidden"])
        logits, predicted = self(
            shift_left(batch["input_ids"], 1), features, batch_positions(batch), sample_mask(batch)
        )
        target_features = shift_left(features, 1)
        with torch.no_grad():
            target_logits = self.logits(target_features)
        mask = label_mask(batch, 2).float()
        count = mask.sum().clamp(min=1)
        vloss = F.smooth_l1_loss(predicted.float(), target_features.float(), reduction="none").mean(-1)
        target_probs = target_logits.softmax(-1)
        ploss = soft_cross_entropy(logits, target_probs)
        vloss, ploss = (vloss * mask).sum() / count, (ploss * mask).sum() / count
        options = self.config.options
        agree = (logits.argmax(-1) == target_logits.argmax(-1)).to(mask.dtype)
        metrics = {"vloss": vloss.detach(), "ploss": ploss.detach(), "acc": (agree * mask).sum() / count}
        if options.loss != "lk":
            return options.vloss_weight * vloss + options.ploss_weight * ploss, metrics
        acceptance = (acceptance_rate(logits, target_probs) * mask).sum() / count
        token_loss = lk_loss(ploss, acceptance, acceptance)
        return options.vloss_weight * vloss + options.ploss_weight * token_loss, metrics | {
            "acceptance": acceptance.detach()
        }


HEAD_TYPE = HeadType(
    name="eagle",
    head=EagleHead,
    trainer="eagle",
    fuses_layers=False,
    drafting=Drafting("eagle", "EAGLE-1/2"),
)
