"""A method's result in an acceptance report: what ``eval.run.summarize`` makes, ``eval.acceptance`` completes,
``eval.report`` writes (report.json's ``methods.<name>``) and renders, ``eval.matrix`` tallies, and the scripts that
read a report back (``scripts.dev.gpu_check``) read through ``MethodResult.from_json``.

The fields are report.json's keys, in its order: ``to_json`` writes exactly the dict eval wrote before the record
existed (same keys, same order, the values as computed, no rounding), so report.json stays byte for byte the same.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def _fields_of(cls: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    """``data``'s values of ``cls``'s fields; a ValueError naming the keys when one without a default is missing or
    one is not a field (a key added to reports must be added here too)."""
    known = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing, unknown = sorted(required - data.keys()), sorted(data.keys() - known)
    if missing or unknown:
        raise ValueError(f"not {what}: missing keys {missing}, unknown keys {unknown}")
    return {name: data[name] for name in known & data.keys()}


@dataclass(frozen=True)
class CategoryResult:
    """One benchmark category of a method's result: report.json's ``methods.<name>.per_category.<cat>``."""

    tau: float
    target_forwards: int
    tokens_per_s: float
    speedup_vs_vanilla: float = 0.0  # over vanilla's tokens/s on the category (0.0: none; reports before it: absent)

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CategoryResult:
        return cls(**_fields_of(cls, data, "a category result"))


@dataclass(frozen=True)
class MethodResult:
    """One method over a benchmark: report.json's ``methods.<name>`` (``eval.report`` says what each key means)."""

    tau: float
    acceptance_by_depth: list[float | None]  # rate of depth d given d - 1; None: never tried
    alpha: float
    mean_accepted: float
    target_forwards: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float
    speedup_vs_vanilla: float
    draft_depth: int  # k: the deepest tree drafted
    draft_cost_ratio: float  # c
    target_forward_ms: float
    predicted_speedup: float
    peak_memory_mb: float
    greedy_identical: bool | None  # None when sampling
    mismatched_prompts: list[str]
    per_category: dict[str, CategoryResult]
    requested: bool = True  # False: vanilla, run anyway as the speedup baseline
    predicted_tau: float | None = None  # the head's training-time chain prediction (config.json "training")
    training_measured_tau: float | None = None  # the tau training measured by decoding
    tree_config: dict[str, Any] | None = None  # the tree.json an EAGLE method decoded with; None: the tree flags
    drafted_nodes: int = 0  # the largest tree drafted (with draft_depth: the tree that ran, whatever was asked)
    divergences: list[dict[str, Any]] = field(default_factory=list)  # per mismatch: ``eval.run.divergence``

    def to_json(self) -> dict[str, Any]:
        """report.json's entry: the fields in order, the categories as their dicts."""
        entry = {f.name: getattr(self, f.name) for f in fields(self)}
        return entry | {"per_category": {cat: c.to_json() for cat, c in self.per_category.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MethodResult:
        """A report.json entry back as the record; ValueError naming the keys when it is not one."""
        values = _fields_of(cls, data, "a method result")
        categories = {cat: CategoryResult.from_json(c) for cat, c in values["per_category"].items()}
        return cls(**values | {"per_category": categories})


def methods_json(methods: dict[str, MethodResult]) -> dict[str, dict[str, Any]]:
    """report.json's ``methods``: each method's entry, in run order."""
    return {name: result.to_json() for name, result in methods.items()}


def read_methods(report: dict[str, Any]) -> dict[str, MethodResult]:
    """A loaded report.json's ``methods`` as records."""
    return {name: MethodResult.from_json(entry) for name, entry in report["methods"].items()}
