"""Tree specifications and tree.json, the file that carries a tuned tree from ``eval.autotune`` to its readers.

tree.json (written by ``python -m eval.autotune``; read by ``eval.acceptance --tree FILE``, which also finds
it in a head's folder, and by the exports' model cards, ``scripts.formats.card``):

- shape: "static" (``choices``: Medusa-style rank paths, drafted by ``eval.tree.shaped_tree``) or "dynamic"
  (EAGLE-2: ``top_k`` children per expanded node, ``depth`` levels, ``total_tokens`` nodes kept);
- depth, top_k (static: the most children of any node), total_tokens (draft nodes, the root excluded);
- plus what the tuner predicted and where it ran (machine, device, dtype, torch_threads, ...).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from headstart.eval.speedup import Choice

TREE_KEYS = ("shape", "choices", "depth", "top_k", "total_tokens")
EAGLE_DEFAULT = {"shape": "dynamic", "total_tokens": 60, "depth": 6, "top_k": 10}  # EAGLE-2's published default


@dataclass
class TreeSpec:
    """A static shape (``choices``: Medusa-style rank paths) or a dynamic EAGLE-2 tree (top_k, depth, total)."""

    shape: str  # "static" or "dynamic"
    depth: int
    top_k: int  # static: the most children any node has; dynamic: children per expanded node
    total_tokens: int  # draft nodes, root excluded
    choices: list[list[int]] | None = None

    @property
    def name(self) -> str:
        if self.total_tokens == 0:
            return "vanilla"
        if self.shape == "dynamic":
            return f"dynamic k{self.top_k} d{self.depth} n{self.total_tokens}"
        if self.top_k == 1:
            return f"chain {self.depth}"
        return f"static {self.total_tokens} (d{self.depth} w{self.top_k})"

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
        if config["shape"] == "static":
            return cls.static(config["choices"])
        return cls("dynamic", int(config["depth"]), int(config["top_k"]), int(config["total_tokens"]))

    def config(self) -> dict:
        return {"shape": self.shape, "choices": self.choices, "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens}  # fmt: skip


def chain_choices(depth: int) -> list[list[int]]:
    return [[0] * d for d in range(1, depth + 1)]


def comb_choices(depth: int, width: int) -> list[list[int]]:
    """The rank-0 chain of ``depth`` with ``width`` candidates at every depth: one step shows the rank of the
    target's token among the head's candidates at the first depth the chain misses."""
    return [[0] * (d - 1) + [r] for d in range(1, depth + 1) for r in range(width)]


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
    return config


def head_tree_configs(heads: dict[str, str], tree: str | Path | None) -> dict[str, dict]:
    """EAGLE or DFlash method -> the tree.json it decodes with: ``tree`` when it is a file, else its head folder's
    tree.json (as ``eval.autotune --write-head`` leaves it); "static" or "dynamic" (the tree flags) and
    methods without one get none."""
    found = {}
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
