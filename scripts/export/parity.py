"""Served-acceptance parity figures (the ``parity.json`` that ``scripts.export.verify_engines`` writes): acceptance
from per-position counts, which weights the figures belong to, and their Markdown for the report and for
the model cards. Standard library only: the engines' side venv imports it too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

TITLES = {"eagle": "EAGLE-1/2", "eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash"}
LAYOUT_NAMES = {"vllm": "EAGLE-repo layout", "speculators": "speculators layout"}
SERVED_HEADER = (
    "| head | measured by | drafts | acceptance length | accepted per position (share of drafts) | greedy tokens "
    "| check |\n|---|---|---|---|---|---|---|\n"
)


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


def weights_digest(head_dir: str | Path) -> str:
    """sha256 of the head's model.safetensors: figures are attached only to the weights they were measured on."""
    return hashlib.sha256(Path(head_dir, "model.safetensors").read_bytes()).hexdigest()


def _rates(measured: dict[str, Any]) -> str:
    rates = measured["per_pos_rate"]
    return ", ".join(f"{r:.3f}" for r in rates) if rates is not None else "no drafts"


def _length(measured: dict[str, Any], relative: float | None = None) -> str:
    if measured["acceptance_length"] is None:
        return "-"
    return f"{measured['acceptance_length']:.3f}" + (f" ({relative:+.1%} vs ours)" if relative is not None else "")


def served_rows(entry: dict[str, Any], k: int) -> str:
    """Table rows of one head: our evaluator's chain of k, then each engine run that came back with figures."""
    title = TITLES[entry["type"]] + (" (untrained)" if entry["random_init"] else "")
    ours = entry["ours"]
    rows = [f"| {title} | headstart `eval`, chain of {k} | {ours['drafts']} | {_length(ours)} | {_rates(ours)} | - | |"]
    for run in entry["served"]:
        layout = "DFlash layout" if entry["type"] == "dflash" else LAYOUT_NAMES[run["layout"]]
        where = f"{run['engine']}, {layout}"
        if "engine_acceptance" not in run:
            rows.append(f"| {title} | {where} | - | - | - | - | {run['status']}: {run['detail']} |")
            continue
        measured = run["engine_acceptance"]
        rows.append(
            f"| {title} | {where} | {measured['drafts']} | {_length(measured, run['relative'])} | {_rates(measured)} "
            f"| {'identical' if run['greedy_identical'] else 'DIFFER'} | {run['status']} |"
        )
    return "".join(row + "\n" for row in rows)


def speculators_row(entry: dict[str, Any]) -> str:
    check = entry["speculators"]
    return f"| {TITLES[entry['type']]} | {check['detail']} | {check['status']} |\n"


# How the prompts reached the target, per the report's prompt_format (reports from before it was recorded: chat).
PROMPTED = {
    "chat": "through the target's chat template",
    "raw": "as raw text (no chat template; vLLM given our token ids as a completion prompt)",
}


def settings_line(report: dict[str, Any]) -> str:
    s = report["settings"]
    return (
        f"Greedy, chains of {s['k']} drafts (vLLM `num_speculative_tokens={s['k']}`), the first {s['prompts']} "
        f"questions of `{s['data']}` {PROMPTED[s.get('prompt_format', 'chat')]}, up to {s['max_tokens']} new tokens, "
        f"target `{s['target']}` in {s['dtype']} on {s['device']}; engines: {', '.join(report['engines'])}. "
        f"vLLM's figures are its own counters (`vllm:spec_decode_num_drafts`, "
        f"`vllm:spec_decode_num_accepted_tokens_per_pos`); a check fails when greedy tokens differ from the "
        f"target's alone or from ours, or vLLM's acceptance length is more than {s['max_shortfall']:.0%} below ours."
    )


def report_markdown(report: dict[str, Any]) -> str:
    """The whole run: settings, served acceptance of every head, the speculators forward checks."""
    k = report["settings"]["k"]
    served = "".join(served_rows(entry, k) for entry in report["heads"])
    forward = "".join(speculators_row(entry) for entry in report["heads"])
    return (
        f"# Served-acceptance parity: {report['status']}\n\n{settings_line(report)}\n\n{SERVED_HEADER}{served}\n"
        f"| head | speculators | check |\n|---|---|---|\n{forward}"
    )


def card_section(report: dict[str, Any], digest: str) -> str | None:
    """The model card's section for the head whose weights have sha256 ``digest``; None if not measured."""
    entries = [entry for entry in report["heads"] if entry["weights_sha256"] == digest]
    if not entries:
        return None
    entry = entries[0]
    return (
        "## Measured acceptance in the engines\n\n"
        f"Measured on these weights with `python -m scripts.export.verify_engines` ({report['date']}). "
        f"{settings_line(report)}\n\n{SERVED_HEADER}{served_rows(entry, report['settings']['k'])}\n"
        f"speculators: {entry['speculators']['detail']} ({entry['speculators']['status']}).\n"
    )
