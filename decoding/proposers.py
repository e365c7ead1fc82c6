"""Proposers: every drafting method behind one small interface (``decoding.verify.Proposer``).

    tokens, stats = generate(target, Eagle(head), input_ids, 128, Sampling(temperature=0.7))

- ``Vanilla``: the empty tree, i.e. plain autoregressive decoding through the same loop.
- ``NGram``: prompt lookup, no model: the continuation of the latest earlier match of the last n tokens.
- ``DraftModel``: a small LM with the target's tokenizer and its own KV cache; a chain of k by default,
  or an EAGLE-2-style dynamic tree (``top_k`` > 1) drafted with tree attention over that cache.
- ``SelfSpec``: self-speculative decoding: the target's first layers, final norm and lm_head as the draft model.
- the trained heads' drafters, each a ``HeadProposer`` (``decoding.proposers_heads``): ``Eagle`` and ``PEagle``
  (``decoding.proposers_eagle``), ``Medusa`` (``decoding.proposers_medusa``), ``DFlash``, ``DFlash2`` and ``Domino``
  (``decoding.proposers_block``), ``DSpark`` (``decoding.proposers_dspark``).
- ``Suffix`` and ``Lookahead`` (``decoding.proposers_lookup``): suffix decoding and lookahead decoding, no model.
- ``ProposerWrapper``: any of them behind a wrapper that records what passes through (timings, ranks).

Greedy runs propose top-k tokens (point masses for the verifier). Sampling runs draw from the draft
distribution q (the draft's logits through the same temperature / top-k / top-p as the target) and
hand q to the verifier, which needs it to stay lossless.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel

from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.tree import (
    Tree,
    additive_mask,
    chain,
    dynamic_tree,
    empty_tree,
    shaped_tree,
)
from headstart.decoding.verify import Proposer, Sampling, new_cache, probabilities


def draft_logq(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The draft's log-probs to rank (greedy) or sample (otherwise) proposals from."""
    if sampling.greedy:
        return logits.float().log_softmax(-1)
    return probabilities(logits, sampling).log()


class Vanilla:
    hidden_layers: tuple[int, ...] = ()

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        pass

    def propose(self, tokens: torch.Tensor) -> Tree:
        return empty_tree(tokens.device)

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        pass


class NGram(Vanilla):
    """Prompt lookup decoding: find the last ``n`` tokens earlier in the context (longest n first, latest
    match) and propose the ``k`` tokens that followed them."""

    def __init__(self, k: int = 5, max_n: int = 3, min_n: int = 1) -> None:
        self.k, self.max_n, self.min_n = k, max_n, min_n

    def propose(self, tokens: torch.Tensor) -> Tree:
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows that end before the last token, so the suffix does not match itself.
            hits = (tokens[:-1].unfold(0, n, 1) == tokens[-n:]).all(1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n
                return chain(tokens[start : start + self.k])
        return empty_tree(tokens.device)


def check_draft_vocab(draft: PreTrainedModel, target: PreTrainedModel, draft_name: str, target_name: str) -> None:
    """ValueError naming both models when the draft can propose ids the target has no token for."""
    draft_vocab, target_vocab = draft.config.vocab_size, target.config.vocab_size
    if draft_vocab > target_vocab:
        raise ValueError(
            f"the draft model {draft_name} has a vocabulary of {draft_vocab} tokens, the target {target_name} "
            f"{target_vocab}: it would propose ids the target has no embedding for; a draft model must use "
            "the target's tokenizer"
        )


class DraftModel:
    """A small causal LM sharing the target's vocabulary, drafting a chain, a dynamic tree or a fixed shape
    (``choices``). Its cache holds the committed tokens it has read;
    drafted entries are cropped after each step and accepted drafts are re-read with the next pending token
    (same forward, so no extra call)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model: PreTrainedModel,
        k: int = 4,
        top_k: int = 1,
        total_tokens: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        self.model, self.k, self.top_k, self.min_confidence = model, k, top_k, min_confidence
        self.total_tokens = total_tokens or k * top_k
        self.choices = [list(c) for c in choices] if choices is not None else None

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.sampling, self.cache, self.read = sampling, new_cache(self.model), 0
        self.positions = positions

    def propose(self, tokens: torch.Tensor) -> Tree:
        new = self.positions.rows(self.read, len(tokens) - self.read, tokens.device)
        out = self.model(tokens[None, self.read :], position_ids=new[None], past_key_values=self.cache, use_cache=True)
        self.read = len(tokens)
        root_logq, sample = draft_logq(out.logits[0, -1], self.sampling), not self.sampling.greedy
        if self.choices is not None:
            return shaped_tree(root_logq, self._expand, self.choices, sample, self.min_confidence)
        return dynamic_tree(root_logq, self._expand, self.top_k, self.k, self.total_tokens, sample, self.min_confidence)

    def _expand(
        self, tokens: torch.Tensor, parent_slots: torch.Tensor, depth: int, visible: torch.Tensor
    ) -> torch.Tensor:
        prefix = torch.ones(len(tokens), self.read, dtype=torch.bool, device=tokens.device)
        out = self.model(
            tokens[None],
            attention_mask=additive_mask(torch.cat((prefix, visible), 1), self.model.dtype),
            # The pending root sits at row read - 1, a depth-d node at row read - 1 + d.
            position_ids=torch.full((1, len(tokens)), self.positions.at(self.read - 1 + depth), device=tokens.device),
            past_key_values=self.cache,
            use_cache=True,
        )
        return draft_logq(out.logits[0], self.sampling)

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.cache.crop(self.read - self.cache.get_seq_length())


def early_exit(target: PreTrainedModel, layers: int) -> PreTrainedModel:
    """The target cut after its first ``layers`` decoder layers, then its final norm and lm_head: a model of the
    target's class sharing its weights (nothing is copied), whose config counts ``layers`` layers.

    Hugging Face decoders run ``self.layers[: config.num_hidden_layers]``, so a shallow copy of the target and
    of its decoder with that config is the early-exit model, with transformers' own masks and cache for it.
    """
    total = target.config.num_hidden_layers
    if not 1 <= layers < total:
        raise ValueError(f"the exit layer must be in 1..{total - 1} for a target of {total} layers, got {layers}")
    prefix = target.base_model_prefix
    decoder: nn.Module | None = getattr(target, prefix, None)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(
            f"self-speculative drafting needs a decoder with a `layers` list at `{prefix}.layers` (as Llama, "
            f"Qwen, Mistral and Gemma have); {type(target).__name__} has none"
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    decoder = copy.copy(decoder)
    decoder.config = config  # type: ignore[assignment]  # nn.Module types attributes as tensors or modules
    model = copy.copy(target)
    model._modules = {**target._modules, prefix: decoder}  # the copy's own table: the target keeps its decoder
    model.config = config
    return model


class SelfSpec(DraftModel):
    """Self-speculative decoding (LayerSkip, Draft & Verify): the target's first ``exit_layer`` layers with its
    final norm and lm_head (``early_exit``) draft as a ``DraftModel``: their own KV cache, cropped after each
    step, a chain of ``k`` (or a tree), and their softmax as q, so sampling stays lossless. ``exit_layer``
    defaults to half the target's layers; ``eval.acceptance --exit-layer`` sets it."""

    def __init__(
        self,
        target: PreTrainedModel,
        exit_layer: int | None = None,
        k: int = 4,
        top_k: int = 1,
        total_tokens: int | None = None,
        choices: Sequence[Sequence[int]] | None = None,
        min_confidence: float = 0.0,
    ) -> None:
        self.exit_layer = exit_layer or target.config.num_hidden_layers // 2
        super().__init__(early_exit(target, self.exit_layer), k, top_k, total_tokens, choices, min_confidence)


class ProposerWrapper:
    """A proposer that hands every call to ``proposer``; subclasses record what passes through."""

    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.hidden_layers = proposer.hidden_layers

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.proposer.reset(sampling, positions)

    def propose(self, tokens: torch.Tensor) -> Tree:
        return self.proposer.propose(tokens)

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        self.proposer.update(tokens, hidden)


class DepthRecorder(ProposerWrapper):
    """A proposer that records each proposed tree's depth (0: nothing drafted), what the per-depth acceptance
    rates are counted against (``core.acceptance.chain_acceptance``), and its size: the tree that really ran,
    whatever the flags asked for (a block's slots, a tree.json, a recurrent target's chains)."""

    def __init__(self, proposer: Proposer) -> None:
        super().__init__(proposer)
        self.depths: list[int] = []  # proposed tree depth per step
        self.most_nodes = 0  # the largest tree proposed

    def propose(self, tokens: torch.Tensor) -> Tree:
        tree = self.proposer.propose(tokens)
        self.depths.append(int(tree.depths.max()) if len(tree) else 0)
        self.most_nodes = max(self.most_nodes, len(tree))
        return tree
