"""Targets prompted as raw text (a base model: no chat template): regeneration of ``text`` data, the model card
of a head trained on raw text, and the served-parity check's raw prompts."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from headstart.data_recipes import regenerate
from headstart.data_recipes.errors import DataError
from headstart.data_recipes.prompts import raw_ids, text_prompt_length
from headstart.data_recipes.regenerate import run_regenerate, text_prompt
from headstart.export.card import raw_prompt_section
from headstart.heads import read_head_config
from headstart.scripts.export import verify_engines
from headstart.scripts.export.command import export_head
from tests.helpers import make_head

TEXTS = [
    "Ann has 3 apples and buys 4 more.  How many   apples does she have now?",
    "What is 7+8? It is 15, and 2+2 is 4.",
    "Tom has 5 pens.\n\nHe gets 10 more pens from his friend at school today.",
]


@pytest.fixture
def texts_file(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def config(target, source, out, data_format="text", **regen):
    return {
        "target": {"path": str(target), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(source), "format": data_format},
        "regenerate": {"out": str(out), "max_new_tokens": 10, "chunk_size": 2, **regen},
    }


def test_a_texts_prompt_is_its_first_half_of_raw_tokens_with_its_own_characters(base_target):
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    assert not tokenizer.chat_template  # conftest's base_target: the bundled target without its template
    for text in TEXTS:
        prefix, ids = text_prompt(tokenizer, text)
        whole = raw_ids(tokenizer, text)
        assert ids == whole[: text_prompt_length(len(whole))] and text.startswith(prefix)
        assert tokenizer.decode(ids) == prefix  # every character the tokens cover, spelled as in the text


@torch.no_grad()
def test_texts_regenerate_greedily_through_hf_and_resume(base_target, texts_file, tmp_path, monkeypatch, one_thread):
    model = AutoModelForCausalLM.from_pretrained(base_target, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    reference = run_regenerate(config(base_target, texts_file, tmp_path / "ref.jsonl"))
    rows = [json.loads(line) for line in reference.read_text().splitlines()]
    assert [list(r) for r in rows] == [["text"]] * len(TEXTS)
    for text, row in zip(TEXTS, rows):
        prefix, ids = text_prompt(tokenizer, text)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_token_id
        )
        assert row["text"] == prefix + tokenizer.decode(out[0], skip_special_tokens=True).removeprefix(prefix)
        assert row["text"] != text
    # Chunk 1 fails: chunk 0's part stays, and the same command resumes without asking for it again.
    asked = []
    generate = regenerate.generate_continuations

    def failing(model, tokenizer, prompts, generation):
        asked.append(len(prompts))
        if len(asked) == 2:
            raise regenerate.EngineError("stopped")
        return generate(model, tokenizer, prompts, generation)

    monkeypatch.setattr(regenerate, "generate_continuations", failing)
    out = tmp_path / "out.jsonl"
    with pytest.raises(regenerate.EngineError, match="1 of 2 parts are kept"):
        run_regenerate(config(base_target, texts_file, out))
    assert [p.name for p in (tmp_path / "out.jsonl.parts").glob("part-*")] == ["part-00000.jsonl"]
    assert run_regenerate(config(base_target, texts_file, out)).read_text() == reference.read_text()
    assert asked == [2, 1, 1]  # the rerun continued only chunk 1's one text


def test_a_bad_text_record_is_named_and_chats_need_a_template(base_target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + json.dumps({"content": "no text"}) + "\n")
    with pytest.raises(DataError, match=rf"{bad}:2: missing field 'text'"):
        run_regenerate(config(base_target, bad, tmp_path / "out.jsonl"))
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n"
    )
    with pytest.raises(
        ValueError, match="data.format 'messages' renders conversations with the target's chat template"
    ):
        run_regenerate(config(base_target, chats, tmp_path / "out.jsonl", "messages"))
    assert not list(tmp_path.glob("out.jsonl*"))


def test_a_raw_heads_card_shows_the_completion_api_and_a_chat_heads_card_does_not(tiny_llama_dir, tmp_path):
    target = LlamaForCausalLM.from_pretrained(tiny_llama_dir).eval()
    head_dir = make_head(target, tmp_path, "eagle3")
    chat_card = (export_head(head_dir, "vllm", tmp_path / "chat") / "README.md").read_text()
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, "prompt_format": "raw"}))
    assert read_head_config(head_dir).prompt_format == "raw"
    raw_card = (export_head(head_dir, "vllm", tmp_path / "raw") / "README.md").read_text()
    body = json.dumps({"model": tiny_llama_dir, "prompt": "Once upon a time,", "max_tokens": 128})
    request = f"curl http://localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{body}'"
    assert request in raw_card and request not in chat_card and "/v1/completions" not in chat_card
    assert "prompted as raw text" in raw_card and "`/v1/chat/completions` needs a chat template" in raw_card
    assert "SGLang: its `/v1/completions` the same way" in raw_card
    # The request comes after the serve commands; everything else is the chat head's card.
    assert raw_card.index(request) > raw_card.index("python -m sglang.launch_server") > raw_card.index("vllm serve")
    same = chat_card.replace(str(tmp_path / "chat"), str(tmp_path / "raw"))
    assert raw_card.replace("\n\n" + raw_prompt_section(tiny_llama_dir), "") == same


def test_verify_engines_prompts_a_template_less_target_raw_on_both_sides(base_target, tmp_path, one_thread):
    """The whole run but the side venv's stages (none here: they are NOT RUN): the resolved prompt format in the
    report and the raw token ids that our side decodes from and vLLM is given."""
    work = tmp_path / "work"
    argv = ["--eagle3", "", "--dflash", "", "--eagle", str(tmp_path / "none"), "--target", str(base_target)]
    argv += ["--engines-python", str(tmp_path / "no-python"), "--prompts", "2", "--max-tokens", "6"]
    with pytest.raises(SystemExit):
        verify_engines.main([*argv, "--work", str(work)])
    report = json.loads((work / "parity.json").read_text())
    assert report["settings"]["prompt_format"] == "raw" and report["heads"][0]["ours"]["drafts"] > 0
    assert report["heads"][0]["served"][0]["status"] == "NOT RUN"
    assert "questions of `assets/data/gsm8k_test.jsonl` as raw text" in (work / "parity.md").read_text()
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    questions = [chat[0]["content"] for chat in verify_engines.prompts(2)]
    assert json.loads((work / verify_engines.PROMPT_IDS).read_text()) == [raw_ids(tokenizer, q) for q in questions]
    with pytest.raises(ValueError, match="no chat template to render chat prompts with"):
        verify_engines.main([*argv, "--work", str(tmp_path / "chat"), "--prompt-format", "chat"])
