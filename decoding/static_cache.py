"""The target's KV cache in fixed buffers, and its decoding forwards replayed as CUDA graphs (gpt-fast's recipe).

A GPU decodes a small target launch-bound: a forward of a 22M model is hundreds of kernel launches, each far
longer to issue than to run. A CUDA graph replays them all from one launch, but only over the same memory with
the same shapes. So, once ``setup_static_cache(target, capacity)`` has been called:

- every attention layer keeps its keys and values in buffers of ``capacity`` slots (``target_cache.SlotLayer``),
  written in place at a position the device holds, and each forward attends over the whole buffer, the mask hiding
  the slots past the committed ones: the shapes no longer change as the sequence grows;
- a verify step (``StaticVerifyCache``) rounds its queries up to a bucket (``QUERY_BUCKETS``: padding queries see
  only the root and are ignored, as on a CPU already) and runs the forward through ``StaticDecoding.forward``: on
  CUDA one graph per bucket, captured at its first use and replayed after; on a CPU the same buffers and masks,
  eagerly (what the suite checks token for token against the dynamic cache).

One sequence at a time (``decoding.verify.generate``): several sequences decode with the dynamic cache as
before. Targets with recurrent state keep the dynamic cache too (their state is snapshot and replayed). The
engine lives on the target, as gpt-fast's ``setup_caches``: its buffers and graphs are reused by every sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import Cache, PreTrainedModel

from headstart.decoding.target_cache import SlotLayer, VerifyCache, layer_masks, recurrent_target, target_forward
from headstart.decoding.tree import Tree

QUERY_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # a verify forward's queries, rounded up: one graph each
ENGINE_ATTRIBUTE = "_headstart_static_decoding"


class StaticCache(Cache):
    """The target's cache of ``SlotLayer``s for one sequence, reset for each (``StaticDecoding.cache``)."""

    def __init__(self, layers: list[SlotLayer], engine: StaticDecoding) -> None:
        super().__init__(layers=list(layers))
        self.engine = engine


@dataclass
class GraphedStep:
    """One bucket's captured forward: its input buffers, its outputs and the graph writing them."""

    graph: Any
    ids: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    out: Any


@dataclass
class StaticDecoding:
    """The static cache and the graphs of ``target``'s decoding forwards (see the module docstring)."""

    target: PreTrainedModel
    capacity: int
    graphs: bool
    layers: list[SlotLayer] = field(default_factory=list)
    steps: dict[tuple[int, bool], GraphedStep] = field(default_factory=dict)

    def cache(self) -> StaticCache:
        """The cache, emptied for a new sequence (its buffers, and the graphs that read them, are kept)."""
        if not self.layers:
            count = self.target.config.get_text_config(decoder=True).num_hidden_layers
            self.layers = [SlotLayer(self.capacity) for _ in range(count)]
        for layer in self.layers:
            layer.set_length(0)
        return StaticCache(self.layers, self)

    def forward(self, ids: torch.Tensor, mask: Any, positions: torch.Tensor, hidden: bool) -> Any:
        """The target's forward over ``ids`` [1, q] (q a bucket) with ``mask`` spanning the buffer: replayed from its
        graph on CUDA once captured, eager otherwise. Returns the model output (logits, hidden states)."""
        if not self.graphs:
            return self._eager(ids, mask, positions, hidden)
        key = (ids.shape[1], hidden)
        step = self.steps.get(key) or self._capture(ids, mask, positions, hidden)
        self.steps[key] = step
        step.ids.copy_(ids)
        step.positions.copy_(positions)
        _copy_mask(step.mask, mask)
        step.graph.replay()  # writes its rows at each layer's device position and advances it
        for layer in self.layers:
            layer.length += ids.shape[1]
        return step.out

    def _eager(self, ids: torch.Tensor, mask: Any, positions: torch.Tensor, hidden: bool) -> Any:
        return target_forward(self.target, StaticCache(self.layers, self), ids, mask, positions, hidden)

    def _capture(self, ids: torch.Tensor, mask: Any, positions: torch.Tensor, hidden: bool) -> GraphedStep:
        """Warm the bucket's forward up on a side stream (CUDA's rule before a capture), then capture it over
        copies of the inputs; neither run's rows are kept (the lengths go back)."""
        lengths = [layer.length for layer in self.layers]
        step_ids, step_positions, step_mask = ids.clone(), positions.clone(), _clone_mask(mask)
        stream = torch.cuda.Stream(device=ids.device)
        stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(stream):
            self._eager(step_ids, step_mask, step_positions, hidden)
        torch.cuda.current_stream(ids.device).wait_stream(stream)
        self._reset(lengths)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._eager(step_ids, step_mask, step_positions, hidden)
        self._reset(lengths)
        return GraphedStep(graph, step_ids, step_mask, step_positions, out)

    def _reset(self, lengths: list[int]) -> None:
        for layer, length in zip(self.layers, lengths, strict=True):
            layer.set_length(length)


class StaticVerifyCache(VerifyCache):
    """A verify step on the static cache: its queries rounded up to a bucket, its mask spanning the whole buffer and
    its forward through the engine (the bucket's graph on CUDA); the commit is the dynamic cache's."""

    def __init__(self, target: PreTrainedModel, cache: StaticCache) -> None:
        super().__init__(target, cache)
        self.engine = cache.engine

    def queries(self, trees: list[Tree]) -> int:
        return bucket(super().queries(trees))

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, key_positions: torch.Tensor, hidden: bool
    ) -> Any:
        # The keys are the whole buffer: its slots past this step's rows are hidden.
        mask, key_positions = span_buffer(mask, key_positions, self.engine.capacity)
        return self.engine.forward(ids, layer_masks(self.target, mask, positions, key_positions), positions, hidden)


def _clone_mask(mask: Any) -> Any:
    return {k: None if v is None else v.clone() for k, v in mask.items()} if isinstance(mask, dict) else mask.clone()


def _copy_mask(into: Any, mask: Any) -> None:
    if isinstance(mask, dict):
        for key, value in mask.items():
            if value is not None:
                into[key].copy_(value)
    else:
        into.copy_(mask)


def setup_static_cache(target: PreTrainedModel, capacity: int, graphs: bool | None = None) -> StaticDecoding:
    """Decode ``target`` one sequence at a time with a static cache of ``capacity`` positions (prompt, new tokens
    and the largest tree); ``graphs`` (default: on CUDA) replays each bucket's forward as a CUDA graph."""
    if recurrent_target(target):
        raise ValueError(
            "a target with recurrent state (linear attention / Mamba layers) decodes with the dynamic cache: its "
            "state is snapshot and replayed, which a static cache does not do"
        )
    graphs = target.device.type == "cuda" if graphs is None else graphs
    if graphs and target.device.type != "cuda":
        raise ValueError(f"CUDA graphs need a CUDA target; this one is on {target.device}")
    engine = StaticDecoding(target, capacity, graphs)
    setattr(target, ENGINE_ATTRIBUTE, engine)
    return engine


def clear_static_cache(target: PreTrainedModel) -> None:
    """Back to the dynamic cache: the engine, its buffers and graphs go."""
    if hasattr(target, ENGINE_ATTRIBUTE):
        delattr(target, ENGINE_ATTRIBUTE)


def static_decoding(target: PreTrainedModel) -> StaticDecoding | None:
    """The engine ``setup_static_cache`` put on ``target``, if any."""
    return getattr(target, ENGINE_ATTRIBUTE, None)


def span_buffer(mask: torch.Tensor, key_positions: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's additive ``mask`` [B, 1, q, P + q] and ``key_positions`` [B, P + q] widened to the buffer's
    ``capacity`` keys, the slots past the step's rows hidden (their positions are never read)."""
    extra = capacity - mask.shape[-1]
    if extra < 0:
        raise ValueError(f"the static KV cache holds {capacity} positions and this step needs {mask.shape[-1]}")
    return (
        F.pad(mask, (0, extra), value=torch.finfo(mask.dtype).min),
        F.pad(key_positions, (0, extra)),
    )


def bucket(queries: int) -> int:
    """The smallest ``QUERY_BUCKETS`` entry of at least ``queries`` (the queries themselves past the largest)."""
    return next((b for b in QUERY_BUCKETS if b >= queries), queries)
