"""Tree specifications and tree.json, the file that carries a tuned tree from ``eval.autotune`` to its readers.

tree.json (written by ``python -m eval.autotune``; read by ``eval.acceptance --tree FILE``, which also finds
it in a head's folder, and by the exports' model cards, ``export.card``):

- shape: "static" (``choices``: Medusa-style rank paths, drafted by ``decoding.tree.shaped_tree``) or "dynamic"
  (EAGLE-2: ``top_k`` children per expanded node, ``depth`` levels, ``total_tokens`` nodes kept);
- depth, top_k (static: the most children of any node), total_tokens (draft nodes, the root excluded);
- min_confidence (optional, 0 = fixed depth): drafting stops at the first level whose best node's estimated
  acceptance is below it (``decoding.tree.confident``): its cumulative draft probability (EAGLE heads, draft
  models), DSpark's confidence head;
- depth_per_batch_size (optional): [[first, last, depth], ...] batch-size ranges and the deepest level
  ``decoding.verify.generate_batch`` verifies when that many sequences decode together (0: plain decoding);
  num_speculative_tokens_per_batch_size: the same for vLLM's chains, in the form vLLM's speculative config
  takes (``vllm/v1/spec_decode/dynamic/utils.py``);
- plus what the tuner predicted and where it ran (machine, device, dtype, torch_threads, ...).

Every reader gets it through ``load_tree_config`` (its content: what the model cards and reports print) or
``load_tree`` (the tree to draft; a tree given in code through ``TreeSpec.from_config``): one schema, ``TreeFile``
(strict types, ranges, no unknown key) plus the rules across keys and vLLM's schedule rules (``check_tree``), each
problem named with the file, the key and the value; where the drafter is known, its vocabulary bounds the ranks
(``check_tree_vocab``).

``TreeSpec`` is the one tree model: a tree.json parses into it, the tree flags do (``decoding.methods
.TreeSettings.tree_spec``), eval.autotune's candidates are made of it, and the drafters draft it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, cast, get_args

from pydantic import Field

from headstart.core.settings import Count, Dtype, Fraction, NonNegative, Registered, Section, check
from headstart.heads import draftings

TreeShape = Literal["static", "dynamic"]
TREE_SHAPES: tuple[TreeShape, ...] = get_args(TreeShape)
TREE_KEYS = ("shape", "choices", "depth", "top_k", "total_tokens")
SCHEDULE_KEYS = ("depth_per_batch_size", "num_speculative_tokens_per_batch_size")
PREDICTED_KEYS = ("predicted_tau", "predicted_tokens_per_s", "predicted_vanilla_tokens_per_s")
EAGLE_DEFAULT: dict[str, Any] = {
    "shape": "dynamic",
    "total_tokens": 60,
    "depth": 6,
    "top_k": 10,
}  # EAGLE-2's published default

# A JSON number, strictly: unlike core.settings' Float, no numeric string (JSON has no YAML 1.1 quirk to allow for).
Number = Annotated[float, Field(allow_inf_nan=False)]
RankPath = Annotated[list[NonNegative], Field(min_length=1)]  # a node: its ancestors' candidate ranks, then its own


def drafting_methods() -> tuple[str, ...]:
    """What a tree.json may say it was tuned for: a registered head type's drafting method, or a draft model."""
    return (*draftings(), "draft_model", "self_spec")


class TreeFile(Section):
    """tree.json, the one schema of every reader (``check_tree``): the tree, what the tuner predicted for it and
    where it was tuned. The tree reaches the drafters as a ``TreeSpec`` (``load_tree``); the cards and reports print
    the keys a file holds as written (``load_tree_config``), so the defaults of the optional keys below are never
    printed; none of them takes null, which a reader would print or compare."""

    shape: TreeShape
    choices: list[RankPath] | None = None  # static: the rank paths; dynamic: null
    depth: Count
    top_k: Count
    total_tokens: Count
    min_confidence: Annotated[Number, Field(ge=0, le=1)] = 0.0  # an estimated acceptance of the best path
    # [[first, last, depth], ...]: checked by check_schedule, with vLLM's own rules and messages
    depth_per_batch_size: list[Any] = []
    num_speculative_tokens_per_batch_size: list[Any] = []
    predicted_tau: Annotated[Number, Field(ge=1)] = 1.0  # tokens per target forward: the target's own one at least
    predicted_tokens_per_s: Annotated[Number, Field(ge=0)] = 0.0
    predicted_vanilla_tokens_per_s: Annotated[Number, Field(ge=0)] = 0.0
    speculate_max_batch: NonNegative = 0
    # Where it was tuned (eval.autotune's meta).
    machine: str = ""
    device: str = ""
    dtype: Dtype = "fp32"
    torch_threads: Count = 1
    target: str = ""
    head: str = ""
    # The drafter it was tuned for (a head's drafting method, heads.drafting_of, or the two drafters without a head);
    # eval.acceptance gives a draft_model or self_spec tree to that method, and self_spec drafts with the target's
    # first exit_layer.
    method: Annotated[str, Registered(drafting_methods)] | None = None
    exit_layer: Count | None = None
    bench: str = ""
    prompt_format: Literal["chat", "raw"] | None = None  # how the tuning prompts were rendered (data_recipes.prompts)
    batch_size: Count = 1
    tuned_at: str = ""


def _static_rules(tree: TreeFile) -> list[str]:
    """A static tree's paths form a tree, and its depth, top_k and total_tokens are the ones its paths give (the
    model card prints them; the drafters read the paths)."""
    if not tree.choices:
        return [f"choices: a static tree needs a non-empty list of rank paths, got {tree.choices!r}"]
    paths = [tuple(path) for path in tree.choices]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    problems = [f"choices has {list(p)} more than once" for p in twice]
    orphans = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
    problems += [f"choices {list(p)} lacks its parent path {list(p[:-1])}" for p in orphans]
    implied = TreeSpec.static(tree.choices)
    for key, what in (("depth", "the longest path in choices"), ("top_k", "the highest rank in choices, plus one"),
                      ("total_tokens", "the paths in choices")):  # fmt: skip
        if getattr(tree, key) != getattr(implied, key):
            problems.append(f"{key} must be {getattr(implied, key)} ({what}), got {getattr(tree, key)}")
    return problems


def _tree_rules(tree: TreeFile, given: dict) -> list[str]:
    """The rules across keys, once each key is of its type."""
    if tree.shape == "static":
        problems = _static_rules(tree)
    else:
        problems = [] if tree.choices is None else [f"choices: a dynamic tree has null, got {tree.choices!r}"]
    # The card prints the three predictions together.
    predicted = [k for k in PREDICTED_KEYS if k in given]
    if predicted and len(predicted) < len(PREDICTED_KEYS):
        problems.append(f"{', '.join(PREDICTED_KEYS)} come together, got only {predicted}")
    return problems


def check_tree(config: object, where: str) -> TreeFile:
    """``config`` (a tree.json's content, or a tree config given in code) checked against ``TreeFile`` and the
    schedule rules; ValueError naming ``where``, each key and its value."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object of tree keys, got {type(config).__name__}")
    tree, problems = check(config, TreeFile)
    problems = problems if tree is None else _tree_rules(tree, config)
    if tree is None or problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    for key in SCHEDULE_KEYS:
        if key in config:
            check_schedule(config[key], f"{where}: {key}")
    return tree


def check_tree_vocab(tree: TreeSpec, vocab_size: int, where: str, drafter: str) -> None:
    """A tree needs no candidate past the drafter's vocabulary (torch's topk fails on it with no word of the file):
    ValueError naming ``where``, the key and the value."""
    if tree.top_k <= vocab_size:
        return
    if tree.shape == "static":
        path = next(p for p in tree.choices or [] if p[-1] + 1 == tree.top_k)
        what = f"choices {path}: rank {path[-1]}"
    else:
        what = f"top_k {tree.top_k}"
    raise ValueError(
        f"{where}: {what} is past the {vocab_size} tokens {drafter} drafts from (ranks 0..{vocab_size - 1})"
    )


class TreeSpec(Section):
    """A tree to draft: a static shape (``choices``: Medusa-style rank paths) or a dynamic EAGLE-2 tree (top_k,
    depth, total_tokens), from a tree.json (``load_tree``), from code, or from the tree flags
    (``decoding.methods.TreeSettings.tree_spec``), where ``shape`` None leaves each method its usual tree and a
    static shape without ``choices`` is each method's chain of ``depth`` (``decoding.methods.build_proposer``)."""

    shape: TreeShape | None
    depth: NonNegative
    top_k: NonNegative  # static: the most children any node has; dynamic: children per expanded node
    total_tokens: NonNegative  # draft nodes, root excluded
    choices: list[list[NonNegative]] | None = None
    min_confidence: Fraction = 0.0  # adaptive depth (``decoding.tree.confident``); 0: always the full depth
    exit_layer: Count | None = None  # self_spec: the target's first N layers draft (None: half of them)
    # The drafter a tree.json was tuned for (``TreeFile.method``): its draft_model and self_spec trees go to them.
    method: str | None = None
    file: Path | None = None  # the tree.json it was read from (the flags' --tree FILE)

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
    def static(cls, choices: Sequence[Sequence[int]], min_confidence: float = 0.0) -> TreeSpec:
        ordered = sorted((list(c) for c in choices), key=lambda c: (len(c), c))
        depth, top_k = max((len(c) for c in ordered), default=0), max((c[-1] + 1 for c in ordered), default=0)
        return cls(
            shape="static", depth=depth, top_k=top_k, total_tokens=len(ordered), choices=ordered,
            min_confidence=min_confidence,
        )  # fmt: skip

    @classmethod
    def dynamic(cls, depth: int, top_k: int, total_tokens: int, min_confidence: float = 0.0) -> TreeSpec:
        return cls(shape="dynamic", depth=depth, top_k=top_k, total_tokens=total_tokens, min_confidence=min_confidence)

    @classmethod
    def from_config(cls, config: object, where: str = "tree config", file: Path | None = None) -> TreeSpec:
        """The tree of a tree.json's content (or one given in code), checked first (``check_tree``)."""
        tree = check_tree(config, where)
        if tree.shape == "static":
            spec = cls.static(tree.choices or [], tree.min_confidence)
        else:
            spec = cls.dynamic(tree.depth, tree.top_k, tree.total_tokens, tree.min_confidence)
        return spec.model_copy(update={"exit_layer": tree.exit_layer, "method": tree.method, "file": file})

    def config(self) -> dict:
        return {"shape": self.shape, "choices": self.choices, "depth": self.depth, "top_k": self.top_k,
                "total_tokens": self.total_tokens, "min_confidence": self.min_confidence}  # fmt: skip

    def capped(self, depth: int) -> TreeSpec:
        """A static tree without its paths deeper than ``depth`` (vanilla at 0)."""
        if self.shape != "static":
            raise ValueError(f"only a static tree can be cut at a depth, not the {self.name} tree")
        return TreeSpec.static([c for c in self.choices or [] if len(c) <= depth], self.min_confidence)


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
        # type() is int: a JSON true is an int to isinstance, and vLLM's int check would take it as a depth of 1.
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(v) is int and v >= 0 for v in entry)):
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


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from err


def load_tree_config(path: str | Path) -> dict:
    """A tree.json's content, checked (``check_tree``): its keys as written, for what prints or records them (the
    model cards, eval's report, ``scripts.export.verify_engines --schedule``)."""
    config = _read_json(Path(path))
    check_tree(config, str(path))
    return cast(dict, config)


def load_tree(path: str | Path) -> TreeSpec:
    """The tree a tree.json holds, checked (``check_tree``): what the drafters draft (``eval.acceptance``)."""
    return TreeSpec.from_config(_read_json(Path(path)), str(path), Path(path))
