"""The tree tuner's report (``eval.autotune``): autotune.json, autotune.md (costs and acceptance measured, the
validation grid, the batch table, adaptive depth) and autotune.png."""

from __future__ import annotations

from pathlib import Path

# pyplot as eval.report sets it up: the Agg backend, files only
from headstart.eval.report import plt, prompts_rendered, save_figure, write_files


def autotune_markdown(result: dict) -> str:
    """The tuner's result as Markdown: costs and acceptance measured, the validation grid, the batch table."""
    rows = result["grid"]
    best = max(r["tokens_per_s"] for r in rows)
    lines = [
        f"# Tree auto-tuning: {result['head']}",
        "",
        f"- machine: {result['machine']} ({result['device']}, {result['dtype']}); KV length {result['kv_length']}",
        f"- calibration: {result['calibration_prompts']} prompts; held out: {result['heldout_prompts']} prompts, "
        f"{result['max_new_tokens']} new tokens, greedy",
        f"- prompts: {prompts_rendered(result['prompt_format'], result['prompt_format_resolved'])}",
        "- verify ms (nodes: ms, batch 1): "
        + ", ".join(f"{n}: {ms:.1f}" for n, ms in zip(result["costs"]["nodes"], result["costs"]["verify_ms"]["1"])),
        f"- drafting: base {result['costs']['base_ms']:.2f} ms, one level "
        + ", ".join(f"w{w}: {ms:.2f}" for w, ms in zip(result["costs"]["widths"], result["costs"]["level_ms"]))
        + " ms",
        "- acceptance p[depth][rank]: "
        + "; ".join(f"d{d + 1}: " + " ".join(f"{p:.2f}" for p in ps[:4]) for d, ps in enumerate(result["rank_probs"])),
        "",
        "| tree | nodes | tau measured | tau predicted | tokens/s measured | tokens/s predicted | speedup "
        "| identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = " **(chosen)**" if r["chosen"] else ""
        lines.append(
            f"| {r['name']}{mark} | {r['total_tokens']} | {r['tau']:.2f} | {r['predicted_tau']:.2f} "
            f"| {r['tokens_per_s']:.1f}{' (best)' if r['tokens_per_s'] == best else ''} "
            f"| {r['predicted_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {'yes' if r['greedy_identical'] else 'NO'} |"
        )
    if len(result["sources"]) > 1:  # self-speculation: every exit layer tried, the fastest predicted one validated
        lines += ["", "| draft source | best tree | tau predicted | tokens/s predicted |", "|---|---|---|---|"]
        lines += [
            f"| {r['name']}{' **(chosen)**' if r['chosen'] else ''} | {r['tree']} | {r['predicted_tau']:.2f} "
            f"| {r['predicted_tokens_per_s']:.1f} |"
            for r in result["sources"]
        ]
    checks = result["checks"]
    versus_eagle = (
        "not measured (P-EAGLE and DFlash draft static shapes only)"
        if checks["beats_eagle_default"] is None
        else f"{'yes' if checks['beats_eagle_default'] else 'NO'} ({checks['chosen_vs_eagle_default']:.2f}x)"
    )
    lines += [
        "",
        f"- chosen within 10% of the best measured: {'yes' if checks['within_10pct_of_best'] else 'NO'} "
        f"({checks['chosen_vs_best']:.3f} of the best)",
        f"- chosen beats EAGLE's default tree (60 nodes, depth 6, top-k 10): {versus_eagle}",
        "",
        *adaptive_lines(result),
        "",
        *batch_lines(result),
    ]
    return "\n".join(lines) + "\n"


def batch_lines(result: dict) -> list[str]:
    """The tuner's batch-size section: the model's best tree per batch size, the schedules, and the schedule
    measured on held-out prompts decoded together."""
    lines = [
        "## Batch size (model; drafting runs per sequence)",
        "",
        "depth: the chosen tree's deepest level worth verifying at that batch size (headstart's engine, "
        "`depth_per_batch_size`); chain k: the best chain length (vLLM's `num_speculative_tokens_per_batch_size`).",
        "",
        "| batch | best tree | tau | tokens/s | vanilla tokens/s | speculate | depth | chain k |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, row in result["batch"].items():
        lines.append(
            f"| {b} | {row['tree']} | {row['tau']:.2f} | {row['tokens_per_s']:.1f} | {row['vanilla_tokens_per_s']:.1f} "
            f"| {'yes' if row['speculate'] else 'no: plain decoding is faster'} | {row['depth']} "
            f"| {row['chain_k']} |"
        )
    lines += [
        "",
        f"- headstart: `depth_per_batch_size` = `{result['schedules']['depth_per_batch_size']}`",
        f"- vLLM: `num_speculative_tokens_per_batch_size` = "
        f"`{result['schedules']['num_speculative_tokens_per_batch_size']}`",
        "",
        "Measured on held-out prompts decoded together (greedy, `generate_batch`):",
        "",
        "| batch | scheduled depth | plain tokens/s | fixed tree tokens/s | scheduled tokens/s | identical |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["batch_validation"]:
        lines.append(
            f"| {row['batch_size']} | {row['depth']} | {row['vanilla_tokens_per_s']:.1f} "
            f"| {row['fixed_tokens_per_s']:.1f} | {row['scheduled_tokens_per_s']:.1f} "
            f"| {'yes' if row['greedy_identical'] else 'NO'} |"
        )
    return lines


def adaptive_lines(result: dict) -> list[str]:
    """The adaptive-depth fit: the threshold and its replayed tokens/s against fixed depth."""
    adaptive = result["adaptive"]
    if not adaptive.get("fitted", adaptive["level_by_level"]):
        return [
            "- adaptive depth: not fitted (this head drafts every depth in one forward and gives no acceptance "
            "estimate of its own)"
        ]
    threshold = adaptive["min_confidence"]
    verdict = f"stop below {threshold:.3g}" if threshold > 0 else "none (fixed depth replays fastest)"
    return [
        f"- adaptive depth (fitted on the calibration steps): {verdict}; replayed "
        f"{adaptive['replayed_tokens_per_s']:.1f} tokens/s against {adaptive['replayed_fixed_tokens_per_s']:.1f} at "
        "fixed depth (measured above: the chosen tree beside the same tree at fixed depth)"
    ]


def plot_autotune(result: dict, path: Path) -> None:
    """Left: the verify cost curves per batch size; right: measured against predicted tokens/s of the grid."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    costs = result["costs"]
    for b, ms in costs["verify_ms"].items():
        left.plot(costs["nodes"], ms, marker="o", label=f"batch {b}")
    left.set_xlabel("tree nodes verified (root excluded)")
    left.set_ylabel("ms per verification step")
    left.set_title("Target verify cost")
    left.legend(fontsize="small")
    rows = result["grid"]
    for r in rows:
        style = {"marker": "*", "s": 200, "color": "red"} if r["chosen"] else {"marker": "o", "s": 40}
        right.scatter(r["predicted_tokens_per_s"], r["tokens_per_s"], **style)
        right.annotate(r["name"], (r["predicted_tokens_per_s"], r["tokens_per_s"]), fontsize=7)
    lo = min(min(r["predicted_tokens_per_s"], r["tokens_per_s"]) for r in rows)
    hi = max(max(r["predicted_tokens_per_s"], r["tokens_per_s"]) for r in rows)
    right.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8)
    right.set_xlabel("predicted tokens/s")
    right.set_ylabel("measured tokens/s (held out)")
    right.set_title("Tree grid (red star: chosen)")
    fig.tight_layout()
    save_figure(fig, path)


def write_autotune_report(result: dict, out_dir: str | Path) -> str:
    """Write autotune.json, autotune.md and autotune.png into ``out_dir``; returns the Markdown."""
    return write_files(out_dir, "autotune", result, autotune_markdown, {"autotune.png": plot_autotune})
