"""The target's cache, for caches that cannot simply be gathered and cropped: sliding windows and recurrent state.

Tree verification (``decoding.verify``) writes a step's rows into the cache, keeps the accepted ones and crops the
rest. Two kinds of target layers break that:

- sliding-window attention (Mistral, Phi-3, Qwen2's upper layers, gpt-oss, Gemma-3): transformers' cache for
  such a layer keeps only its last window, so a crop of rejected rows would lose context the window still
  needs. ``new_cache`` keeps every position instead and ``layer_masks`` applies each window in the mask, by
  positions (tree nodes sit at their depth's position, not at their cache slot).
- recurrent layers (linear attention: Qwen3-Next's gated delta net, Mamba in Granite-4 / Nemotron-H): their
  conv and recurrent states hold the whole past in a fixed size and are updated in place, so rows cannot be
  dropped afterwards. ``snapshot_states`` / ``restore_states`` put them back as they were before a step and
  ``ReplayingCache`` runs the accepted rows again.

How a verify step uses the cache is a ``VerifyCache``: the queries it runs, its forward and how it keeps the accepted
rows. The dynamic cache's way is the base; ``ReplayingCache`` is a recurrent target's and
``decoding.static_cache.StaticVerifyCache`` the static cache's.

The layout comes from transformers' own reading of the config (``get_layer_types_and_kwargs``, what
``DynamicCache(config=...)`` builds), once per config.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache, DynamicCache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from headstart.decoding.tree import Tree, is_chain

# Cache layer types whose layer keeps only its last window; the mask, not the mask's slots, makes the window.
SLIDING_TYPES = ("sliding_attention", "hybrid_sliding")


@dataclass(frozen=True)
class Layout:
    """What the target's layers need from a cache: every layer's cache type (transformers' names), the window of
    the sliding ones (None: none slides) and whether any layer carries recurrent state."""

    family: str  # config.model_type, for messages
    types: tuple[str, ...]
    window: int | None
    recurrent: bool

    @property
    def all_sliding(self) -> bool:
        """Every attention layer slides (Mistral, Phi-3): one windowed mask serves them all."""
        attention = [t for t in self.types if t in ("full_attention", "hybrid", *SLIDING_TYPES)]
        return all(t in SLIDING_TYPES for t in attention)


def _read_layout(config: PreTrainedConfig) -> Layout:
    text = config.get_text_config(decoder=True)
    types, kwargs = get_layer_types_and_kwargs(text)
    if "chunked_attention" in types:
        raise ValueError(
            f"{text.model_type} targets have chunked attention layers (attention_chunk_size): the verifier applies "
            "sliding windows but not chunks, so it would verify against other keys than the target sees"
        )
    windows = {kw["sliding_window"] for t, kw in zip(types, kwargs) if t in SLIDING_TYPES}
    if len(windows) > 1:
        raise ValueError(f"{text.model_type} targets with several sliding windows {sorted(windows)} are not supported")
    recurrent = any(issubclass(DYNAMIC_LAYER_TYPE_MAPPING[t], LinearAttentionCacheLayerMixin) for t in types)
    return Layout(text.model_type, tuple(types), windows.pop() if windows else None, recurrent)


# Read once per config object: transformers' layout takes a few hundred microseconds, more than a tiny verify
# step's host work. Configs are unhashable, so by id, with a weak reference that tells a reused id apart.
_LAYOUTS: dict[int, tuple[weakref.ref, Layout]] = {}


def layout(model: PreTrainedModel) -> Layout:
    """The cache layout of ``model`` (its config's, read once)."""
    config = model.config
    known = _LAYOUTS.get(id(config))
    if known is None or known[0]() is not config:
        for gone in [key for key, (ref, _) in _LAYOUTS.items() if ref() is None]:
            del _LAYOUTS[gone]
        known = (weakref.ref(config), _read_layout(config))
        _LAYOUTS[id(config)] = known
    return known[1]


def recurrent_target(model: PreTrainedModel) -> bool:
    """Whether some layer of ``model`` carries recurrent state (linear attention, Mamba, short convolutions)."""
    return layout(model).recurrent


def sliding_window(model: PreTrainedModel) -> int | None:
    """The window of ``model``'s sliding-window layers; None when no layer slides."""
    return layout(model).window


def why_chains(model: PreTrainedModel) -> str:
    """Why a recurrent target is verified on chains only, one sequence at a time (for messages)."""
    return (
        f"{layout(model).family} targets carry recurrent state (linear attention / Mamba layers) that runs through "
        "every row of a forward: tree siblings and batch padding would flow into it, and it cannot be cropped back"
    )


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for ``model`` that keeps every position of every attention layer.

    transformers' cache for a sliding layer keeps only its last window, which the gather and crop of rejected
    tree rows cannot undo; here such a layer keeps everything and ``layer_masks`` applies the window instead.
    Recurrent layers stay as transformers builds them (their states are snapshot and restored by the verifier).
    """
    cache = DynamicCache(config=model.config)
    if sliding_window(model) is not None:
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, LinearAttentionCacheLayerMixin) and getattr(layer, "is_sliding", False):
                cache.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
            elif getattr(layer, "is_sliding", False):
                cache.layers[i] = DynamicLayer()
    return cache


class SlotLayer(DynamicLayer):
    """An attention layer's keys and values in [1, kv_heads, capacity, head_dim] buffers, the layer of
    ``decoding.static_cache``'s static cache.

    ``update`` writes a forward's rows at ``position`` (a device tensor, so that a replayed CUDA graph writes where
    the sequence is now, and advances it) and returns the whole buffers; ``length`` counts the rows on the host. A
    commit or crop (``commit_rows``, ``crop_attention``) sets both; rows past ``length`` are stale, and masked."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.position: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states.new_zeros(*key_states.shape[:2], self.capacity, key_states.shape[3])
        self.values = value_states.new_zeros(*value_states.shape[:2], self.capacity, value_states.shape[3])
        self.position = torch.full((1,), self.length, dtype=torch.long, device=self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = key_states.shape[-2]
        if self.length + rows > self.capacity:
            raise ValueError(
                f"the static KV cache holds {self.capacity} positions and this forward needs {self.length + rows}: "
                "set it up with a larger capacity (prompt + new tokens + the largest tree's queries)"
            )
        assert self.position is not None and self.keys is not None and self.values is not None
        slots = self.position + torch.arange(rows, device=self.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self.position.add_(rows)
        self.length += rows
        return self.keys, self.values

    def set_length(self, length: int) -> None:
        """Keep the first ``length`` rows: the host count and the device position."""
        self.length = length
        if self.position is not None:
            self.position.fill_(length)

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.capacity, 0  # a mask transformers builds spans the buffer and hides the slots past the queries

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes the rows to remove as a negative count, got {tokens_to_remove}")
        self.set_length(max(self.length + tokens_to_remove, 0))


def target_forward(
    target: PreTrainedModel, cache: Cache, ids: torch.Tensor, masks: Any, positions: torch.Tensor, hidden: bool
) -> Any:
    """One decoding forward of ``target`` over ``ids`` into ``cache``, with ``layer_masks``' masks and explicit
    positions; ``hidden``: with every layer's hidden states."""
    return target(
        input_ids=ids,
        attention_mask=masks,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=hidden,
    )


def layer_masks(
    target: PreTrainedModel, mask: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor | None]:
    """The additive ``mask`` [B, 1, q, k] for every layer, windowed where the target's layers slide.

    A sliding layer's query at position p also loses the keys at positions <= p - sliding_window
    (transformers' ``sliding_window_overlay``). Positions, not cache slots: slots hold padding and rejected rows.
    When every attention layer slides (Mistral: its forward takes one mask) the windowed tensor serves all;
    when sliding and global layers mix, the mask per ``config.layer_types`` entry (the dict those families'
    forwards take; recurrent layers get None, i.e. no padding mask)."""
    plan = layout(target)
    if plan.window is None:
        return mask
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    sliding = mask.masked_fill(distance >= plan.window, torch.finfo(mask.dtype).min)
    if plan.all_sliding:
        return sliding
    per_type: dict[str, torch.Tensor | None] = {"full_attention": mask, "sliding_attention": sliding}
    for name in getattr(target.config.get_text_config(decoder=True), "layer_types", None) or ():
        per_type.setdefault(name, None)
    return per_type


def commit_rows(cache: Cache, prefix_len: int, rows: torch.Tensor) -> None:
    """Per sequence b, move the attention layers' cache slots ``rows[b]`` ([B, keep], after ``prefix_len``) to the
    slots right after the prefix and drop everything past them. Layers without keys (recurrent-only, shared-KV
    dummies) are left alone: ``restore_states`` handles recurrent state."""
    keep = rows.shape[1]
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None:
            continue
        for name in ("keys", "values"):
            t = getattr(layer, name)
            index = rows[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3])
            t[:, :, prefix_len : prefix_len + keep] = t.gather(2, index)
    crop_attention(cache, prefix_len + keep)


def crop_attention(cache: Cache, length: int) -> None:
    """Crop every attention layer to its first ``length`` slots. ``Cache.crop`` would also crop recurrent layers,
    which refuse (their state is not per position); a hybrid layer's attention part is cropped on its own."""
    for layer in cache.layers:
        if isinstance(layer, SlotLayer):
            layer.set_length(length)
        elif isinstance(layer, DynamicLayer) and layer.get_seq_length() > length:
            DynamicLayer.crop(layer, length - layer.get_seq_length())  # a negative count: rows to drop


# Per recurrent layer: its conv states, recurrent states and has-previous-state flags (None where uninitialised).
States = list[tuple[dict, dict, dict]]


def snapshot_states(cache: Cache) -> States:
    """Copies of every recurrent layer's states, which a forward updates in place."""

    def copies(states: dict) -> dict:
        return {i: None if s is None else s.clone() for i, s in states.items()}

    return [
        (copies(layer.conv_states), copies(layer.recurrent_states), dict(layer.has_previous_state))
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin)
    ]


def restore_states(cache: Cache, saved: States) -> None:
    """Put every recurrent layer's states back as ``snapshot_states`` saw them. A state the forward created (an
    empty prefix) goes back to uninitialised, as transformers' ``reset`` leaves it."""
    layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    for layer, (conv, recurrent, previous) in zip(layers, saved):
        for states, saved_states in ((layer.conv_states, conv), (layer.recurrent_states, recurrent)):
            for i, state in saved_states.items():
                current = states[i]
                if current is None:
                    continue  # no forward created it since
                if state is None:
                    current.zero_()
                else:
                    current.copy_(state)
        layer.has_previous_state.update(previous)


def check_recurrent(target: PreTrainedModel, batch: int, tree: Tree | None = None) -> None:
    """Refuse what a recurrent target cannot verify exactly in one forward: several sequences (their padding
    would run through the state) or a tree that is not a chain (the recurrence would run through siblings)."""
    if batch > 1:
        raise ValueError(f"cannot decode {batch} sequences together: {why_chains(target)}; decode one at a time")
    if tree is not None and not is_chain(tree):
        raise ValueError(f"cannot verify a tree that is not a chain: {why_chains(target)}; draft chains")


# On a CPU, torch's matmuls run rows in blocks of 4 and a remainder of 2 or 3 rows on a slower kernel: SmolLM2's
# whole forward after 300 tokens (torch 2.13, 2-core AMD EPYC) took 60, 102, 121, 83, 90, 111, 131 and 80 ms for
# 1 to 8 new tokens (``python -m scripts.bench.verify_rows``, docs/BENCHMARKS.md). So on a CPU a verify forward of
# more than one query runs a multiple of 4, the extra queries padding that no row keeps. One query (plain
# decoding) stays one: its matrix-vector kernel is the fastest of all.
CPU_QUERY_MULTIPLE = 4


def verify_queries(device: torch.device, trees: list[Tree]) -> int:
    """The queries a verify forward over ``trees`` runs on ``device``: the root and the largest tree, on a CPU
    rounded up to a multiple of ``CPU_QUERY_MULTIPLE`` when there is a tree at all."""
    queries = 1 + max(len(tree) for tree in trees)
    if device.type != "cpu" or queries == 1:
        return queries
    return -(-queries // CPU_QUERY_MULTIPLE) * CPU_QUERY_MULTIPLE


class VerifyCache:
    """How a verify step runs on the target's ``cache``: the queries of its forward, the forward, and the commit of
    the accepted rows. This base is the dynamic cache's: padded queries, then the accepted rows gathered right after
    the prefix and the rest cropped."""

    def __init__(self, target: PreTrainedModel, cache: Cache) -> None:
        self.target, self.cache = target, cache

    def queries(self, trees: list[Tree]) -> int:
        """The queries of a forward over ``trees`` (ValueError for trees this cache cannot verify)."""
        return verify_queries(self.target.device, trees)

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor, hidden: bool
    ) -> Any:
        """The verify forward over ``ids`` [B, q] with the additive tree ``mask`` [B, 1, q, P + q], the queries'
        ``positions`` and every key's; ``hidden``: with every layer's hidden states."""
        masks = layer_masks(self.target, mask, positions, key_positions)
        return target_forward(self.target, self.cache, ids, masks, positions, hidden)

    def commit(self, prefix_len: int, rows: torch.Tensor) -> bool:
        """Keep each sequence's step rows ``rows`` [B, keep] (root, then accepted path) right after its first
        ``prefix_len`` slots and drop the rest. Returns whether that took another forward (a replay)."""
        commit_rows(self.cache, prefix_len, prefix_len + rows)
        return False


class ReplayingCache(VerifyCache):
    """A recurrent target's: one sequence and chains only, with no padding queries (all would run through the state).
    The forward saves the recurrent states first; a commit after a rejected draft puts them back and runs the
    accepted rows again (``rebuild_state``), since the states cannot drop the rejected rows."""

    def queries(self, trees: list[Tree]) -> int:
        check_recurrent(self.target, len(trees), trees[0])
        return 1 + len(trees[0])

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor, hidden: bool
    ) -> Any:
        self.ids, self.positions = ids, positions
        self.saved = snapshot_states(self.cache) if ids.shape[1] > 1 else None
        return super().forward(ids, mask, positions, key_positions, hidden)

    def needs_replay(self, rows: torch.Tensor) -> bool:
        """Whether the step rejected a drafted row: the states ran through rows that ``rows`` [1, keep] drop."""
        return rows.shape[1] < self.ids.shape[1]

    def commit(self, prefix_len: int, rows: torch.Tensor) -> bool:
        if not self.needs_replay(rows):
            return super().commit(prefix_len, rows)
        self.rebuild_state(prefix_len, rows[0])
        return True

    def rebuild_state(self, prefix_len: int, rows: torch.Tensor) -> None:
        """Put the states back as they were before the step, drop the step's attention rows and run the accepted
        ``rows`` (root + path) again, so every layer holds exactly the committed tokens. A chain's accepted rows are
        a prefix of what ran, so the verify forward's outputs for them were already exact; this forward only
        rebuilds the state."""
        assert self.saved is not None  # a step that drafted nothing rejects nothing
        restore_states(self.cache, self.saved)
        crop_attention(self.cache, prefix_len)
        # No mask: one sequence, no padding, so the target's own causal (and windowed) masks are the exact ones.
        ids, positions = self.ids[:, rows], self.positions[:, rows]
        self.target(input_ids=ids, position_ids=positions, past_key_values=self.cache, use_cache=True)
