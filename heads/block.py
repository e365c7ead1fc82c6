"""The block drafter's backbone, shared by DFlash, DSpark and DFlash-2: one forward drafts a whole block of tokens
from the target's fused layers. ``BlockDrafter`` is the abstract head; each head type (``heads/dflash.py``,
``heads/dspark.py``, ``heads/dflash2.py``) says which slots draft, its draft layer and its per-slot loss terms
through its named hooks.

The layout is vLLM 0.32's DFlash Qwen3 backbone (``qwen3_dflash.py``, architecture ``DFlashDraftModel``, on which
its DSpark and DFlash-2 drafts build), with its loader's weight names (no ``model.`` prefix):

- ``fc`` [H, n * H_target] and ``hidden_norm``: the context, hidden_norm(fc(the target's layers
  ``layer_ids``, concatenated in ascending order)), one vector per context token.
- ``layers.{i}``: Qwen3 decoder layers (per-head q/k RMSNorm, SiLU MLP, no biases) whatever the target's
  family. Each layer attends over the context through its OWN ``k_proj``/``v_proj`` (then ``k_norm`` and
  rotary at the context token's position): the same context feeds every layer, never its
  input_layernorm or MLP, and it does not flow from layer to layer (``precompute_and_store_context_kv``).
- ``norm``, then the target's frozen ``lm_head``; the block is embedded with the target's frozen
  embedding. Neither is saved: vLLM shares the target's when the draft has none.

A block anchored at position a is [x_a, mask, ..., mask] at positions a .. a + B - 1. It attends to the context
strictly before a and to every slot of the block (bidirectional unless ``causal``); its drafting slots (from
``first_drafting_slot``) draft the tokens at a + 1, a + 2, ...

Mask token. The mask slots hold ``mask_token_id``, embedded by the target's row for it (frozen, as in
DFlash/SpecForge/speculators); by default the tokenizer's mask token, else the first embedding row past the tokenizer
(a row no text ever uses), else pad, else eos (``heads.block_options.resolve_mask_token_id``). With
``mask_embedding: true`` the head learns the mask slots' input vector instead (started from that row); vLLM reads it
from ``mask_embedding.pt`` and puts it in place of the embedding of ``mask_token_id`` in the draft only
(``qwen3_dflash.py`` ``embed_input_ids``), as ``embed`` does here.

Draft vocabulary. By default the head drafts over the target's whole vocabulary with the target's frozen lm_head. With
``draft_vocab_size`` it drafts over the most frequent training tokens only: ``lm_head`` holds the target lm_head's
rows for them (frozen, copied by ``set_vocab_mapping``) and ``d2t`` their target ids as offsets; vLLM reads both for
DFlash (``draft_vocab_size``, ``compute_logits``), and the lm_head matmul, a large share of a tiny draft's time,
shrinks in proportion.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, NamedTuple, TypeVar, cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from headstart.core.models import default_aux_layers
from headstart.heads.base import DraftHead
from headstart.heads.block_options import BlockOptions, resolve_mask_token_id
from headstart.heads.block_training import draw_prefix_lengths, slot_losses, weighted_slot_loss
from headstart.heads.eagle3 import build_vocab_mapping, draft_vocab_rows
from headstart.heads.head_config import HeadConfig, HeadSettings, resolved
from headstart.heads.layers import BlockLayer, RMSNorm, RotaryEmbedding
from headstart.heads.losses import (
    acceptance_rate,
    batch_positions,
    chain_metrics,
    draft_vocab_mass,
    label_mask,
    same_sample,
    sample_anchors,
    soft_cross_entropy,
)
from headstart.heads.sparse_attention import chunked, query_chunk
from headstart.heads.target import draft_target_config

ContextKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [B, kv_heads, C, head_dim]


class BlockStates(NamedTuple):
    """The drafting slots of a batch's blocks (``BlockDrafter.block_states``), each [B, N, K] but ``hidden``."""

    hidden: torch.Tensor  # [B, N, K, H]: the slots' normed outputs
    label_at: torch.Tensor  # the row position of the token each slot drafts
    labelled: torch.Tensor  # whether it is scored
    # Its place in the chain drafted after the tokens the block shows (0: the first drafted token); negative where
    # the block shows the token (a variable prefix), which is then not scored.
    step: torch.Tensor


BlockOpts = TypeVar("BlockOpts", bound=BlockOptions)
Block = TypeVar("Block", bound="BlockDrafter[Any]")


class BlockDrafter(DraftHead, ABC, Generic[BlockOpts]):
    """A head that drafts a block of tokens in one forward over the target's fused layers (the module docstring):
    the block layout, the anchors training samples, the draft layer stack over the context and the loss pieces
    every block drafter shares.

    A head type says, through its hooks: which block slot drafts first (``first_drafting_slot``) and its per-slot
    training terms (``slot_terms``); where it differs from the backbone, its draft decoder layer (``new_layer``)
    and, when a slot's distribution depends on the token drafted before it, ``walk_logits``. Its own modules are
    built after the backbone's.
    """

    shape_keys = (
        *DraftHead.shape_keys,
        "arch.intermediate_size",
        "layer_ids",
        "num_layers",
        "mask_embedding",
        "draft_vocab_size",
    )
    config: HeadConfig[BlockOpts]
    # The first block slot that drafts. DFlash's slot 0 holds the newest token and drafts nothing, slot k >= 1
    # the token at its own position; a head whose anchor slot drafts too (DSpark) says 0, slot k then drafting
    # the token after its position. Either way the drafting slots' tokens are at anchor + 1, anchor + 2, ...
    first_drafting_slot: int
    # Slots at the block's end that no served chain drafts from: in the block (they shape the others' outputs
    # through its bidirectional attention), scored in training only with ``trains_spare_slots`` (as the public
    # Domino trainers do) and never held out. Domino with shifted labels serves k drafts from k + 1 slots (vLLM's
    # and SGLang's Domino drafting).
    spare_slots: int = 0
    trains_spare_slots: bool = False
    lm_head: nn.Linear | None  # the draft vocabulary's rows of the target's lm_head (draft_vocab_size), else None
    d2t: torch.Tensor  # buffers with lm_head, as EAGLE-3's
    t2d: torch.Tensor

    @classmethod
    def make_config(cls, settings: HeadSettings, target_config: PretrainedConfig) -> HeadConfig[BlockOpts]:
        config: HeadConfig[BlockOpts] = super().make_config(settings, target_config)
        options, arch = config.options, config.arch
        # vLLM builds the draft's layers as Qwen3's (q/k norm, SiLU, biases only with attention_bias,
        # which would add one to o_proj too), whatever the target family.
        arch.qk_norm, arch.qkv_bias, arch.hidden_act = True, False, "silu"
        layers = target_config.num_hidden_layers
        options.layer_ids = sorted(set(options.layer_ids or default_aux_layers(layers)))
        # Our id i is the residual stream entering layer i; vLLM's dflash id is i - 1 (the output of layer
        # i - 1), so id 0 (the embeddings) has no DFlash name.
        bad = [i for i in options.layer_ids if not 1 <= i < layers]
        if bad:
            raise ValueError(f"DFlash layer_ids {bad} out of range: the target's layers 1..{layers - 1} can be fused")
        if options.draft_vocab_size is not None and options.draft_vocab_size >= config.vocab_size:
            options.draft_vocab_size = None  # the whole vocabulary: the target's own lm_head
        mask = options.mask_token_id
        if mask is not None and not 0 <= mask < config.vocab_size:
            rows = config.vocab_size
            raise ValueError(f"head.mask_token_id {mask} is not a row of the target's {rows} embeddings")
        return config

    @classmethod
    def build(
        cls: type[Block],
        settings: HeadSettings,
        target_model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> Block:
        options = cast(BlockOptions, cls.options_of(settings))  # an instance of cls.options_model, a BlockOptions
        if options.mask_token_id is None:
            options.mask_token_id = resolve_mask_token_id(draft_target_config(target_model.config), tokenizer)
        head = super().build(options, target_model, tokenizer)
        if head.mask_embedding is not None:  # a learned vector starts from the row it replaces
            row = head.target.embed_tokens.weight[head.mask_token_id]
            head.mask_embedding.data.copy_(row.detach().float())
        if head.lm_head is not None:  # until set_vocab_mapping: the first draft_vocab_size target ids
            head.set_vocab_mapping(torch.arange(head.config.vocab_size, 0, -1))
        return head

    def __init__(self, config: HeadConfig[BlockOpts]):
        super().__init__(config)
        arch, options = config.arch, config.options
        hidden = arch.hidden_size
        self.fc = nn.Linear(
            len(resolved(options.layer_ids, "layer_ids")) * config.target_hidden_size, hidden, bias=False
        )
        self.hidden_norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.layers = nn.ModuleList(self.new_layer() for _ in range(options.num_layers))
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.rotary = RotaryEmbedding(arch)
        self.mask_embedding = nn.Parameter(torch.zeros(hidden)) if options.mask_embedding else None
        self.lm_head = None
        if options.draft_vocab_size is not None:
            draft_vocab = options.draft_vocab_size
            self.lm_head = nn.Linear(hidden, draft_vocab, bias=False).requires_grad_(False)  # the target's rows
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < draft_vocab)

    def new_layer(self) -> BlockLayer:
        """One draft decoder layer: the Qwen3 layer vLLM's backbone builds (DFlash-2's convolves around each
        sublayer)."""
        return BlockLayer(self.config.arch)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The fused target layers (``hidden_states`` indices, ascending)."""
        return tuple(resolved(self.config.options.layer_ids, "layer_ids"))

    @property
    def mask_token_id(self) -> int:
        return resolved(self.config.options.mask_token_id, "mask_token_id")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's embeddings of ``input_ids``; with ``mask_embedding``, that vector at the mask id."""
        embeds = self.target.embed(input_ids).to(self.fc.weight.dtype)
        if self.mask_embedding is None:
            return embeds
        return torch.where((input_ids == self.mask_token_id)[..., None], self.mask_embedding, embeds)

    def context_kv(self, aux_hidden: torch.Tensor, position_ids: torch.Tensor) -> ContextKV:
        """Every layer's keys and values for context tokens with target states ``aux_hidden`` [B, C, n * H_t]
        at ``position_ids`` [B, C]."""
        dtype = self.fc.weight.dtype
        context = self.hidden_norm(self.fc(aux_hidden.to(dtype)))
        cos, sin = self.rotary(position_ids, dtype)
        return [cast(BlockLayer, layer).key_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        block_ids: torch.Tensor,
        position_ids: torch.Tensor,
        context_kv: ContextKV,
        context_visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Normed outputs [B, N * S, H] of N blocks of S slots (``block_ids``, ``position_ids`` [B, N * S]),
        each seeing the context tokens ``context_visible`` [B, N, C] marks (None: all); see ``block_attention``."""
        dtype = self.fc.weight.dtype
        cos, sin = self.rotary(position_ids, dtype)
        x = self.embed(block_ids)
        for layer, kv in zip(self.layers, context_kv):
            x = layer(x, cos, sin, kv, context_visible, self.config.options.causal)
        return self.norm(x)

    def picks_draft_vocab(self) -> bool:
        return self.lm_head is not None

    def set_vocab_mapping(self, token_counts: torch.Tensor) -> None:
        """Draft over the ``draft_vocab_size`` most frequent target ids of ``token_counts`` [V] (training
        tokens): ``d2t``/``t2d`` as EAGLE-3 keeps them, and ``lm_head`` the target lm_head's rows for them."""
        if self.lm_head is None:
            raise ValueError(
                "set_vocab_mapping needs a reduced draft vocabulary: this DFlash head has no draft_vocab_size"
            )
        d2t, t2d = build_vocab_mapping(token_counts, self.lm_head.out_features)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.lm_head.weight.data.copy_(draft_vocab_rows(self.target.lm_head.weight, self.draft_ids()))

    def draft_ids(self) -> torch.Tensor:
        """The target ids of the draft vocabulary (every id without a reduced one)."""
        if self.lm_head is None:
            return torch.arange(self.config.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of normed outputs: the draft's lm_head rows, else the target's frozen lm_head."""
        lm_head = self.lm_head if self.lm_head is not None else self.target.lm_head
        return lm_head(hidden.to(lm_head.weight.dtype))

    def target_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's own logits of its normed last hidden states (soft-capped where it caps them)."""
        return self.target.logits(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits of normed outputs (-inf off a reduced draft vocabulary)."""
        return self.to_target_vocab(self.draft_logits(hidden))

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., draft vocab] -> [..., V], -inf off a reduced draft vocabulary (the whole vocabulary: as it is)."""
        if self.lm_head is None:
            return logits
        out = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., self.draft_ids()] = logits
        return out

    def walk_logits(self, hidden: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """Target-vocab logits [P, V] of the slot with normed output ``hidden`` [H] after each parent token [P]
        (``decoding.proposers_block.BlockWalk``): DFlash's depend on the slot only; DSpark and DFlash-2 add the
        parent's own term."""
        return self.logits(hidden).expand(len(parents), -1)

    def draft_hidden(self, root: torch.Tensor, position: int, context_kv: ContextKV, drafts: int) -> torch.Tensor:
        """Normed outputs [drafts, H] of the slots drafting the ``drafts`` tokens after ``root`` (the newest token, at
        ``position``): one block [root, mask, ...] over the context before it, as vLLM drafts with ``drafts``
        speculative tokens (DFlash: root + ``drafts`` masks; DSpark: root + ``drafts`` - 1 masks; plus the
        ``spare_slots``)."""
        first = self.first_drafting_slot
        masks = drafts + first - 1 + self.spare_slots
        block = torch.cat((root.view(1), root.new_full((masks,), self.mask_token_id)))
        positions = torch.arange(position, position + len(block), device=root.device)
        return self(block[None], positions[None], context_kv)[0, first : first + drafts]

    def draft_block(self, root: torch.Tensor, position: int, context_kv: ContextKV, masks: int) -> torch.Tensor:
        """Target-vocab logits [masks, V] of the tokens after ``root`` from one block (``draft_hidden``)."""
        return self.logits(self.draft_hidden(root, position, context_kv, masks))

    def shown_prefix(self, anchors: torch.Tensor, drafting_slots: int) -> torch.Tensor:
        """[B, N]: how many real tokens, from its anchor on, each block at ``anchors`` [B, N] shows: its anchor
        alone, or in training with ``loss: variable_prefix`` a drawn length (``draw_prefix_lengths``)."""
        if not (self.training and self.config.options.loss == "variable_prefix"):
            return torch.ones_like(anchors)
        return draw_prefix_lengths(anchors, drafting_slots)

    def block_states(self, batch: dict[str, torch.Tensor]) -> BlockStates:
        """The drafting slots of blocks at random anchors (``BlockStates``): slot k of the block at anchor a drafts
        the token at ``label_at`` = a + k, k = 1..K, which is scored where it is a label and the block does not
        show it (``shown_prefix``).

        Anchors are positions whose next token is a label. Each block sees the context strictly before its anchor
        (serving has no target state of the newest token yet) and its own slots.
        """
        ids = batch["input_ids"]
        seq, first = ids.shape[1], self.first_drafting_slot
        # evaluation draws with a fixed seed (held-out figures compare across steps); training from torch's, which the
        # loop seeds per micro-batch (a resumed run draws alike)
        segments = batch.get("segment_ids")  # a packed row draws num_anchors per sample it holds
        count = self.config.options.num_anchors * (1 if segments is None else int(segments[:, -1].max()) + 1)
        anchors, real = sample_anchors(label_mask(batch, 1), count, not self.training)
        offsets = torch.arange(self.config.options.block_size, device=ids.device)
        slots = anchors[..., None] + offsets  # [B, N, S]: the row's positions the block stands for
        spare = 0 if self.training and self.trains_spare_slots else self.spare_slots
        drafting = slice(first, self.config.options.block_size - spare)
        prefix = self.shown_prefix(anchors, drafting.stop - first)
        within = slots.clamp(max=seq - 1)
        shown = (offsets < prefix[..., None]) & (slots < seq) & same_sample(batch, anchors, within)
        block_ids = torch.where(shown, ids.gather(1, within.flatten(1)).view_as(slots), self.mask_token_id)
        positions = batch_positions(batch)  # rotary: a packed sample's own from 0
        context_kv = self.context_kv(batch["aux_hidden"], positions)
        rows = torch.arange(seq, device=ids.device)
        visible = (rows < anchors[..., None]) & batch["attention_mask"].bool()[:, None, :]
        visible &= same_sample(batch, anchors, rows.expand(len(ids), 1, seq))  # a packed row: its anchor's sample
        block_positions = positions.gather(1, anchors)[..., None] + offsets
        hidden = self(block_ids.flatten(1), block_positions.flatten(1), context_kv, visible)
        hidden = hidden.view(*slots.shape, -1)[:, :, drafting]
        label_at = slots[..., drafting] + 1 - first  # [B, N, K]: where each slot's token is
        step = label_at - anchors[..., None] - prefix[..., None]
        with torch.no_grad():
            inside = label_at.clamp(max=seq - 1)
            labelled = label_mask(batch, 0).gather(1, inside.flatten(1)).view_as(label_at)
            labelled &= (label_at < seq) & real[..., None] & same_sample(batch, anchors, inside) & (step >= 0)
        return BlockStates(hidden, label_at, labelled, step)

    def target_probs(
        self, batch: dict[str, torch.Tensor], sample: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The target's distribution [R, V_draft] over the draft vocabulary of the tokens at ``positions`` [R] of
        samples ``sample`` [R]: its logits one position earlier, from ``last_hidden`` through the frozen lm_head's
        draft rows (over a reduced vocabulary: renormalised there, as EAGLE-3 scores)."""
        with torch.no_grad():
            ids = None if self.lm_head is None else self.draft_ids()
            return self.target.logits(batch["last_hidden"][sample, positions - 1], ids).float().softmax(-1)

    def distribution_terms(
        self,
        batch: dict[str, torch.Tensor],
        logits: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        target_probs: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Per scored slot [R] with draft-vocab ``logits`` [R, V_draft] and the target's ``target_probs``: ``soft_ce``,
        the soft cross-entropy to the target's distribution, and with ``loss: lk`` ``acceptance``, the rate at
        which verification accepts the slot's draft (against the target's whole-vocabulary probabilities of the
        draft's tokens: over a reduced vocabulary, ``target_probs`` times the target's mass on it)."""
        terms = {"soft_ce": soft_cross_entropy(logits, target_probs)}
        if self.config.options.loss != "lk":
            return terms
        on_draft = target_probs
        if self.lm_head is not None:
            with torch.no_grad():
                hidden = batch["last_hidden"][sample, positions - 1]
                whole, draft = self.target.logits(hidden), self.target.logits(hidden, self.draft_ids())
                on_draft = target_probs * draft_vocab_mass(whole, draft)
        return terms | {"acceptance": acceptance_rate(logits, on_draft)}

    def draft_confidence(self, log_probs: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """D-PACE's confidence [R]: the draft's probability of the target's greedy token ``greedy`` [R] (0 off its
        vocabulary), from the draft's log-probabilities [R, V_draft]."""
        with torch.no_grad():
            if self.lm_head is None:
                return log_probs.gather(1, greedy[:, None])[:, 0].exp()
            draft_index = (self.t2d.long().cumsum(0) - 1)[greedy].clamp(min=0)  # the draft vocabulary keeps id order
            return log_probs.gather(1, draft_index[:, None])[:, 0].exp() * self.t2d[greedy]

    def greedy_hits(self, logits: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """[R]: whether each draft-vocab row's argmax is the target's greedy token ``greedy`` (off-vocabulary: a
        miss)."""
        with torch.no_grad():
            return self.draft_ids()[logits.argmax(-1)] == greedy

    def scored_slots(
        self,
        batch: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        rows: tuple[torch.Tensor, ...],
        label_at: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """``slot_terms`` of every scored slot (``rows`` of ``hidden`` [B, N, K, H] and ``label_at``), a chunk of
        slots at a time within the score budget (their logits over the whole vocabulary), each chunk recomputed in
        backward: memory does not grow with the vocabulary or the slot count beyond one chunk."""
        states, sample, positions = hidden[rows], rows[0], label_at[rows]
        greedy = self.target.greedy(batch["last_hidden"][sample, positions - 1])  # whole-vocabulary logits: once
        chunk = query_chunk(len(states), self.target.lm_head.out_features, 1, states.device)

        def terms(start: int, end: int) -> dict[str, torch.Tensor]:
            part = slice(start, end)
            return self.slot_terms(batch, states[part], sample[part], positions[part], greedy[part])

        return chunked(terms, len(states), chunk, dim=0)

    @abstractmethod
    def slot_terms(
        self,
        batch: dict[str, torch.Tensor],
        states: torch.Tensor,
        sample: torch.Tensor,
        positions: torch.Tensor,
        greedy: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Per scored slot [R] (outputs ``states`` [R, H], drafting the token at ``positions`` of ``sample``, whose
        greedy token the target gives as ``greedy``): ``divergence``, the head type's distribution term, with
        ``distribution_terms`` (``soft_ce`` and, with ``loss: lk``, ``acceptance``), which
        ``block_training.slot_losses`` turns into the training loss with the head's ``auxiliary`` terms, if it has
        any; ``hit``, whether its draft is the target's greedy token; ``confidence``, D-PACE's (the draft's
        probability of that token). A head type may add its own terms; any but these are reported as metrics (their
        mean)."""

    def block_loss(
        self, batch: dict[str, torch.Tensor], states: BlockStates
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss and metrics of the scored slots of ``states`` (``scored_slots``), weighted by
        ``weighted_slot_loss``; metrics: ``chain_metrics`` and the mean of each extra term."""
        rows = states.labelled.nonzero(as_tuple=True)
        terms = self.scored_slots(batch, states.hidden, rows, states.label_at)
        options = self.config.options
        per_slot = slot_losses(terms, options.loss)
        total, slot_loss = weighted_slot_loss(
            per_slot,
            rows,
            states.labelled,
            states.step,
            terms["confidence"],
            options,
            options.loss == "variable_prefix",
        )
        own = ("divergence", "auxiliary", "soft_ce", "hit", "confidence")
        metrics = {k: v.detach().float().mean() for k, v in terms.items() if k not in own}
        return total, metrics | chain_metrics(slot_loss, rows, states.labelled, terms["hit"], states.step < 0)

    def loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Block loss over random anchors (``block_states``): the head type's ``slot_terms`` of every drafting slot
        whose token is a label, weighted by ``weighted_slot_loss`` (a fixed decay over positions, or D-PACE from the
        draft's probability of the target's greedy token). Metrics: ``chain_metrics`` and the mean of each extra
        term (``acceptance`` with ``loss: lk``).

        Batch keys: ``input_ids``, ``loss_mask``, ``attention_mask``, ``aux_hidden``, ``last_hidden``.
        """
        return self.block_loss(batch, self.block_states(batch))
