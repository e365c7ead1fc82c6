"""``scripts.bench.scale``'s Markdown report (bench_scale.md): a table per stage that ran, as docs/BENCHMARKS.md
holds them.
"""

from __future__ import annotations

from typing import Any


def markdown(result: dict[str, Any]) -> str:
    """The run's figures as the tables docs/BENCHMARKS.md holds: a section per stage that ran."""
    lines: list[str] = []
    if "target" in result:
        t = result["target"]
        lines += [
            f"{result['shape']} shape, {t['num_hidden_layers']} of {t['published_layers']} layers, "
            f"{t['parameters'] / 1e9:.2f}B parameters, {result['dtype']}, {result['machine']}",
        ]
    else:
        lines += [result["machine"]]
    if "capture" in result:
        rates = result["capture"]
        lines += [
            "",
            f"| capture ({rates['samples']} x {rates['tokens'] // rates['samples']} tokens, "
            f"layers {rates['aux_layers']} "
            f"+ last -> {rates['store_dtype']}) | tokens/s |",
            "|---|---|",
            f"| bare forward (with lm_head) | {rates['forward_tokens_per_s']:,.0f} |",
            f"| decoder alone (no lm_head) | {rates['decoder_tokens_per_s']:,.0f} |",
            f"| capture (decoder + hooks + store copy + shard write) | {rates['capture_tokens_per_s']:,.0f} |",
            f"| **capture / forward** (goal >= 0.9x) | **{rates['capture_vs_forward']:.2f}x** |",
            f"| capture / decoder | {rates['capture_vs_decoder']:.2f}x |",
        ]
    if "heads" in result:
        lines += [
            "",
            "| head step | batch x seq | trained parameters | tokens/s | peak memory (MB) |",
            "|---|---|---|---|---|",
        ]
        for head_type, step in result["heads"].items():
            extra = f", TTT {step['ttt_steps']}" if "ttt_steps" in step else ""
            lines.append(
                f"| {head_type} (draft vocab {step['draft_vocab_size']:,}{extra}) | {step['batch'][0]} x "
                f"{step['batch'][1]} | {step['trained_parameters'] / 1e6:,.1f}M | {step['tokens_per_s']:,.1f} "
                f"| {step['peak_memory_mb']:,.0f} |"
            )
    if "verify" in result:
        verify = result["verify"]
        lines += [
            "",
            f"| tree nodes (KV length {verify['kv_length']}) | " + " | ".join(map(str, verify["nodes"])) + " |",
            "|---" * (len(verify["nodes"]) + 1) + "|",
            "| verify ms | " + " | ".join(f"{m:.1f}" for m in verify["ms"]) + " |",
            "| / 1-token step | " + " | ".join(f"{r:.2f}" for r in verify["relative"]) + " |",
        ]
    if "generate" in result:
        gen = result["generate"]
        lines += [
            "",
            f"vanilla decoding, {gen['new_tokens']} new tokens after {gen['prompt_tokens']}: ours "
            f"{gen['ours_tokens_per_s']:.1f} tokens/s, HF generate {gen['hf_generate_tokens_per_s']:.1f} "
            f"({gen['ours_vs_hf']:.2f}x)",
        ]
    if "borrowed" in result:
        lines += ["", *borrowed_markdown(result["borrowed"])]
    if "capture_tp" in result:
        lines += ["", *capture_tp_markdown(result["capture_tp"])]
    return "\n".join(lines) + "\n"


def borrowed_markdown(borrowed: dict[str, Any]) -> list[str]:
    lines = [
        f"| training from shards loads (bf16, {borrowed['machine']}, a fresh process each) | layers | borrowed "
        "tensors (GB) | whole target (GB) | peak RSS, load (MB) | peak RSS, load + fingerprint (MB) | RSS of the "
        "imports (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, entry in borrowed["shapes"].items():
        for label in ("published", "shallow"):
            run = entry[label]
            lines.append(
                f"| {shape} ({label}) | {run['layers']} | {run['borrowed_bytes'] / 1e9:.2f} | "
                f"{run['whole_target_bytes'] / 1e9:.1f} | {run['peak_rss_after_load_mb']:,.0f} | "
                f"{run['peak_rss_mb']:,.0f} | {run['imports_rss_mb']:,.0f} |"
            )
    lines.append("")
    for shape, entry in borrowed["shapes"].items():
        run = entry["published"]
        lines.append(
            f"- {shape}: peak at {run['layers']} layers / at {entry['shallow']['layers']} = "
            f"**{entry['peak_published_vs_shallow']:.3f}x**; whole target / borrowed tensors = "
            f"{entry['whole_target_vs_borrowed']:.1f}x; whole target / peak RSS = "
            f"{entry['whole_target_vs_peak_rss']:.1f}x "
            f"({run['index_tensors']} tensors indexed, {run['decoder_files_missing']} decoder files missing and "
            f"{run['decoder_files_garbage']} garbage)"
        )
    return lines


def capture_tp_markdown(tp: dict[str, Any]) -> list[str]:
    first = next(iter(tp["runs"]))
    lines = [
        f"| capture, bundled target ({tp['samples']} samples, {tp['tokens']:,} tokens, {tp['compute_dtype']}, "
        f"{tp['device']}, best of {tp['repeats']}) | processes x threads | tokens/s | process wall (s) "
        f"| vs tp {first} |",
        "|---|---|---|---|---|",
    ]
    for size, run in tp["runs"].items():
        lines.append(
            f"| tp {size} | {size} x {run['threads_per_process']} | {run['best_tokens_per_s']:,.0f} | "
            f"{run['best_wall_s']:.1f} | **{run['vs_first']:.2f}x** |"
        )
    for size, same in tp["same_as_first"].items():
        diff = same.get("hidden_max_abs_diff")
        lines.append(
            f"\ntp {size} vs tp {first}: token ids {'equal' if same['token_ids_equal'] else 'DIFFERENT'}"
            + (f", hidden states max |diff| {diff:.3g}" if diff is not None else "")
        )
    return lines
