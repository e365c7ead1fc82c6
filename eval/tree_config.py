"""Tree specifications and tree.json, the file that carries a tuned tree from ``eval.autotune`` to its readers.

tree.json (written by ``python -m eval.autotune``; read by ``eval.acceptance --tree FILE``, which also finds
it in a head's folder, and by the exports' model cards, ``scripts.formats.card``):

- shape: "static" (``choices``: Medusa-style rank paths, drafted by ``eval.tree.shaped_tree``) or "dynamic"
  (EAGLE-2: ``top_k`` children per expanded node, ``depth`` levels, ``total_tokens`` nodes kept);
- depth, top_k (static: the most children of any node), total_tokens (draft nodes, the root excluded);
- min_confidence (optional, 0 = fixed depth): drafting stops at the first level whose best node's cumulative
  draft probability is below it (``eval.tree.confident``), EAGLE heads only;
- depth_per_batch_size (optional): [[first, last, depth], ...] batch-size ranges and the deepest level
  ``eval.verify.generate_batch`` verifies when that many sequences decode together (0: plain decoding);
  num_speculative_tokens_per_batch_size: the same for vLLM's chains, in the form vLLM's speculative config
  takes (``vllm/v1/spec_decode/dynamic/utils.py``);
- plus what the tuner predicted and where it ran (machine, device, dtype, torch_threads, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headstart.eval.speedup import Choice

TREE_KEYS = ("shape", "choices", "depth", "top_k", "total_tokens")
SCHEDULE_KEYS = ("depth_per_batch_size", "num_speculative_tokens_per_batch_size")
EAGLE_DEFAULT = {"shape": "dynamic", "total_tokens": 60, "depth": 6, "top_k": 10}  # EAGLE-2's published default


@dataclass
class TreeSpec:
    """A static shape (``choices``: Medusa-style rank paths) or a dynamic EAGLE-2 tree (top_k, depth, total)."""

    shape: str  # "static" or "dynamic"
    depth: int
    top_k: int  # static: the most children any node has; dynamic: children per expanded node
    total_tokens: int  # draft nodes, root excluded
    choices: list[list[int]] | None = None
    min_confidence: float = 0.0  # adaptive depth (``eval.tree.confident``); 0: always the full depth

    @property
    def name(self) -> str:
        if self.total_tokens == 0:
            return "vanilla"
        if self.shape == "dynamic":
            name = f"dynamic k{self.top_k} d{self.depth} n{self.total_tokens}"
        elif self.top_k == 1:
            name = f"chain {self.depth}"
        else:
            name = f"static {self.total_tokens} (d{self.depth} w{self.top_k})"
        return f"{name} conf>={self.min_confidence:.3g}" if self.min_confidence > 0 else name

    def level_widths(self) -> list[int]:
        """Nodes expanded by the drafter at each level below the first (the root's children need none)."""
        if self.shape == "dynamic":
            return [self.top_k] * (self.depth - 1)
        parents = {tuple(c[:-1]) for c in self.choices or [] if len(c) > 1}
        return [sum(len(p) == d for p in parents) for d in range(1, self.depth)]

    @classmethod
    def static(cls, choices: Sequence[Sequence[int]]) -> TreeSpec:
        ordered = sorted((list(c) for c in choices), key=lambda c: (len(c), c))
        depth = max((len(c) for c in ordered), default=0)
        return cls("static", depth, max((c[-1] + 1 for c in ordered), default=0), len(ordered), ordered)

    @classmethod
    def from_config(cls, config: dict) -> TreeSpec:
        confidence = float(config.get("min_confidence", 0.0))
        if config["shape"] == "static":
            return replace(cls.static(config["choices"]), min_confidence=confidence)
        depth, top_k, total = int(config["depth"]), int(config["top_k"]), int(config["total_tokens"])
        return cls("dynamic", depth, top_k, total, min_confidence=confidence)

    def config(self) -> dict:
        return {"shape": self.shape, "choices": self.choices, "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens, "min_confidence": self.min_confidence}  # fmt: skip

    def capped(self, depth: int) -> TreeSpec:
        """A static tree without its paths deeper than ``depth`` (vanilla at 0)."""
        if self.shape != "static":
            raise ValueError(f"only a static tree can be cut at a depth, not the {self.name} tree")
        cut = TreeSpec.static([c for c in self.choices or [] if len(c) <= depth])
        return replace(cut, min_confidence=self.min_confidence)


def chain_choices(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


def comb_choices(depth: int, width: int) -> list[list[int]]:
    """The rank-0 chain of ``depth`` with ``width`` candidates at every depth: one step shows the rank of the
    target's token among the head's candidates at the first depth the chain misses."""
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(width)]


# [[first batch size, last batch size, depth], ...]: vLLM's num_speculative_tokens_per_batch_size form.
Schedule = list[list[int]]


def schedule_ranges(depths: dict[int, int]) -> Schedule:
    """{measured batch size: depth} -> inclusive ranges from batch size 1 on, equal neighbours merged: a measured
    size's depth holds up to the next measured size; the largest one's carries on past it (as vLLM does)."""
    sizes = sorted(depths)
    ranges: Schedule = []
    for i, size in enumerate(sizes):
        first, last = (1 if i == 0 else size), (sizes[i + 1] - 1 if i + 1 < len(sizes) else size)
        if ranges and ranges[-1][2] == depths[size]:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, depths[size]])
    return ranges


def check_schedule(schedule: object, where: str) -> Schedule:
    """A schedule as vLLM accepts it (``vllm/v1/spec_decode/dynamic/utils.py``): [first, last, depth] entries of
    non-negative ints, ranges sorted, disjoint, the first starting at batch size 1."""
    if not isinstance(schedule, list) or not schedule:
        raise ValueError(f"{where}: expected a non-empty list of [first, last, depth] batch-size ranges")
    previous = 0
    for entry in schedule:
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(v, int) and v >= 0 for v in entry)):
            raise ValueError(f"{where}: {entry!r} is not [first, last, depth] of non-negative integers")
        if entry[0] <= previous or entry[0] > entry[1]:
            raise ValueError(f"{where}: range {entry[:2]} overlaps the one before it or ends before it starts")
        previous = entry[1]
    if schedule[0][0] != 1:
        raise ValueError(f"{where}: the first range must start at batch size 1, not {schedule[0][0]}")
    return schedule


def scheduled_depth(schedule: Schedule, batch: int) -> int:
    """The depth ``schedule`` gives ``batch`` sequences; between ranges and past the last, the depth before."""
    depth = schedule[0][2]
    for first, _, value in schedule:
        if batch < first:
            break
        depth = value
    return depth


def load_tree_config(path: str | Path) -> dict:
    """A tree.json, checked: the keys ``eval.acceptance`` and the model cards read."""
    path = Path(path)
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err
    missing = [k for k in TREE_KEYS if k not in config]
    if missing:
        raise ValueError(f"{path}: tree config lacks {missing}; expected keys {list(TREE_KEYS)}")
    if config["shape"] not in ("static", "dynamic"):
        raise ValueError(f"{path}: shape must be 'static' or 'dynamic', got {config['shape']!r}")
    if config["shape"] == "static" and not config["choices"]:
        raise ValueError(f"{path}: a static tree needs a non-empty 'choices' list")
    for key in SCHEDULE_KEYS:
        if key in config:
            check_schedule(config[key], f"{path}: {key}")
    return config


def head_tree_configs(heads: dict[str, str], tree: str | Path | None, methods: Sequence[str] = ()) -> dict[str, dict]:
    """EAGLE or DFlash method -> the tree.json it decodes with: ``tree`` when it is a file, else its head folder's
    tree.json (as ``eval.autotune --write-head`` leaves it); "static" or "dynamic" (the tree flags) and
    methods without one get none. A tree.json tuned for a draft model or self-speculation (its ``method``)
    goes to that one of ``methods``."""
    found = {}
    if isinstance(tree, Path):
        config = load_tree_config(tree)
        if config.get("method") in ("draft_model", "self_spec") and config["method"] in methods:
            if config["method"] == "self_spec" and not isinstance(config.get("exit_layer"), int):
                raise ValueError(
                    f"{tree}: a self_spec tree needs its 'exit_layer' (eval.autotune --self-spec writes it)"
                )
            found[config["method"]] = config
    for method, head_dir in heads.items():
        path = tree if isinstance(tree, Path) else Path(head_dir) / "tree.json"
        if method in ("eagle", "eagle3", "peagle", "dflash") and tree not in ("static", "dynamic") and path.is_file():
            found[method] = load_tree_config(path)
    return found


def tree_json(choice: Choice, vanilla: Choice, batch: dict[int, dict], meta: dict) -> dict:
    """tree.json: the chosen tree (``TREE_KEYS``), the model's tau and tokens/s for it and for vanilla,
    ``speculate_max_batch`` (the largest batch size of ``batch``, ``eval.speedup.batch_table``, at which the
    model still prefers speculation; 0: never), and where it was tuned (``meta``: machine, device, dtype, ...)."""
    return (
        choice.tree.config()
        | {
            "predicted_tau": choice.tau,
            "predicted_tokens_per_s": choice.tokens_per_s,
            "predicted_vanilla_tokens_per_s": vanilla.tokens_per_s,
            "speculate_max_batch": max((b for b, row in batch.items() if row["speculate"]), default=0),
        }
        | meta
    )
