"""Raw-text prompts (no chat template) through the evaluation harness: the one prompt rule of
``data_recipes.prompts`` reaching bench items, ``eval.run``, ``eval.acceptance`` and ``eval.autotune``, on a
template-less copy of the bundled demo target."""

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from headstart.core.errors import DataError
from headstart.data_recipes.bench import (
    RAW_TURN_OVERHEAD,
    TURN_OVERHEAD,
    BenchItem,
    check_token_ids,
    context_tokens,
    load_bench,
    turn_prompt,
)
from headstart.data_recipes.prompts import render, resolve_prompt_format
from headstart.decoding.proposers import NGram, Vanilla
from headstart.decoding.verify import Sampling
from headstart.eval import acceptance, autotune
from headstart.eval.report import prompts_rendered
from headstart.eval.run import run_methods
from headstart.heads import HeadConfig, build_head, read_head_folder
from tests.helpers import write_jsonl

RAW_LINE = "- prompts: raw text, as a completion API feeds the target (the tokenizer has no chat template)"


@pytest.fixture(scope="module")
def base(base_target):
    return AutoModelForCausalLM.from_pretrained(base_target).eval(), AutoTokenizer.from_pretrained(base_target)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ``ids``, one full forward each: the reference no decoding engine is in."""
    with torch.no_grad():
        for _ in range(n):
            ids = ids + [int(model(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids[-n:]


@pytest.mark.parametrize("add_bos", [False, True])
def test_raw_rendering_is_the_completion_api_tokenization(base_target, tmp_path, add_bos):
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    tokenizer.add_bos_token = add_bos  # the bundled tokenizer adds none; many base models' do
    text = "Ann has 3 apples and buys 4 more."
    expected = tokenizer(text).input_ids
    assert (expected[0] == tokenizer.bos_token_id) is add_bos
    items = load_bench(write_jsonl(tmp_path / "p.jsonl", [{"prompt": text}, {"text": text, "category": "plain"}]))
    assert [item.category for item in items] == ["p", "plain"] and items[1].turns == [text]
    for item in items:
        assert resolve_prompt_format(tokenizer, "auto") == "raw"
        assert turn_prompt(tokenizer, item, [], "auto")[0].tolist() == expected


def test_a_later_raw_turn_continues_the_text_so_far(base):
    _, tokenizer = base
    item = BenchItem("q", "chat", ["What is 2+2?", "And 3+3?"], [{"role": "system", "content": "Be brief."}])
    first = turn_prompt(tokenizer, item, [], "raw")[0].tolist()
    second = turn_prompt(tokenizer, item, ["It is 4."], "raw")[0].tolist()
    assert first == tokenizer("Be brief.\n\nWhat is 2+2?").input_ids
    assert second == tokenizer("Be brief.\n\nWhat is 2+2?\n\nIt is 4.\n\nAnd 3+3?").input_ids
    # No template markers: a raw turn costs its text, its reply and RAW_TURN_OVERHEAD, not TURN_OVERHEAD.
    rendered = len(tokenizer("Be brief.\n\nWhat is 2+2?\n\nAnd 3+3?").input_ids)
    assert context_tokens(tokenizer, item, 10, "auto") == rendered + 2 * (10 + RAW_TURN_OVERHEAD)
    assert RAW_TURN_OVERHEAD < TURN_OVERHEAD


def test_input_ids_records_are_fed_as_they_are(demo_target, tmp_path):
    _, tokenizer = demo_target  # a tokenizer with a chat template: neither format touches the ids
    path = write_jsonl(tmp_path / "eval_prompts.jsonl", [{"input_ids": [5, 6, 7], "category": "heldout"}])
    (item,) = load_bench(path)
    assert (item.input_ids, item.category, len(item.turns), item.id) == ([5, 6, 7], "heldout", 1, f"{path}:1")
    for prompt_format in ("chat", "raw"):
        assert turn_prompt(tokenizer, item, [], prompt_format)[0].tolist() == [5, 6, 7]
    assert context_tokens(tokenizer, item, 8, "chat") == 3 + 8
    check_token_ids(tokenizer, [item])  # in the vocabulary: passes
    past = BenchItem("q9", "heldout", [""], input_ids=[5, len(tokenizer)])
    with pytest.raises(ValueError, match=rf"bench item q9 \(heldout\): token id {len(tokenizer)} is past"):
        check_token_ids(tokenizer, [item, past])


@pytest.mark.parametrize(
    "ids, message",
    [
        ([], "non-empty list of integer"),
        ("5 6 7", "non-empty list of integer"),
        ([5, "6"], "non-empty list of integer"),
        ([5, 6.0], "non-empty list of integer"),
        ([5, True], "non-empty list of integer"),
        ([5, -1], "negative token id -1"),
    ],
)
def test_bad_input_ids_records_name_file_and_line(tmp_path, ids, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"input_ids": [1, 2]}, {"input_ids": ids}])
    with pytest.raises(DataError, match=message) as err:
        load_bench(path)
    assert str(err.value).startswith(f"{path}:2: ")


def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded: the run should have been refused before")


@pytest.mark.parametrize("command", ["acceptance", "autotune"])
def test_chat_on_a_template_less_target_and_foreign_ids_are_refused_before_decoding(
    command, base_target, tmp_path, monkeypatch
):
    module = {"acceptance": acceptance, "autotune": autotune}[command]
    monkeypatch.setattr(module, "load_decoding_target", no_model)
    rows = [{"prompt": "Ann has 3 apples."}, {"input_ids": [5, 6]}]
    argv = ["--target", str(base_target), "--bench", str(write_jsonl(tmp_path / "p.jsonl", rows))]
    argv += ["--method", "vanilla"] if command == "acceptance" else ["--self-spec", "--calibration", "1"]
    argv += ["--heldout", "1"] if command == "autotune" else []
    with pytest.raises(ValueError, match=r"has no chat template .* \(--prompt-format raw, or auto\)"):
        module.main([*argv, "--prompt-format", "chat", "--out", str(tmp_path / "out")])
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Ann has 3 apples."}, {"input_ids": [5, 8192]}])
    with pytest.raises(ValueError, match=r"p.jsonl:2 \(p\): token id 8192 is past the target tokenizer's 8192"):
        module.main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_auto_is_chat_with_a_template_and_raw_can_be_forced(demo_target, one_thread):
    model, tokenizer = demo_target
    assert resolve_prompt_format(tokenizer, "auto") == "chat"
    text = "What is 12 plus 30?"
    raw = tokenizer(text).input_ids
    assert render(tokenizer, [{"role": "user", "content": text}], "raw")[0].tolist() == raw
    assert render(tokenizer, [{"role": "user", "content": text}])[0].tolist() != raw  # auto: the template
    assert prompts_rendered("auto", "chat").endswith("(auto: the tokenizer has one)")
    assert prompts_rendered("raw", "raw") == "raw text, as a completion API feeds the target (--prompt-format raw)"
    items = [BenchItem("t", "math", [text]), BenchItem("i", "ids", [""], input_ids=raw)]
    runs = run_methods(model, tokenizer, {"vanilla": Vanilla(), "ngram": NGram(k=3)}, items, 6, Sampling(), 0, "raw")
    reference = greedy(model, raw, 6)
    # The text rendered raw, its token ids fed as they are: the same prompt, the same greedy tokens.
    assert runs["vanilla"].outputs == runs["ngram"].outputs == [[reference], [reference]]


def test_acceptance_on_a_template_less_target_renders_raw_prompts(base, base_target, tmp_path, one_thread, monkeypatch):
    model, tokenizer = base
    head = tmp_path / "eagle3"
    build_head({"type": "eagle3", "layer_ids": [1, 4, 7], "draft_vocab_size": 256}, model, tokenizer).save_pretrained(
        head
    )
    rows = [
        {"question_id": 1, "category": "chat", "turns": ["Ann has 3 apples.", "She buys 4 more. How many?"]},
        {"text": "Tom has 5 pens and", "category": "text"},
        {"input_ids": tokenizer("Ann has 3 apples.").input_ids, "category": "heldout"},
    ]
    bench = write_jsonl(tmp_path / "bench.jsonl", rows)
    out = tmp_path / "r"
    argv = ["--target", str(base_target), "--head", str(head), "--method", "vanilla,ngram,eagle3"]
    argv += ["--bench", str(bench), "--max-new-tokens", "6", "--depth", "2", "--total-tokens", "4"]
    reads = []  # every config.json parsed: the head folder is read once for the whole run
    from_json = HeadConfig.from_json.__func__
    monkeypatch.setattr(HeadConfig, "from_json", classmethod(lambda cls, *a: reads.append(a[1]) or from_json(cls, *a)))
    report = acceptance.main([*argv, "--out", str(out)])  # no --prompt-format: auto, as the demo's stages run it
    assert reads == [head / "config.json"]
    assert (report["prompt_format"], report["prompt_format_resolved"]) == ("auto", "raw")
    assert report["prompts"] == 3 and set(report["methods"]["vanilla"]["per_category"]) == {"chat", "text", "heldout"}
    decoded = report["methods"]["vanilla"]["new_tokens"]
    assert 0 < decoded <= 4 * 6  # 2 + 1 + 1 turns of at most 6 tokens (the demo target may stop sooner)
    for name, entry in report["methods"].items():
        assert entry["greedy_identical"] is True and entry["new_tokens"] == decoded, name
    saved = json.loads((out / "report.json").read_text())
    assert (saved["prompt_format"], saved["prompt_format_resolved"]) == ("auto", "raw")
    assert RAW_LINE in (out / "report.md").read_text()
    config = (out / "eval_config.yaml").read_text()
    assert yaml.safe_load(config)["eval"]["prompt_format"] == "auto"  # `headstart eval --config` runs auto again
    assert config.startswith("# prompts: raw text, as a completion API feeds the target (the tokenizer has no chat")


def test_autotune_on_a_template_less_target_tunes_on_raw_prompts(base_target, gsm8k_file, tmp_path, one_thread):
    out = tmp_path / "at"
    argv = ["--target", str(base_target), "--self-spec", "--exit-layers", "2", "--bench", str(gsm8k_file)]
    argv += ["--calibration", "1", "--heldout", "1", "--max-new-tokens", "6", "--max-nodes", "4", "--max-depth", "2"]
    result = autotune.main([*argv, "--comb-width", "2", "--repeats", "1", "--batch-sizes", "1", "--out", str(out)])
    assert (result["prompt_format"], result["prompt_format_resolved"]) == ("auto", "raw")
    assert all(row["greedy_identical"] for row in result["grid"])
    # The KV length the costs were timed at: the raw question (no template markers) plus half the new tokens.
    question = json.loads(gsm8k_file.read_text().splitlines()[0])["question"]
    tokenizer = AutoTokenizer.from_pretrained(base_target)
    assert result["kv_length"] == round(len(tokenizer(question).input_ids) + 6 / 2)
    saved = json.loads((out / "autotune.json").read_text())
    assert saved["prompt_format_resolved"] == "raw" and RAW_LINE in (out / "autotune.md").read_text()
    assert (out / "autotune_config.yaml").read_text().startswith("# prompts: raw text")


def test_a_head_trained_on_other_prompts_is_named(tmp_path, capsys):
    from tests.helpers import make_head, tiny_llama

    head = make_head(tiny_llama(), tmp_path, "eagle")
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {"prompt_format": "chat"}))
    acceptance.warn_prompt_formats({"eagle": read_head_folder(head)}, "chat")
    assert capsys.readouterr().err == ""
    acceptance.warn_prompt_formats({"eagle": read_head_folder(head)}, "raw")
    assert "trained on chat prompts, evaluated here on raw ones (--prompt-format chat" in capsys.readouterr().err
