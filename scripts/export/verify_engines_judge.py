"""The verdicts of ``scripts.export.verify_engines``: the served acceptance of an engine against ours (same greedy
tokens, acceptance length at most MAX_SHORTFALL below), the speculation-by-load schedule vLLM followed, and
the overall status, and the acceptance both sides count. Pure and standard library only (the engines' side venv
imports it too): the engines' results and ours go in, PASS or FAIL with the reason comes out.
"""

from __future__ import annotations

from typing import Any

MAX_SHORTFALL = 0.05  # vLLM's acceptance length may be at most this fraction below ours


def differing(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts' tokens differ (a missing prompt counts)."""
    return sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))


def judge(
    plain: list[list[int]],
    spec: list[list[int]],
    engine: dict[str, Any],
    ours: dict[str, Any],
    max_gap: float | None = None,
) -> dict:
    """The served-acceptance verdict: the engine's greedy tokens with the head equal the target's alone and
    our engine's (else the two sides' figures cover different text), the engine drafted, and its acceptance
    length is at most MAX_SHORTFALL below ours (a head read wrongly still runs and keeps the output, but
    accepts far less); with ``max_gap``, its acceptance length and per-position rates are also within that
    fraction of ours either way (``gaps``)."""
    problems = [
        f"greedy tokens {what} in {differing(plain, other)} prompts"
        for what, other in (
            ("with the head differ from the target's alone", spec),
            ("differ from ours", ours["tokens"]),
        )
        if other != plain
    ]
    if not engine["drafts"]:
        problems.append("the engine made no drafts")
    relative = None
    if engine["acceptance_length"] is not None and ours["acceptance_length"] is not None:
        relative = engine["acceptance_length"] / ours["acceptance_length"] - 1
        if relative < -MAX_SHORTFALL:
            problems.append(
                f"acceptance length {engine['acceptance_length']:.3f} is {-relative:.1%} below ours "
                f"({ours['acceptance_length']:.3f}); at most {MAX_SHORTFALL:.0%} allowed"
            )
    if max_gap is not None:
        problems += gaps(engine, ours, max_gap)
    return {
        "status": "FAIL" if problems else "PASS",
        "detail": "; ".join(problems) or "greedy tokens identical, acceptance within bounds",
        "greedy_identical": spec == plain == ours["tokens"],
        "engine_acceptance": engine,
        "relative": relative,
    }


FLIPPED_DRAFTS = 0.01  # of the drafts: a position's acceptance rate may differ this much, absolute (``gaps``)


def gaps(engine: dict[str, Any], ours: dict[str, Any], max_gap: float) -> list[str]:
    """Where the engine's acceptance length or a position's acceptance rate is more than ``max_gap`` (relative)
    from ours, either way: a served head that accepts more than ours is read differently too. A position
    neither side accepted at agrees; one only one side accepted at is as far apart as can be. A position's rate
    may also differ by ``FLIPPED_DRAFTS`` of the drafts (absolute): where few drafts are accepted, a handful whose
    near-tied draft logits the two engines' arithmetic on the target's states tips apart is more than 2% of them
    (gpt-oss's tiny head: 5 of 137 at position 1, the acceptance length 0.3% apart)."""
    pairs = [("acceptance length", engine["acceptance_length"], ours["acceptance_length"])]
    theirs_rates, our_rates = engine["per_pos_rate"] or [], ours["per_pos_rate"] or []
    pairs += [(f"position {i + 1} rate", a, b) for i, (a, b) in enumerate(zip(theirs_rates, our_rates))]
    problems = []
    for what, theirs, mine in pairs:
        if theirs is None or mine is None:
            continue
        gap = abs(theirs / mine - 1) if mine else (0.0 if not theirs else float("inf"))
        if what.startswith("position") and abs(theirs - mine) <= FLIPPED_DRAFTS:
            continue
        if gap > max_gap:
            problems.append(f"{what} {theirs:.3f} vs ours {mine:.3f}: {gap:.1%} apart, at most {max_gap:.0%} allowed")
    return problems


def judge_schedule(plain: list[list[int]], run: dict[str, Any], schedule: list[list[int]], batch: int) -> dict:
    """The served speculation-by-load verdict: greedy tokens equal the target's alone, and no draft position past
    the deepest k the schedule allows for 1..``batch`` running requests was accepted (vLLM counts acceptance
    per position: a position never drafted accepts nothing), while a schedule that drafts at all drafted."""
    if "status" in run:
        return run
    from headstart.decoding.tree_config import scheduled_depth

    allowed = max(scheduled_depth(schedule, b) for b in range(1, batch + 1))
    per_pos = run["acceptance"]["accepted_per_pos"]
    problems = [f"greedy tokens differ from the target's alone in {differing(plain, run['tokens'])} prompts"]
    problems = problems if run["tokens"] != plain else []
    if any(per_pos[allowed:]):
        problems.append(f"positions past k={allowed} accepted tokens: {per_pos}")
    if allowed and not run["acceptance"]["drafts"]:
        problems.append("the engine made no drafts")
    detail = f"schedule {schedule}, {batch} requests at once: at most k={allowed}; accepted per position {per_pos}"
    return {"status": "FAIL" if problems else "PASS", "detail": "; ".join(problems) or detail,
            "engine": run["engine"], "schedule": schedule, "engine_acceptance": run["acceptance"]}  # fmt: skip


def served(
    plain: dict[str, Any], spec: dict[str, Any], ours: dict[str, Any], layout: str, max_gap: float | None = None
) -> dict[str, Any]:
    """One served-acceptance row: the verdict (``judge``), or the stage's NOT RUN/FAIL when a run gave no tokens."""
    failed = next((run for run in (plain, spec) if "status" in run), None)
    run = failed or judge(plain["tokens"], spec["tokens"], spec["acceptance"], ours, max_gap)
    return {"layout": layout, "engine": spec.get("engine", "vLLM"), **run}


def overall(heads: list[dict[str, Any]]) -> str:
    statuses = [e["speculators"]["status"] for e in heads] + [r["status"] for e in heads for r in e["served"]]
    statuses += [e["schedule"]["status"] for e in heads if "schedule" in e]
    judged = [s for s in statuses if s not in ("N/A", "UNSERVED")]  # UNSERVED: named, the engine's own refusal
    if not judged and "UNSERVED" in statuses:
        return "UNSERVED"  # nothing the engine could run: its refusals are the report
    return "PASS" if judged and all(s == "PASS" for s in judged) else "FAIL"


def acceptance(drafts: int, accepted_per_pos: list[int]) -> dict[str, Any]:
    """Acceptance of chains of k drafts as vLLM counts it: ``accepted_per_pos[i]`` drafts had their first
    i + 1 tokens accepted; acceptance length = 1 + accepted tokens per draft (the verifier's own token
    included). None where nothing was drafted: there is no rate to give."""
    if any(b > a for a, b in zip(accepted_per_pos, accepted_per_pos[1:])):
        raise ValueError(f"accepted per position {accepted_per_pos} grows with depth: not counts of accepted prefixes")
    if drafts < max(accepted_per_pos, default=0):
        raise ValueError(f"{drafts} drafts cannot accept {accepted_per_pos} tokens at a position")
    return {
        "drafts": drafts,
        "accepted_per_pos": accepted_per_pos,
        "per_pos_rate": [a / drafts for a in accepted_per_pos] if drafts else None,
        "acceptance_length": 1 + sum(accepted_per_pos) / drafts if drafts else None,
    }
