"""The method x task x temperature matrix (issue #20): tau and speedup of every method per group of
Spec-Bench categories at several temperatures, checked against the speedup claims the project started from.

    python -m eval.acceptance ... --bench assets/data/spec_bench_question.jsonl \
        --temperatures 0,0.7,1.0 --per-group 4 --out runs/matrix

``eval.acceptance`` decodes the same prompts with every method at each temperature (``eval.run``); this
module picks the prompts, adds each run's categories up into groups, builds the matrix and checks the
claims; ``eval.report.write_matrix_report`` writes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from headstart.data_recipes.bench import BenchItem, round_robin
from headstart.eval.results import MethodResult
from headstart.eval.run import MethodRun, Tally

# Spec-Bench's categories grouped into the tasks the claims name: the one mapping. MT-bench's eight
# categories are Spec-Bench's multi-turn conversation task; of them coding and extraction are "code and
# structured extraction", writing and roleplay "creative writing", and the rest "chat". A category of no
# group (another benchmark's, e.g. gsm8k) is a group of its own.
GROUPS: dict[str, tuple[str, ...]] = {
    "coding-like": ("coding", "extraction"),
    "qa": ("qa",),
    "summarization": ("summarization",),
    "translation": ("translation",),
    "math": ("math_reasoning", "math"),
    "rag": ("rag",),
    "creative": ("writing", "roleplay"),
    "chat": ("reasoning", "stem", "humanities"),
}
CATEGORY_GROUP = {category: group for group, categories in GROUPS.items() for category in categories}

# The claims to check: (what, group, low, high) speedup over vanilla decoding per task.
SPEEDUP_CLAIMS = (
    ("code and structured extraction", "coding-like", 2.0, 3.5),
    ("chat", "chat", 1.5, 2.5),
    ("creative writing", "creative", 1.3, 1.8),
)


def group_of(category: str) -> str:
    return CATEGORY_GROUP.get(category, category)


def _by_group(values: list, category_of: Callable[[Any], str]) -> dict[str, list]:
    """``values`` per group, in file order within one; groups in ``GROUPS`` order, then the others in file order."""
    found: dict[str, list] = {}
    for value in values:
        found.setdefault(group_of(category_of(value)), []).append(value)
    order = [g for g in GROUPS if g in found] + [g for g in found if g not in GROUPS]
    return {group: found[group] for group in order}


def groups_of(categories: list[str]) -> dict[str, list[str]]:
    """Each group of ``categories`` -> its categories among them, as the matrix groups them."""
    return _by_group(list(dict.fromkeys(categories)), str)


def pick_per_group(items: list[BenchItem], per_group: int) -> list[BenchItem]:
    """``per_group`` items of each group, round-robin over its categories; groups in ``GROUPS`` order, then the
    others in file order. The same count per group, whatever its number of categories."""
    groups = _by_group(items, lambda item: item.category)
    return [item for members in groups.values() for item in round_robin(members, per_group)]


def group_tallies(run: MethodRun) -> dict[str, Tally]:
    """The run's per-category sums added up per group."""
    groups: dict[str, Tally] = {}
    for category, tally in run.by_category.items():
        groups.setdefault(group_of(category), Tally()).merge(tally)
    return groups


def _cell(tally: Tally, baseline: Tally) -> dict:
    return {
        "tau": tally.tau,
        "tokens_per_s": tally.tokens_per_s,
        "speedup": tally.speedup_over(baseline),
        "new_tokens": tally.new_tokens,
        "wall_s": tally.wall_s,
        "target_forwards": tally.forwards,
    }


def temperature_row(temperature: float, runs: dict[str, MethodRun], methods: dict[str, MethodResult]) -> dict:
    """One temperature of the matrix: per method its overall tau, tokens/s, speedup and greedy check (from
    ``methods``, the runs' results) and per group the same against vanilla's on that group."""
    baseline = group_tallies(runs["vanilla"])
    row: dict = {"temperature": temperature, "methods": {}}
    for method, run in runs.items():
        result = methods[method]
        row["methods"][method] = {
            "tau": result.tau,
            "tokens_per_s": result.tokens_per_s,
            "speedup": result.speedup_vs_vanilla,
            "greedy_identical": result.greedy_identical,
            "groups": {g: _cell(t, baseline[g]) for g, t in group_tallies(run).items()},
        }
    return row


def _best(row: dict, group: str) -> tuple[str, float] | None:
    """The drafting method with the highest speedup on ``group`` in ``row``; None when nothing measured it."""
    speedups = {
        m: e["groups"][group]["speedup"] for m, e in row["methods"].items() if m != "vanilla" and group in e["groups"]
    }
    if not speedups:
        return None
    method = max(speedups, key=speedups.__getitem__)
    return method, speedups[method]


def speedup_claims(row: dict) -> list[dict]:
    """Each speedup claim against the best method's speedup on its group in ``row`` (greedy, the lowest
    temperature): holds when it reaches the claimed low end."""
    checks = []
    for claim, group, low, high in SPEEDUP_CLAIMS:
        best = _best(row, group)
        check = {"claim": f"{claim}: {low}-{high}x", "group": group, "low": low, "high": high}
        if best is None:
            checks.append(check | {"method": None, "speedup": None, "verdict": "not measured (no prompt of it)"})
            continue
        method, speedup = best
        verdict = "holds" if low <= speedup <= high else "holds (above the range)" if speedup > high else None
        checks.append(check | {"method": method, "speedup": speedup, "verdict": verdict or "does not hold"})
    return checks


def order_claim(row: dict) -> dict:
    """The claims' ranking: code-like above chat above creative writing, by the best method's speedup."""
    groups = [group for _, group, _, _ in SPEEDUP_CLAIMS]
    best = {g: _best(row, g) for g in groups}
    measured = {g: b[1] for g, b in best.items() if b is not None}
    claim = {"claim": "speedup order: " + " > ".join(groups), "speedups": measured}
    if len(measured) < len(groups):
        return claim | {"verdict": "not measured (a group has no prompt)"}
    ranked = all(measured[a] > measured[b] for a, b in zip(groups, groups[1:]))
    return claim | {"verdict": "holds" if ranked else "does not hold"}


def temperature_claim(rows: list[dict]) -> dict:
    """High temperature lowers acceptance: per drafting method, tau at the highest temperature against the lowest."""
    low, high = min(rows, key=lambda r: r["temperature"]), max(rows, key=lambda r: r["temperature"])
    taus = {m: [low["methods"][m]["tau"], high["methods"][m]["tau"]] for m in low["methods"] if m != "vanilla"}
    lowered = [m for m, (cold, hot) in taus.items() if hot < cold]
    claim = {
        "claim": f"high temperature lowers acceptance (tau at T={high['temperature']:g} < T={low['temperature']:g})",
        "taus": taus,
        "lowered": lowered,
    }
    if low is high or not taus:
        return claim | {"verdict": "not measured (one temperature)"}
    if len(lowered) == len(taus):
        return claim | {"verdict": "holds"}
    return claim | {"verdict": f"holds for {len(lowered)} of {len(taus)} methods" if lowered else "does not hold"}


def check_claims(rows: list[dict]) -> list[dict]:
    """Every claim, the speedup ones at the lowest temperature (the greedy run when T=0 is one)."""
    coldest = min(rows, key=lambda r: r["temperature"])
    return [*speedup_claims(coldest), order_claim(coldest), temperature_claim(rows)]
