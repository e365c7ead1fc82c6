"""Reports as files: the acceptance report (report.json with stable keys, report.md, PNG plots), the matrix of
methods x task groups x temperatures (matrix.json, matrix.md, PNG plots); the tree tuner's are
``eval.autotune_report``'s.

report.json, as ``eval.acceptance`` builds it:

    target, draft, heads, bench, limit, per_group, prompts, max_new_tokens, temperature, top_p, top_k, seed,
    tree (the flags: shape, file (a tree.json given as --tree), top_k_draft, depth, total, exit_layer),
    device, dtype, machine, torch, transformers,
    prompt_format (as asked: auto, chat or raw), prompt_format_resolved (what rendered the prompts: chat or raw),
    methods.<name> (``eval.results.MethodResult``; report.json keeps its fields' order):
        requested, tau, acceptance_by_depth [rate of depth d given d - 1; null: never tried],
        alpha, mean_accepted, target_forwards, new_tokens, wall_s, tokens_per_s, speedup_vs_vanilla, predicted_speedup,
        draft_depth (k: the deepest tree drafted), drafted_nodes (the largest), draft_cost_ratio (c), target_forward_ms,
        peak_memory_mb (CUDA: max allocated during the method; CPU: the process's peak RSS so far),
        greedy_identical (bool; null when sampling), mismatched_prompts, divergences (per mismatch: prompt, turn,
        token, vanilla_token, method_token, logit_gap, near_tie),
        per_category.<cat>: tau, target_forwards, tokens_per_s, speedup_vs_vanilla (over vanilla on that category),
        predicted_tau (the head's training-time chain prediction, config.json "training"; null without one),
        training_measured_tau (the tau training measured by decoding, ``train.eval_prompts``; null without one),
        tree_config (the tree.json an EAGLE method decoded with; null: the tree flags)

matrix.json (``eval.acceptance --temperatures``): report.json's settings without temperature and methods, then
    temperatures, groups.<group>: its categories, rows[]: temperature, methods.<name>: tau, tokens_per_s, speedup,
        greedy_identical, groups.<group>: tau, tokens_per_s, speedup, new_tokens, wall_s, target_forwards;
    claims[]: claim, verdict and the numbers that decide it (``eval.matrix``)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from headstart.core.io import atomic_path, atomic_write_text  # noqa: E402
from headstart.eval.results import CategoryResult, MethodResult, methods_json  # noqa: E402

PLOTS = ("tau_per_category.png", "acceptance_by_depth.png")


def _identical(greedy_identical: bool | None) -> str:
    if greedy_identical is None:
        return "n/a (sampling)"
    return "yes" if greedy_identical else "**NO**"


def report_json(report: dict[str, Any]) -> dict[str, Any]:
    """What report.json holds of ``report`` (the settings, and its ``methods`` as ``eval.results.MethodResult``s)."""
    return report | {"methods": methods_json(report["methods"])}


def prompts_rendered(requested: str, resolved: str) -> str:
    """How the prompts were rendered (``data_recipes.prompts``), in words: report.md, autotune.md, saved configs."""
    if resolved == "chat":
        how = "the tokenizer's chat template with its generation prompt, as a chat API asks the target"
        why = "auto: the tokenizer has one" if requested == "auto" else "--prompt-format chat"
    else:
        how = "raw text, as a completion API feeds the target"
        why = "the tokenizer has no chat template" if requested == "auto" else "--prompt-format raw"
    return f"{how} ({why})"


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: settings, the per-method table, per-category tau, warnings first."""
    methods: dict[str, MethodResult] = report["methods"]
    lines = [f"# Acceptance report: {report['target']}", ""]
    lines += _divergence_warning(methods)
    if not methods["vanilla"].requested:
        lines += ["Vanilla was not requested; it ran anyway as the speedup baseline.", ""]
    lines += _settings_lines(report)
    lines += _method_table(methods)
    lines += _category_table(methods)
    lines += _tuned_trees(methods)
    lines += _acceptance_by_depth(methods)
    lines += [
        "",
        "predicted = (1 - alpha^(k+1)) / ((1 - alpha)(k c + 1)): the chain model (each draft accepted with "
        "probability alpha once its parent was), k the draft depth, c one draft call's cost in target forwards.",
        "",
    ]
    return "\n".join(lines)


def _divergence_warning(methods: dict[str, MethodResult]) -> list[str]:
    """The warning that opens a report whose methods did not reproduce vanilla greedy decoding, with where each
    first differed; nothing when all did."""
    broken = [m for m, e in methods.items() if e.greedy_identical is False]
    if not broken:
        return []
    lines = [
        f"> **WARNING: {', '.join(broken)} did NOT reproduce vanilla greedy decoding token for token** "
        "(see mismatched_prompts in report.json). Their speedups are not comparable.",
        "",
    ]
    for m in broken:
        for d in methods[m].divergences:
            gap = "a stop" if d["logit_gap"] is None else f"target logit gap {d['logit_gap']:.4f}"
            verdict = "near-tie: reduced-precision rounding" if d["near_tie"] else "**not a near-tie**"
            lines.append(
                f"> - {m}: {d['prompt']} turn {d['turn']} first differs at token {d['token']} ({gap}; {verdict})"
            )
    return lines + [""]


def _settings_lines(report: dict[str, Any]) -> list[str]:
    tree = report["tree"]
    return [
        f"- bench: `{report['bench']}`, {report['prompts']} prompts (limit {report['limit']}), "
        f"{report['max_new_tokens']} new tokens per turn",
        f"- prompts: {prompts_rendered(report['prompt_format'], report['prompt_format_resolved'])}",
        f"- sampling: temperature {report['temperature']}, top-p {report['top_p']}, top-k {report['top_k']}; "
        f"{_tree_asked(tree)}; seed {report['seed']}",
        f"- machine: {report['machine']} ({report['device']}, {report['dtype']}); "
        f"torch {report['torch']}, transformers {report['transformers']}",
        "",
    ]


def _tree_asked(tree: dict[str, Any]) -> str:
    """The tree the flags asked for; what each method drafted (a block's slots, a tree.json) is in its row."""
    if tree.get("file"):
        asked = f"tree {tree['file']} (a tree.json)"
    else:
        asked = (
            f"tree {tree['shape'] or 'per method'} (top-k {tree['top_k_draft']}, depth {tree['depth']}, "
            f"{tree['total']} nodes)"
        )
    return asked + " asked; each method's row says the deepest and largest tree it drafted"


def _method_table(methods: dict[str, MethodResult]) -> list[str]:
    lines = [
        "| method | tau | training predicted tau | training measured tau | alpha | mean accepted | target forwards "
        "| tree drafted (depth, nodes) | tokens/s | speedup | predicted (k, c) | peak MB | greedy identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, e in methods.items():
        predicted, measured = _tau(e.predicted_tau), _tau(e.training_measured_tau)
        lines.append(
            f"| {name} | {e.tau:.3f} | {predicted} | {measured} | {e.alpha:.3f} | {e.mean_accepted:.3f} "
            f"| {e.target_forwards} | {e.draft_depth}, {e.drafted_nodes} "
            f"| {e.tokens_per_s:.1f} | {e.speedup_vs_vanilla:.3f} | {e.predicted_speedup:.3f} "
            f"({e.draft_depth}, {e.draft_cost_ratio:.3f}) | {e.peak_memory_mb:.0f} | {_identical(e.greedy_identical)} |"
        )
    return lines


def _category_table(methods: dict[str, MethodResult]) -> list[str]:
    categories = sorted({c for e in methods.values() for c in e.per_category})
    lines = ["", "## tau (speedup vs vanilla) per category", "", "| method | " + " | ".join(categories) + " |"]
    lines.append("|---" * (len(categories) + 1) + "|")
    for name, e in methods.items():
        cells = [_category_cell(e.per_category.get(c)) for c in categories]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _tuned_trees(methods: dict[str, MethodResult]) -> list[str]:
    """One line per method that decoded with an autotuned tree.json."""
    lines: list[str] = []
    for name, e in methods.items():
        if not e.tree_config:
            continue
        tree = e.tree_config
        where = f", tuned on {tree['machine']}" if "machine" in tree else ""
        lines += [
            "",
            f"{name} tree (tree.json): {tree['shape']}, depth {tree['depth']}, top-k {tree['top_k']}, "
            f"{tree['total_tokens']} nodes{where}",
        ]
    return lines


def _acceptance_by_depth(methods: dict[str, MethodResult]) -> list[str]:
    lines = ["", "## acceptance rate by draft depth (depth d accepted, given d - 1 was)", ""]
    for name, e in methods.items():
        if e.acceptance_by_depth:
            rates = ["-" if r is None else f"{r:.3f}" for r in e.acceptance_by_depth]
            lines.append(f"- {name}: " + ", ".join(rates) + (" (- never tried)" if "-" in rates else ""))
    return lines


def _tau(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def save_figure(fig: Figure, path: Path) -> None:
    """Write ``fig`` as a PNG, atomically, and free it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


def _category_cell(entry: CategoryResult | None) -> str:
    if entry is None:
        return ""
    speedup = entry.speedup_vs_vanilla  # 0.0: no baseline (reports written before it was recorded: tau only)
    return f"{entry.tau:.3f}" + (f" ({speedup:.2f}x)" if speedup else "")


def plot_tau_per_category(report: dict[str, Any], path: Path) -> None:
    """Bars of tau per benchmark category, one per method."""
    methods: dict[str, MethodResult] = report["methods"]
    categories = sorted({c for e in methods.values() for c in e.per_category})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(categories) + 2), 4))
    width = 0.8 / len(methods)
    for i, (name, e) in enumerate(methods.items()):
        taus = [e.per_category[c].tau if c in e.per_category else 0.0 for c in categories]
        ax.bar([x + i * width for x in range(len(categories))], taus, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(categories))], categories, rotation=30, ha="right")
    ax.set_ylabel("tau (tokens per target forward)")
    ax.set_title("Acceptance length per category")
    ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path)


def plot_acceptance_by_depth(report: dict[str, Any], path: Path) -> None:
    """Each method's acceptance rate of depth d given d - 1, against d."""
    fig, ax = plt.subplots(figsize=(6, 4))
    methods: dict[str, MethodResult] = report["methods"]
    for name, e in methods.items():
        rates = [float("nan") if r is None else r for r in e.acceptance_by_depth]  # never tried: a gap
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=name)
    ax.set_xlabel("draft depth d")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("P(depth d accepted | depth d - 1 accepted)")
    ax.set_ylim(-0.03, 1.03)  # a rate of 0 stays visible
    ax.set_title("Acceptance rate by draft depth")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    fig.tight_layout()
    save_figure(fig, path)


def write_report(report: dict[str, Any], out_dir: str | Path) -> str:
    """Write report.json (``report_json``), report.md and the PNG plots of ``report`` (the settings, and its
    ``methods`` as ``eval.results.MethodResult``s) into ``out_dir``; returns the Markdown."""
    plots: dict[str, Callable[[dict, Path], None]] = {
        PLOTS[0]: plot_tau_per_category,
        PLOTS[1]: plot_acceptance_by_depth,
    }
    return write_files(out_dir, "report", report, markdown, plots, report_json)


def write_files(
    out_dir: str | Path,
    stem: str,
    result: dict,
    to_markdown: Callable[[dict], str],
    plots: dict[str, Callable[[dict, Path], None]],
    to_json: Callable[[dict], dict] | None = None,
) -> str:
    """<stem>.json (``to_json`` of ``result``; without one: ``result``), <stem>.md and each plot (file name ->
    plotter) of ``result`` in ``out_dir``; the Markdown."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    on_disk = result if to_json is None else to_json(result)
    atomic_write_text(out / f"{stem}.json", json.dumps(on_disk, indent=2) + "\n")
    md = to_markdown(result)
    atomic_write_text(out / f"{stem}.md", md)
    for name, plot in plots.items():
        plot(result, out / name)
    return md


# ------------------------------------------------------------------------------------------- the matrix

MATRIX_PLOTS = ("speedup_per_group.png", "tau_speedup_vs_temperature.png")


def _temperature(row: dict) -> str:
    return f"T={row['temperature']:g}"


def matrix_markdown(matrix: dict) -> str:
    """The matrix as Markdown: settings and groups, per temperature a method x group table of speedup and tau,
    then each claim with the numbers that decide it."""
    groups, rows = matrix["groups"], matrix["rows"]
    tree = matrix["tree"]
    prompts = f"{matrix['per_group']} per group" if matrix["per_group"] else f"limit {matrix['limit']}"
    lines = [
        f"# Methods x task x temperature: {matrix['target']}",
        "",
        f"- bench: `{matrix['bench']}`, {matrix['prompts']} prompts ({prompts}), "
        f"{matrix['max_new_tokens']} new tokens per turn; temperatures "
        + ", ".join(f"{t:g}" for t in matrix["temperatures"])
        + f", top-p {matrix['top_p']}, top-k {matrix['top_k']}; seed {matrix['seed']}",
        f"- prompts: {prompts_rendered(matrix['prompt_format'], matrix['prompt_format_resolved'])}",
        f"- tree {tree['shape'] or 'per method'} (top-k {tree['top_k_draft']}, depth {tree['depth']}, "
        f"{tree['total']} nodes); machine: {matrix['machine']} ({matrix['device']}, {matrix['dtype']})",
        "- groups: " + "; ".join(f"{g} = {' + '.join(members)}" for g, members in groups.items()),
        "- speedup: a method's tokens/s over vanilla's on the same prompts at the same temperature (per group: "
        "over vanilla's on that group). Greedy (T=0) outputs must equal vanilla's token for token; sampled ones "
        "follow the target's distribution exactly (the chi-square tests of "
        "tests/decoding/test_decoding_sampling.py), so a sampled run's tokens differ from vanilla's by chance only.",
    ]
    for row in rows:
        lines += ["", f"## {_temperature(row)}: speedup (tau) per group", ""]
        lines.append("| method | all | " + " | ".join(groups) + " | greedy identical |")
        lines.append("|---" * (len(groups) + 3) + "|")
        for name, e in row["methods"].items():
            cells = [f"{c['speedup']:.2f}x ({c['tau']:.2f})" for c in (e["groups"][g] for g in groups)]
            overall = f"{e['speedup']:.2f}x ({e['tau']:.2f})"
            lines.append(f"| {name} | {overall} | " + " | ".join(cells) + f" | {_identical(e['greedy_identical'])} |")
    lines += ["", "## The claims", "", "| claim | measured | verdict |", "|---|---|---|"]
    for claim in matrix["claims"]:
        lines.append(f"| {claim['claim']} | {_claim_numbers(claim)} | {claim['verdict']} |")
    return "\n".join(lines) + "\n"


def _claim_numbers(claim: dict) -> str:
    if "taus" in claim:
        return ", ".join(f"{m} {cold:.2f} -> {hot:.2f}" for m, (cold, hot) in claim["taus"].items())
    if "speedups" in claim:
        return ", ".join(f"{g} {s:.2f}x" for g, s in claim["speedups"].items())
    return "-" if claim["method"] is None else f"{claim['speedup']:.2f}x ({claim['method']}, the best)"


def plot_speedup_per_group(matrix: dict, path: Path) -> None:
    """Heatmap of speedup per method x group at the lowest temperature, the value in each cell."""
    row = min(matrix["rows"], key=lambda r: r["temperature"])
    groups = list(matrix["groups"])
    methods = [m for m in row["methods"] if m != "vanilla"]
    values = [[row["methods"][m]["groups"][g]["speedup"] for g in groups] for m in methods]
    fig, ax = plt.subplots(figsize=(1.1 * len(groups) + 3, 0.45 * len(methods) + 2))
    # Centred on 1x: red slower than vanilla, blue faster.
    image = ax.imshow(values, cmap="RdBu", vmin=0.0, vmax=2.0, aspect="auto")
    for i, line in enumerate(values):
        for j, value in enumerate(line):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    ax.set_yticks(range(len(methods)), methods)
    ax.set_title(f"Speedup vs vanilla per task group ({_temperature(row)})")
    fig.colorbar(image, ax=ax, label="speedup (x)")
    fig.tight_layout()
    save_figure(fig, path)


def plot_vs_temperature(matrix: dict, path: Path) -> None:
    """Left: each method's tau against the temperature; right: its speedup."""
    rows = sorted(matrix["rows"], key=lambda r: r["temperature"])
    temperatures = [r["temperature"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name in rows[0]["methods"]:
        left.plot(temperatures, [r["methods"][name]["tau"] for r in rows], marker="o", label=name)
        right.plot(temperatures, [r["methods"][name]["speedup"] for r in rows], marker="o", label=name)
    for ax, label in ((left, "tau (tokens per target forward)"), (right, "speedup vs vanilla (x)")):
        ax.set_xlabel("temperature")
        ax.set_ylabel(label)
    left.set_title("Acceptance length vs temperature")
    right.set_title("Speedup vs temperature")
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.legend(fontsize="small", loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    save_figure(fig, path)


def write_matrix_report(matrix: dict, out_dir: str | Path) -> str:
    """Write matrix.json, matrix.md and the matrix plots into ``out_dir``; returns the Markdown."""
    return write_files(
        out_dir,
        "matrix",
        matrix,
        matrix_markdown,
        {MATRIX_PLOTS[0]: plot_speedup_per_group, MATRIX_PLOTS[1]: plot_vs_temperature},
    )
