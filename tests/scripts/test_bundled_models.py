"""The bundled demo models: loadable offline, real chat template, deterministic greedy decoding."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import DRAFT, REPO, TARGET

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "2+3 = <<2+3=5>>5\n#### 5"},
]


def test_layout_imports_after_install_under_headstart_only():
    # From outside the repository: the installed names resolve to the repository's folders, and the bare
    # folder names are not ours (a user's `import eval` or `import scripts` must not find them).
    code = (
        "import importlib.util, json, sys\n"
        "import headstart.core, headstart.heads, headstart.data_recipes, headstart.train, headstart.eval\n"
        "import headstart.scripts\n"
        "bare = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in sys.argv[1:]}\n"
        "print(json.dumps([headstart.heads.__file__, bare]))"
    )
    names = ["core", "heads", "data_recipes", "train", "eval", "scripts"]
    out = subprocess.run([sys.executable, "-c", code, *names], cwd="/", capture_output=True, text=True, check=True)
    heads_file, bare = json.loads(out.stdout)
    assert heads_file == str(REPO / "heads" / "__init__.py")
    assert not [name for name, origin in bare.items() if origin and origin.startswith(str(REPO))]


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_model_folder_is_complete_and_small(path):
    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    ]:
        assert (path / name).is_file(), f"{path / name} missing"
    assert (path / "model.safetensors").stat().st_size < 60e6
    card = (path / "README.md").read_text()
    assert "held-out perplexity" in card and "Sample generations" in card


def test_loads_offline_in_a_fresh_process():
    code = (
        "import sys; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "for p in sys.argv[1:]:\n"
        "    m = AutoModelForCausalLM.from_pretrained(p); t = AutoTokenizer.from_pretrained(p)\n"
        "    print(type(m).__name__, m.dtype, sum(x.numel() for x in m.parameters()), len(t))\n"
    )
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
        "HOME": "/tmp",
        "HF_HOME": "/nonexistent-hf-home",
    }
    out = subprocess.run(
        [sys.executable, "-c", code, str(TARGET), str(DRAFT)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    (t_cls, t_dtype, t_params, t_vocab), (d_cls, d_dtype, d_params, d_vocab) = (
        line.split() for line in out.stdout.strip().splitlines()
    )
    assert t_cls == d_cls == "LlamaForCausalLM"
    assert t_dtype == d_dtype == "torch.bfloat16"
    assert 20e6 <= int(t_params) <= 40e6
    assert 2e6 <= int(d_params) <= 5e6
    assert t_vocab == d_vocab


def test_target_and_draft_share_the_tokenizer():
    assert json.loads((TARGET / "tokenizer.json").read_text()) == json.loads((DRAFT / "tokenizer.json").read_text())


def test_chat_template_round_trip_and_assistant_mask(demo_target):
    _, tok = demo_target
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
        "<|im_start|>assistant\n2+3 = <<2+3=5>>5\n#### 5<|im_end|>\n"
    )
    enc = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    assert tok.decode(ids) == text
    answer = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(answer) == "2+3 = <<2+3=5>>5\n#### 5<|im_end|>"
    assert answer[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    prompt = tok.apply_chat_template(MESSAGES[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_rejects_unknown_role(demo_target):
    _, tok = demo_target
    with pytest.raises(Exception, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def _greedy_without_cache(model, ids, n):
    for _ in range(n):
        next_id = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids


@torch.no_grad()
def test_greedy_generation_is_deterministic_and_matches_argmax_loop(demo_target):
    model, tok = demo_target
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    first = model.generate(ids, max_new_tokens=24, do_sample=False)
    second = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(first, second)
    assert torch.equal(first, _greedy_without_cache(model, ids, first.shape[1] - ids.shape[1]))


@torch.no_grad()
def test_target_answers_heldout_question_in_gsm8k_format(demo_target):
    model, tok = demo_target
    question = json.loads((REPO / "assets/data/gsm8k_test.jsonl").open().readlines()[10])["question"]
    ids = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=200, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert out[0, -1] == tok.eos_token_id, "the target should finish its answer with <|im_end|>"
    assert "<<" in answer and ">>" in answer and "\n#### " in answer, answer
