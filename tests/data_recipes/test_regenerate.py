"""Regeneration: the target's own replies replace the dataset's, batched, resumable after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.data_recipes.recipes import load_samples
from headstart.data_recipes.regenerate import regenerate_chunk, run_regenerate
from headstart.data_recipes.settings import Generation
from tests.helpers import REPO

CONVERSATIONS = [
    [
        {"role": "user", "content": "Ann has 3 apples and buys 4 more. How many apples?"},
        {"role": "assistant", "content": "old answer"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7+8?"},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "old again"},
    ],
]


def regen_config(target, source, out, **regenerate):
    return {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(source), "format": "gsm8k"},
        "regenerate": {"out": str(out), "max_new_tokens": 12, "chunk_size": 4, **regenerate},
    }


@torch.no_grad()
def test_greedy_replies_equal_the_targets_own_generation(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    rows, cut_off = regenerate_chunk(model, tok, CONVERSATIONS, Generation(max_new_tokens=12))
    assert [[m["role"] for m in r] for r in rows] == [[m["role"] for m in c] for c in CONVERSATIONS]
    assert rows[1][3] == CONVERSATIONS[1][3] and "old" not in json.dumps(rows)
    # Turn 2 of conversation 1 is generated after the regenerated turn 1, alone, without batching.
    prompt = tok.apply_chat_template(rows[1][:4], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id)
    assert tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip() == rows[1][4]["content"]
    assert cut_off == sum(1 for r in rows for m in r if m["role"] == "assistant")  # random weights never stop


def test_output_feeds_the_messages_recipe_and_rerun_reuses_it(tiny_target_dir, gsm8k_file, tmp_path, capsys):
    out = run_regenerate(regen_config(tiny_target_dir, gsm8k_file, tmp_path / "regen.jsonl"))
    lines = out.read_text().splitlines()
    assert len(lines) == 48 and not (tmp_path / "regen.jsonl.parts").exists()
    samples, report = load_samples(str(out), "messages", AutoTokenizer.from_pretrained(tiny_target_dir), 128)
    assert report.kept == 48
    run_regenerate(regen_config(tiny_target_dir, gsm8k_file, out))
    assert "reusing it" in capsys.readouterr().out


def test_sampled_regeneration_resumes_after_sigkill_to_the_same_file(tiny_target_dir, gsm8k_file, tmp_path):
    settings = regen_config(
        tiny_target_dir, gsm8k_file, tmp_path / "ref.jsonl", chunk_size=2, temperature=1.0, top_p=0.9, seed=3
    )
    run_regenerate(settings)
    settings["regenerate"]["out"] = str(tmp_path / "out.jsonl")
    config = tmp_path / "regen.yaml"
    config.write_text(json.dumps(settings))
    cmd = [sys.executable, "-m", "data_recipes.regenerate", "--config", str(config)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parts = tmp_path / "out.jsonl.parts"
    deadline = time.time() + 120
    while not list(parts.glob("part-*.jsonl")) and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert 0 < len(list(parts.glob("part-*.jsonl"))) < 24 and not (tmp_path / "out.jsonl").exists()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "ref.jsonl").read_text()
