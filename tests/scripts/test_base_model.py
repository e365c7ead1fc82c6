"""A base model (no chat template) from capture to export: text data captured and trained on, the acceptance
measured while training on raw prompts, eval and autotune on raw prompts greedy-identically, and an export whose
model card serves it through the completion API."""

import json

import pytest
import yaml
from transformers import AutoTokenizer

from headstart.data_recipes.capture import run_capture
from headstart.data_recipes.prompts import raw_ids
from headstart.decoding.tree_config import load_tree_config
from headstart.eval import acceptance, autotune
from headstart.heads import read_head_config
from headstart.scripts.export.command import export_head
from headstart.train import eagle
from tests.helpers import GSM8K_ROWS, HELDOUT, SAMPLES, base_config, records, run_here, without_chat_template

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.slow
def test_a_base_model_from_text_capture_to_a_completion_api_export(sharp_target_dir, tmp_path, monkeypatch):
    target = without_chat_template(sharp_target_dir, tmp_path / "base")
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"{r['question']} {r['answer']}"}) + "\n" for r in GSM8K_ROWS))
    cfg = base_config(target, texts, tmp_path / "shards", tmp_path / "run", "eagle3", eval_prompts=3)
    cfg["data"]["format"] = "text"
    cfg["train"]["eval_new_tokens"] = 12
    run_capture(cfg)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_here(monkeypatch, eagle, config)

    out = tmp_path / "run"
    head = read_head_config(out / "head")
    assert head.prompt_format == "raw" and head.training["measured_tau"] == records(out, "measured")[-1]["tau"]
    prompts = [json.loads(line)["input_ids"] for line in (out / "eval_prompts.jsonl").read_text().splitlines()]
    # The held-out texts' first halves, as the tokenizer encodes a completion prompt (raw_ids: BOS where it adds one).
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert len(prompts) == 3 <= HELDOUT < SAMPLES
    assert all(p == raw_ids(tokenizer, tokenizer.decode(p, skip_special_tokens=True))[: len(p)] for p in prompts)

    bench = tmp_path / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"prompt": r["question"]}) + "\n" for r in GSM8K_ROWS[:3]))
    report = acceptance.main(
        ["--target", str(target), "--head", str(out / "head"), "--method", "vanilla,ngram,eagle3"]
        + ["--bench", str(bench), "--max-new-tokens", "12", "--tree", "static", "--depth", "3"]
        + ["--out", str(tmp_path / "eval")]
    )
    assert report["prompt_format_resolved"] == "raw"  # auto: the tokenizer has no template
    assert all(report["methods"][m]["greedy_identical"] for m in ("ngram", "eagle3"))

    argv = ["--target", str(target), "--head", str(out / "head"), "--bench", str(bench), "--calibration", "1"]
    argv += ["--heldout", "1", "--max-new-tokens", "8", "--max-nodes", "4", "--max-depth", "2", "--comb-width", "2"]
    tuned = autotune.main(
        argv + ["--repeats", "1", "--batch-sizes", "1", "--out", str(tmp_path / "at"), "--write-head"]
    )
    assert tuned["prompt_format_resolved"] == "raw" and all(row["greedy_identical"] for row in tuned["grid"])
    assert load_tree_config(out / "head" / "tree.json")["prompt_format"] == "raw"

    card = (export_head(out / "head", "vllm", tmp_path / "export") / "README.md").read_text()
    assert "/v1/completions" in card and "vllm serve" in card
