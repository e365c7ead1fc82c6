"""The README.md model card every export carries: what the head is, its target, how to serve it, and the
draft tree ``eval.autotune`` tuned for it. A head type's own rows and serve commands come from its layouts module
(``layouts.EngineLayouts.describe``, ``serve``); the commands' pieces they are built from are here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from headstart.decoding.tree_config import Schedule, load_tree_config
from headstart.export.common import captures_natively
from headstart.export.layouts import EngineLayouts
from headstart.heads import HeadConfig, drafting_of

ENGINES = {"vllm": "vLLM", "sglang": "SGLang"}
STEPS = 3  # draft tokens per step in the serve commands; the acceptance counters are per position up to this


def vllm_command(
    target: str,
    draft: str,
    method: str,
    steps: int = STEPS,
    parallel: bool = False,
    schedule: Schedule | None = None,
    aux_family: str | None = None,
) -> str:
    """``parallel``: every depth drafted in one forward (P-EAGLE's ``parallel_drafting``); ``schedule``: vLLM's
    ``num_speculative_tokens_per_batch_size`` (it caps every entry at ``steps``); ``aux_family``: the target family
    of a draft reading aux hidden states, served through vLLM's Transformers backend where vLLM's own class for it
    captures none (``common.AUX_CAPTURE``)."""
    spec: dict = {"method": method, "model": draft, "num_speculative_tokens": steps}
    if parallel:
        spec["parallel_drafting"] = True
    if schedule:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    backend = ["--model-impl", "transformers"] if aux_family and not captures_natively(aux_family, "vllm") else []
    return shlex.join(["vllm", "serve", target, *backend, "--speculative-config", json.dumps(spec)])


def served_schedule(head_dir: str | Path) -> Schedule | None:
    """The chain length per batch size ``eval.autotune`` measured for the head (its tree.json), as vLLM takes it;
    None without one, or where speculation paid at no batch size (vLLM needs num_speculative_tokens >= 1)."""
    path = Path(head_dir) / "tree.json"
    schedule = load_tree_config(path).get("num_speculative_tokens_per_batch_size") if path.is_file() else None
    return schedule if schedule and max(k for _, _, k in schedule) > 0 else None


def sglang_command(target: str, draft: str, algorithm: str) -> str:
    return shlex.join(
        ["python", "-m", "sglang.launch_server", "--model-path", target, "--speculative-algorithm", algorithm]
        + ["--speculative-draft-model-path", draft, "--speculative-num-steps", str(STEPS), "--speculative-eagle-topk"]
        + ["1", "--speculative-num-draft-tokens", str(STEPS + 1)]
    )


def code_block(command: str) -> str:
    """A shell command (built with ``shlex.join``: every value quoted, so a path with a space or a ``;`` stays one
    argument when the line is pasted) as a Markdown block."""
    return f"```bash\n{command}\n```"


def served_steps(schedule: Schedule | None) -> int:
    """Draft tokens per step of an autoregressive draft: the schedule's longest chain at most, else ``STEPS``."""
    return max(k for _, _, k in schedule) if schedule else STEPS


def reexport_command(head_dir: str, fmt: str, out: str) -> str:
    return code_block(export_command(head_dir, fmt, out))


def export_command(head_dir: str | Path, fmt: str, out: str | Path) -> str:
    """The command that writes ``head_dir`` in layout ``fmt`` to ``out``."""
    return shlex.join(["python", "-m", "scripts.export", "--head", str(head_dir), "--format", fmt, "--out", str(out)])


def raw_prompt_section(target: str) -> str:
    """How to ask a target that a head trained on raw text (``data.format: text``) drafts for: its completion API,
    the prompt fed as raw text, as the head saw the target's text in training."""
    body = json.dumps({"model": target, "prompt": "Once upon a time,", "max_tokens": 128})
    return (
        "The head was trained on raw text (`data.format: text`): the target is prompted as raw text, with no chat "
        "template, so ask it through the completion API:\n\n"
        + code_block(
            shlex.join(
                ["curl", "http://localhost:8000/v1/completions", "-H", "Content-Type: application/json", "-d", body]
            )
        )
        + "\n\n(`model` is the path `vllm serve` was given.) `/v1/chat/completions` needs a chat template, which "
        "the target lacks (a base model), and would prompt it otherwise than the head was trained on. SGLang: its "
        "`/v1/completions` the same way (on its port, 30000 by default)."
    )


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
    layouts: EngineLayouts,
    fmt: str,
    target: str,
    draft: str,
    head_dir: str,
    made_by: str,
    extra_sections: list[str] | None = None,
) -> str:
    """README.md for an export of the head ``config`` in ``fmt``, one of its head type's ``layouts``; ``draft`` is
    how a user names the folder (a path or a hub id) and ``made_by`` the command that wrote it."""
    drafting = drafting_of(config)
    title = drafting.card_title or drafting.title
    rows = [("head", title), ("target", f"`{target}`"), ("format", layouts.layout(fmt)), *layouts.describe(config)]
    rows += training_rows(config)
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    acceptance = (
        "\n## Is it working?\n\nA wrongly exported head still runs but accepts almost nothing. Build vLLM's "
        "`LLM(..., disable_log_stats=False)` and read `llm.get_metrics()`: acceptance length = 1 + "
        "sum(`vllm:spec_decode_num_accepted_tokens_per_pos`) / `vllm:spec_decode_num_drafts`.\n"
        if layouts.SERVED
        else ""
    )
    sections = "".join(f"\n{s.rstrip()}\n" for s in extra_sections or [])
    serve = layouts.serve(config, fmt, target, draft, head_dir)
    if config.prompt_format == "raw" and layouts.SERVED:  # no engine serves it: nothing to ask
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
            f"{tree['min_confidence']:.3g} (estimated acceptance: the cumulative draft probability, DSpark's "
            "confidence head)"
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
