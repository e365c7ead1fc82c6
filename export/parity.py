"""Served-acceptance parity figures (the ``parity.json`` that ``scripts.export.verify_engines`` writes): which
weights the figures belong to, and their Markdown for the report and for the model cards, each head named by its
drafting's title and each engine folder by its head type's layout name (``layouts.EngineLayouts.layout``).
Standard library only at the top: the engines' side venv (no peft) imports the package around it; the registry is
read where a table is made.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

SERVED_HEADER = (
    "| head | measured by | drafts | acceptance length | accepted per position (share of drafts) | greedy tokens "
    "| check |\n|---|---|---|---|---|---|---|\n"
)


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
    from headstart.export.registry import layouts_of
    from headstart.heads import drafting_owner, draftings

    title = draftings()[entry["type"]].title + (" (untrained)" if entry["random_init"] else "")
    layouts = layouts_of(drafting_owner(entry["type"]).name)
    ours = entry["ours"]
    rows = [f"| {title} | headstart `eval`, chain of {k} | {ours['drafts']} | {_length(ours)} | {_rates(ours)} | - | |"]
    for run in entry["served"]:
        layout = layouts.layout(run["layout"], short=True)
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
    from headstart.heads import draftings

    return f"| {draftings()[entry['type']].title} | {check['detail']} | {check['status']} |\n"


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
