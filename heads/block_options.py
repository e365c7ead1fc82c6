"""A block drafter's options (``BlockOptions``, which each head type's model extends: ``heads/dflash.py``,
``heads/dspark.py``, ``heads/dflash2.py``, ``heads/domino.py``), the check of an option a head type's layout fixes
(``only``) and the mask token an unset ``mask_token_id`` resolves to (``resolve_mask_token_id``). The head itself is
``heads/block.py``'s ``BlockDrafter``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from headstart.core.settings import Count, Float, NonNegative, Positive
from headstart.heads.head_config import LayerOptions


def resolve_mask_token_id(target_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase | None) -> int:
    """The id fed in the mask slots: the tokenizer's mask token, else the first embedding row past the
    tokenizer (never produced by text), else pad, else eos (SpecForge's order), else the last row."""
    vocab = target_config.vocab_size
    if tokenizer is not None:
        if tokenizer.mask_token_id is not None:
            return tokenizer.mask_token_id
        if len(tokenizer) < vocab:
            return len(tokenizer)
        candidates = [tokenizer.pad_token_id, tokenizer.eos_token_id]
    else:
        candidates = [getattr(target_config, "pad_token_id", None), getattr(target_config, "eos_token_id", None)]
    return next((c for c in candidates if isinstance(c, int) and 0 <= c < vocab), vocab - 1)


def only(value: bool | None, why: str) -> BeforeValidator:
    """The check of an option a block drafter's layout fixes at ``value`` (its options model types it so): any other
    setting is refused by the config check, saying ``why``."""

    def check(setting: Any) -> Any:
        if setting is not value:
            shown = {None: "null", False: "false", True: "true"}[value]
            raise PydanticCustomError("value", "must be {shown}: {why}", {"shown": shown, "why": why})
        return setting

    return BeforeValidator(check)


class BlockOptions(LayerOptions):
    """The options of every block drafter (``BlockDrafter``); each head type's model adds its own, and types an
    option its layout fixes to the one value it takes."""

    # Each head type's model declares its Literal; declared here too, so a dumped head: section (a run's
    # config.yaml) names the type ahead of the block options.
    type: str
    # Target layers fused by fc, in capture.aux_layers' convention (HF hidden_states index; vLLM's
    # dflash_config.target_layer_ids is one less). null: the capture's layers; its auto default
    # (2, L//2, L-3) is EAGLE-3's, so one capture feeds both heads.
    layer_ids: list[NonNegative] | None = None
    num_layers: Count = 1  # draft decoder layers (Qwen3-style, q/k norm)
    block_size: Annotated[int, Field(ge=2)] = 16  # one forward: the real token + block_size - 1 mask slots
    # The token fed in the mask slots; null: the tokenizer's mask token, else the first row past the
    # tokenizer (an unused embedding row), else pad, else eos (resolve_mask_token_id).
    mask_token_id: NonNegative | None = None
    mask_embedding: bool = False  # learn the mask slots' input vector (vLLM: mask_embedding.pt) instead of its row
    # null: draft over the target's whole vocabulary with its lm_head. A number: the most frequent training
    # tokens only, with the target lm_head's rows for them (frozen), shipped as lm_head + d2t (a smaller matmul).
    draft_vocab_size: Count | None = None
    causal: bool = False  # causal attention inside the block (the DFlash paper's blocks are bidirectional)
    num_anchors: Count = 512  # blocks sampled per sequence and training step
    loss_gamma: Positive = 7.0  # block position k's loss weight exp(-(k-1)/gamma): 7 for blocks of 16
    # decay: the fixed loss_gamma schedule. dpace: D-PACE (arXiv 2605.18810), each block's position weights from
    # the draft's confidence in it (heads/losses.py, dpace_weights); loss_gamma is then unused.
    loss_weighting: Literal["decay", "dpace"] = "decay"
    dpace_alpha: Annotated[Float, Field(gt=0, le=1)] = 0.5  # D-PACE's smoothing q~ = alpha + (1 - alpha) q
    # HeadOptions' choices, and variable_prefix: D2SD's VP-Drafter training (arXiv 2606.04446, NeMo AutoModel's
    # loss_type: variable_prefix). Each training block shows l >= 2 real tokens from its anchor (Pr(l) ~ 0.9**l,
    # PREFIX_PRIOR_BASE) and is scored on the slots after them, the decay restarting there: the draft learns to
    # re-draft a block's rest behind a partly accepted one. Held-out blocks show the anchor only, as served.
    loss: Literal["lk", "variable_prefix"] | None = None

    def trained_depth(self) -> int:
        return self.block_size - 1  # the mask slots: the newest token's slot drafts nothing (DSpark's says more)

    def draft_vocab(self) -> int | None:
        return self.draft_vocab_size

    def length_problems(self, max_length: int) -> list[str]:
        if self.block_size <= max_length:
            return []
        # Every step holds num_anchors blocks of block_size slots per sequence (5000 slots: 120 GB, after the
        # target has loaded); slots past a sample's max_length tokens are never scored anyway.
        return [
            f"head.block_size ({self.block_size}) must not exceed data.max_length ({max_length}): "
            "a block's slots past the end of a sample have no token to learn"
        ]
