"""The README.md model card every export carries: what the head is, its target, how to serve it, and the
draft tree ``eval.autotune`` tuned for it."""

from __future__ import annotations

import json
from pathlib import Path

from headstart.decoding.tree_config import Schedule, load_tree_config
from headstart.heads import HeadConfig
from headstart.scripts.export.medusa import NOT_SERVED

TITLES = {
    "eagle": "EAGLE-1/2",
    "eagle3": "EAGLE-3",
    "medusa": "Medusa",
    "peagle": "P-EAGLE (EAGLE-3, parallel drafting)",
    "dflash": "DFlash",
}
LAYOUTS = {
    "vllm": "the EAGLE repo's layout, as vLLM loads it",
    "sglang": "the EAGLE repo's layout, as SGLang loads it",
    "speculators": "the speculators format (speculators 0.9.0, read by vLLM)",
    "medusa": "the Medusa repo's layout",
}
ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
STEPS = 3  # draft tokens per step in the serve commands; the acceptance counters are per position up to this


def vllm_command(
    target: str, draft: str, method: str, steps: int = STEPS, parallel: bool = False, schedule: Schedule | None = None
) -> str:
    """``parallel``: every depth drafted in one forward (P-EAGLE's ``parallel_drafting``); ``schedule``: vLLM's
    ``num_speculative_tokens_per_batch_size`` (it caps every entry at ``steps``)."""
    spec: dict = {"method": method, "model": draft, "num_speculative_tokens": steps}
    if parallel:
        spec["parallel_drafting"] = True
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    return f"vllm serve {target} --speculative-config '{json.dumps(spec)}'"


def served_schedule(head_dir: str | Path) -> Schedule | None:
    """The chain length per batch size ``eval.autotune`` measured for the head (its tree.json), as vLLM takes it;
    None without one, or where speculation paid at no batch size (vLLM needs num_speculative_tokens >= 1)."""
    path = Path(head_dir) / "tree.json"
    schedule = load_tree_config(path).get("num_speculative_tokens_per_batch_size") if path.is_file() else None
    return schedule if schedule and max(k for _, _, k in schedule) > 0 else None


def parallel_depths(config: HeadConfig) -> int | None:
    """A P-EAGLE head's trained depths, all drafted in one forward; None for any other head."""
    if config.type == "eagle3" and config.options.parallel_drafting is not None:
        return config.options.ttt_steps
    return None


def sglang_command(target: str, draft: str, algorithm: str) -> str:
    return (
        f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {draft} --speculative-num-steps {STEPS} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {STEPS + 1}"
    )


def _block(command: str) -> str:
    return f"```bash\n{command}\n```"


def serve_section(head_config: HeadConfig, fmt: str, target: str, draft: str, head_dir: str) -> str:
    """The exact commands that serve this folder, and what to do where an engine cannot read it."""
    head_type, depths = head_config.type, parallel_depths(head_config)
    schedule = served_schedule(head_dir)
    # An autoregressive draft drafts the schedule's longest chain at most; one-forward drafts keep their block.
    steps = max(k for _, _, k in schedule) if schedule else STEPS
    reexport = f"python -m scripts.export --head {head_dir} --format {{fmt}} --out {{out}}"
    if head_type == "medusa":
        return (
            f"{NOT_SERVED}.\n\nWith the Medusa repo (it loads the target from `base_model_name_or_path`):\n\n"
            + _block(f"python -m medusa.inference.cli --model {draft}")
        )
    if head_type == "dflash":
        # The block the head was trained on: the newest token and block_size - 1 mask slots.
        return (
            "vLLM (one forward drafts the whole block; `method` must be given, vLLM does not sniff it from the "
            "config):\n\n"
            + _block(vllm_command(target, draft, "dflash", head_config.options.block_size - 1, schedule=schedule))
            + "\n\nSGLang 0.5.23 has no DFlash draft."
        )
    no_sglang = (
        "SGLang 0.5.23 cannot serve it: it has no parallel drafting (sgl-project/sglang#23171)."
        if depths
        else "SGLang 0.5.23 does not read the speculators format; export its layout with\n\n"
        + _block(reexport.format(fmt="sglang", out=draft + "-sglang"))
    )
    if fmt == "speculators":
        return (
            "vLLM reads the target from `speculators_config.verifier.name_or_path`:\n\n"
            + _block(f"vllm serve {draft}")
            + "\n\nor names it itself:\n\n"
            + _block(vllm_command(target, draft, "eagle3", depths or steps, bool(depths), schedule))
            + f"\n\n{no_sglang}"
        )
    if depths:  # P-EAGLE: vLLM's eagle3 method with parallel drafting, one forward for all depths
        command = vllm_command(target, draft, "eagle3", depths, parallel=True, schedule=schedule)
        return "vLLM:\n\n" + _block(command) + f"\n\n{no_sglang}"
    if head_type == "eagle3":  # one folder serves both engines (layer ids written in each one's convention)
        return (
            "vLLM:\n\n"
            + _block(vllm_command(target, draft, "eagle3", steps, schedule=schedule))
            + "\n\nSGLang:\n\n"
            + _block(sglang_command(target, draft, "EAGLE3"))
        )
    other = "sglang" if fmt == "vllm" else "vllm"
    command = (
        vllm_command(target, draft, "eagle", steps, schedule=schedule)
        if fmt == "vllm"
        else sglang_command(target, draft, "EAGLE")
    )
    return (
        f"{ENGINES[fmt]}:\n\n{_block(command)}\n\n{ENGINES[other]} needs its own folder (the `architectures` "
        "name and the `fc.bias` differ between the engines):\n\n"
        + _block(reexport.format(fmt=other, out=f"{draft}-{other}"))
    )


def raw_prompt_section(target: str) -> str:
    """How to ask a target that a head trained on raw text (``data.format: text``) drafts for: its completion API,
    the prompt fed as raw text, as the head saw the target's text in training."""
    body = json.dumps({"model": target, "prompt": "Once upon a time,", "max_tokens": 128})
    return (
        "The head was trained on raw text (`data.format: text`): the target is prompted as raw text, with no chat "
        "template, so ask it through the completion API:\n\n"
        + _block(f"curl http://localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{body}'")
        + "\n\n(`model` is the path `vllm serve` was given.) `/v1/chat/completions` needs a chat template, which "
        "the target lacks (a base model), and would prompt it otherwise than the head was trained on. SGLang: its "
        "`/v1/completions` the same way (on its port, 30000 by default)."
    )


def describe(config: HeadConfig) -> list[tuple[str, str]]:
    """Rows of the card's table for the head's own settings."""
    options = config.options
    if config.type == "eagle3":
        rows = [
            ("target layers fused", f"{options.layer_ids} (HF `hidden_states` indices = vLLM aux layer ids)"),
            ("draft vocabulary", f"{options.draft_vocab_size} of the target's {config.vocab_size} tokens"),
        ]
        if options.parallel_drafting is not None:
            rows += [
                ("parallel depths", f"{options.ttt_steps}, drafted in one forward (`num_speculative_tokens` <= this)"),
                ("mask token", f"{options.parallel_drafting.mask_token_id} (the target's embedding of it)"),
            ]
        return rows
    if config.type == "dflash":
        attention = "causal" if options.causal else "bidirectional"
        return [
            ("target layers fused", f"{options.layer_ids} (vLLM `dflash_config.target_layer_ids`: each minus 1)"),
            ("draft layers", str(options.num_layers)),
            ("block", f"{options.block_size} slots, the newest token + {options.block_size - 1} masks: {attention}"),
            ("mask token", f"id {options.mask_token_id}" + (", learned vector" if options.mask_embedding else "")),
        ]
    if config.type == "medusa":
        return [
            ("heads", f"{options.num_heads} (head k guesses the token k+2 ahead)"),
            ("blocks per head", str(options.num_layers)),
        ]
    return [("feature", "the target's last hidden state (after its final norm)")]


def training_rows(config: HeadConfig) -> list[tuple[str, str]]:
    """What the head's training recorded of its acceptance (config.json ``training``): the tau its held-out top-1
    accuracies predict and the tau measured by decoding (``train.eval_prompts``), at the step it was saved."""
    training = config.training or {}
    chain = f"greedy chains of {config.trained_depth}"
    rows = []
    if "predicted_tau" in training:
        rows.append(("predicted tau (training)", f"{training['predicted_tau']:.3f} at step {training['step']}"))
    if "measured_tau" in training:
        measured = f"{training['measured_tau']:.3f} at step {training['step']} ({chain}, "
        measured += f"{training['measured_prompts']} prompts, headstart's engine)"
        rows.append(("measured tau (training)", measured))
    return rows


def model_card(
    config: HeadConfig,
    fmt: str,
    target: str,
    draft: str,
    head_dir: str,
    made_by: str,
    extra_sections: list[str] | None = None,
) -> str:
    """README.md for an export of the head ``config`` in ``fmt``; ``draft`` is how a user names the folder
    (a path or a hub id) and ``made_by`` the command that wrote it."""
    title = TITLES["peagle" if parallel_depths(config) else config.type]
    layout = "vLLM's DFlash layout (`DFlashDraftModel`)" if config.type == "dflash" else LAYOUTS[fmt]
    rows = [("head", title), ("target", f"`{target}`"), ("format", layout), *describe(config), *training_rows(config)]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    acceptance = (
        "\n## Is it working?\n\nA wrongly exported head still runs but accepts almost nothing. Build vLLM's "
        "`LLM(..., disable_log_stats=False)` and read `llm.get_metrics()`: acceptance length = 1 + "
        "sum(`vllm:spec_decode_num_accepted_tokens_per_pos`) / `vllm:spec_decode_num_drafts`.\n"
        if config.type != "medusa"
        else ""
    )
    sections = "".join(f"\n{s.rstrip()}\n" for s in extra_sections or [])
    serve = serve_section(config, fmt, target, draft, head_dir)
    if config.prompt_format == "raw" and config.type != "medusa":  # no engine serves Medusa: nothing to ask
        serve += "\n\n" + raw_prompt_section(target)
    return (
        f"---\ntags:\n- speculative-decoding\n- {config.type}\n- headstart\n---\n\n"
        f"# {title} draft head for `{target}`\n\n{table}\n"
        f"Made with headstart: `{made_by}`.\n\n"
        f"## Serve it\n\n{serve}\n{acceptance}{sections}"
    )


def tree_card_section(head_dir: str | Path) -> list[str]:
    """The model-card section naming the head's tuned tree (``<head>/tree.json``); empty without one."""
    path = Path(head_dir) / "tree.json"
    if not path.is_file():
        return []
    tree = load_tree_config(path)
    where = ", ".join(f"{k} {tree[k]}" for k in ("machine", "device", "dtype", "batch_size") if k in tree)
    lines = [
        "## Tuned draft tree",
        "",
        f"`python -m eval.autotune` picked this tree for the hardware it ran on ({where or 'not recorded'}):",
        "",
        f"- shape: {tree['shape']}, depth {tree['depth']}, top-k {tree['top_k']} (the most children of a node), "
        f"{tree['total_tokens']} draft tokens (the root excluded)",
    ]
    if tree["shape"] == "static":
        lines.append(f"- rank paths (Medusa-style choices): `{json.dumps(tree['choices'])}`")
    if "predicted_tau" in tree:
        lines.append(
            f"- predicted: {tree['predicted_tau']:.2f} tokens per target forward, "
            f"{tree['predicted_tokens_per_s']:.1f} tokens/s "
            f"(plain decoding: {tree['predicted_vanilla_tokens_per_s']:.1f})"
        )
    if tree.get("min_confidence", 0) > 0:
        lines.append(
            f"- adaptive depth: drafting stops at the first level whose likeliest node is below "
            f"{tree['min_confidence']:.3g} (cumulative draft probability)"
        )
    if "speculate_max_batch" in tree:
        lines.append(f"- speculation pays off up to batch size {tree['speculate_max_batch']} on that machine")
    if "num_speculative_tokens_per_batch_size" in tree:
        lines.append(
            "- chain length by batch size, [first, last, k] (vLLM `num_speculative_tokens_per_batch_size`, in the "
            f"serve command above when any k > 0): `{json.dumps(tree['num_speculative_tokens_per_batch_size'])}`"
        )
    if "depth_per_batch_size" in tree:
        lines.append(
            f"- this tree's depth by batch size in headstart's engine: `{json.dumps(tree['depth_per_batch_size'])}`"
        )
    lines += ["", "Trees that pay off on a GPU can lose on a CPU (and back): re-tune on the serving hardware."]
    return ["\n".join(lines)]
