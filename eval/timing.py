"""Measurement on the machine at hand: drafting vs target time inside decoding runs, the verify and
drafting cost curves the tree model (``eval.speedup.Costs``) interpolates, peak memory and the machine's
name. Every clock read goes through ``core.timing`` (device-synchronised)."""

from __future__ import annotations

import platform
import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from headstart.core.timing import clock, timed
from headstart.core.vision import TEXT_POSITIONS, DraftPositions
from headstart.decoding.proposers import DepthRecorder
from headstart.decoding.proposers_heads import Drafter, DraftSource, head_drafter
from headstart.decoding.tree import Tree, chain
from headstart.decoding.verify import Proposer, Sampling, new_cache, verify_batch
from headstart.eval.speedup import Costs

VERIFY_NODES = (0, 1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64)
DRAFT_WIDTHS = (1, 2, 4, 8)


class TimedProposer(DepthRecorder):
    """A proposer wrapper that times drafting apart from the target's forwards (hooked on the target).

    Only decoding steps count: the target's prompt prefill and the drafter's first read of the prompt
    features (``update`` before the first ``propose``) are left out, as the speedup model has no term
    for them. A draft model reads the prompt inside its first ``propose``, which therefore counts.
    """

    def __init__(self, proposer: Proposer, device: torch.device) -> None:
        super().__init__(proposer)
        self.device = device
        self.draft_s = self.target_s = 0.0
        self.target_calls, self.decoding, self._start = 0, False, 0.0

    def reset(self, sampling: Sampling, positions: DraftPositions = TEXT_POSITIONS) -> None:
        self.decoding = False
        super().reset(sampling, positions)

    def propose(self, tokens: torch.Tensor) -> Tree:
        self.decoding = True
        tree, seconds = timed(self.device, super().propose, tokens)
        self.draft_s += seconds
        return tree

    def update(self, tokens: torch.Tensor, hidden: torch.Tensor | None) -> None:
        _, seconds = timed(self.device, self.proposer.update, tokens, hidden)
        if self.decoding:
            self.draft_s += seconds

    def before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._start = clock(self.device)

    def after_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.decoding:
            self.target_s += clock(self.device) - self._start
            self.target_calls += 1


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the most memory allocated since the last reset of the peak statistics; CPU: the process's
    peak resident set so far."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss: in KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def machine(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")  # Linux names the model here; platform.processor() often is empty
    if cpuinfo.is_file():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return f"{cpu}, {torch.get_num_threads()} torch threads"


def _ms(device: torch.device, fn: Callable[..., Any], *args: Any) -> float:
    return timed(device, fn, *args)[1] * 1e3


@torch.no_grad()
def measure_verify(
    target: PreTrainedModel, context: torch.Tensor, nodes: Sequence[int], batches: Sequence[int], repeats: int
) -> dict[int, list[float]]:
    """Median ms of one verification step (forward, acceptance, KV commit) of ``batches`` sequences over a
    chain of n nodes, at KV length len(context); the cache is cropped back after every step."""
    out: dict[int, list[float]] = {}
    for batch in batches:
        cache = new_cache(target)
        rows = context[None].expand(batch, -1)
        target(rows[:, :-1], past_key_values=cache, use_cache=True)
        length = cache.get_seq_length()
        valid = torch.ones(batch, length, dtype=torch.bool, device=context.device)
        ms = []
        for n in nodes:
            trees, roots = [chain(context[:n])] * batch, rows[:, -1]
            times = []
            for _ in range(repeats + 1):  # the first step of a shape warms up (a GPU picks its kernels) untimed
                times.append(_ms(context.device, verify_batch, target, cache, valid, roots, trees, Sampling()))
                cache.crop(length - cache.get_seq_length())
            ms.append(statistics.median(times[1:]))
        out[batch] = ms
    return out


def drafting_tokens(widths: Sequence[int], repeats: int, accepted: int) -> int:
    """Context tokens ``measure_drafting`` commits after its start (each cycle's warm-up included)."""
    return 2 * len(widths) * (repeats + 1) * (accepted + 1)


@torch.no_grad()
def measure_drafting(
    proposer: Drafter,
    target: PreTrainedModel,
    context: torch.Tensor,
    start: int,
    widths: Sequence[int],
    repeats: int,
    accepted: int = 2,
) -> tuple[float, list[float]]:
    """(base ms, [ms of one drafting level per width]) from propose/update cycles of ``proposer`` (one that
    takes ``choices``) on the target's real features of ``context``, from KV length ``start`` on.

    Each cycle proposes, then commits the next ``accepted`` + 1 context tokens, as decoding does. k parallel
    chains of depth 3 cost two drafting levels of width k more than k children of the root alone; the
    base is the latter, the commit (the head reading the accepted rows) included. Both count propose and
    commit: P-EAGLE drafts every depth in the commit's one forward, so its levels cost mask slots there.
    """
    if len(context) < start + drafting_tokens(widths, repeats, accepted) + 1:
        raise ValueError(f"a context of {len(context)} tokens is too short to measure drafting from {start}")
    states = target(context[None, :-1], output_hidden_states=True).hidden_states
    hidden = torch.cat([states[i][0] for i in proposer.hidden_layers], -1) if proposer.hidden_layers else None
    m = accepted + 1

    def cycles(choices: list[list[int]]) -> tuple[float, float]:
        nonlocal start
        proposer.reset(Sampling())
        proposer.choices = choices
        proposer.update(context[: start + 1], None if hidden is None else hidden[:start])
        propose_ms, update_ms = [], []
        for _ in range(repeats + 1):  # the first cycle of a tree shape warms up untimed
            propose_ms.append(_ms(context.device, proposer.propose, context[: start + 1]))
            rows = None if hidden is None else hidden[start : start + m]
            update_ms.append(_ms(context.device, proposer.update, context[: start + 1 + m], rows))
            start += m
        return statistics.median(propose_ms[1:]), statistics.median(update_ms[1:])

    level_ms, base = [], []
    for k in widths:
        one = sum(cycles([[r] for r in range(k)]))
        three = sum(cycles([[r] + [0] * d for r in range(k) for d in range(3)]))
        level_ms.append(max(three - one, 0.0) / 2)
        base.append(one)
    return statistics.median(base), level_ms


def measure_costs(
    target: PreTrainedModel,
    head: DraftSource,
    decoded: list[torch.Tensor],
    kv_length: int,
    max_nodes: int,
    batches: Sequence[int],
    repeats: int,
    verify_ms: dict[int, list[float]] | None = None,
) -> Costs:
    """The verify curve (``VERIFY_NODES`` up to ``max_nodes``, for each batch size; ``verify_ms`` when already
    measured) at KV length ``kv_length`` and the head's drafting costs (``DRAFT_WIDTHS``), on a context of
    ``decoded`` sequences repeated to the length the measurements need."""
    context = torch.cat(decoded)
    needed = kv_length + drafting_tokens(DRAFT_WIDTHS, repeats, 2) + 1
    context = context.repeat(needed // len(context) + 1)[:needed]
    nodes = [n for n in VERIFY_NODES if n <= max_nodes]
    verify_ms = verify_ms or measure_verify(target, context[: kv_length + 1], nodes, batches, repeats)
    base_ms, level_ms = measure_drafting(head_drafter(head), target, context, kv_length, DRAFT_WIDTHS, repeats)
    return Costs(nodes, verify_ms, list(DRAFT_WIDTHS), level_ms, base_ms)
