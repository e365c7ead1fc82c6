"""Dataset recipes: formats, sources, assistant-only loss masks, truncation and bad-record errors."""

import copy
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from headstart.data_recipes.errors import DataError
from headstart.data_recipes.formats import FORMATS, check_messages, get_format
from headstart.data_recipes.recipes import RecipeReport, load_samples, read_conversations, tokenize_messages
from headstart.data_recipes.sources import read_records
from headstart.scripts.dev.build_demo_models import CHAT_TEMPLATE, build_tokenizer
from tests.helpers import write_jsonl


def system(content):
    return {"role": "system", "content": content}


def user(content):
    return {"role": "user", "content": content}


def assistant(content):
    return {"role": "assistant", "content": content}


SYSTEM = system("Be brief.")
CHATS = [
    [user("What is 2+3?"), assistant("2+3 = 5\n#### 5")],
    [
        SYSTEM,
        user("Tom has 4 pens. He buys 3?"),
        assistant("4+3 = 7\n#### 7"),
        user("Loses 2?"),
        assistant(" 7-2 = 5 ✓ Ü"),
    ],
    [user("Say 42"), assistant("42")],  # the user repeats the answer: only the assistant's copy is masked
]
GSM8K_ROW = {"question": "Sam has 3 pens and buys 5 more. How many pens?", "answer": "3+5 = 8\n#### 8"}


@pytest.fixture(scope="module")
def tokenizers():
    """The bundled-style tokenizer (ChatML with {% generation %}) and a copy without the markers."""
    marked = build_tokenizer(CHATS, vocab_size=400, min_frequency=1)
    plain = copy.deepcopy(marked)
    plain.chat_template = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    return marked, plain


def masked_text(tokenizer, input_ids, loss_mask):
    return tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m])


FORMAT_CASES = {
    "sharegpt": (
        {"conversations": [{"from": f, "value": v} for f, v in [("system", "S"), ("human", "Q"), ("gpt", "A")]]},
        [system("S"), user("Q"), assistant("A")],
    ),
    "sharegpt user/chatgpt": (
        {"conversations": [{"from": "user", "value": "Q"}, {"from": "chatgpt", "value": "A"}]},
        [user("Q"), assistant("A")],
    ),
    "messages": (
        {"messages": [SYSTEM, {"role": "user", "content": "Q", "name": "x"}, assistant("A")]},
        [SYSTEM, user("Q"), assistant("A")],
    ),
    "alpaca": (
        {"instruction": "Add.", "input": "2 and 3", "output": "5", "system": "S"},
        [system("S"), user("Add.\n\n2 and 3"), assistant("5")],
    ),
    "alpaca no input": (
        {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
        [user("Add 2 and 3."), assistant("5")],
    ),
    "gsm8k": (GSM8K_ROW, [user(GSM8K_ROW["question"]), assistant(GSM8K_ROW["answer"])]),
}


@pytest.mark.parametrize("case", FORMAT_CASES)
def test_format_maps_record_to_messages(case):
    record, expected = FORMAT_CASES[case]
    assert get_format(case.split()[0])(record) == expected


@pytest.mark.parametrize("case", FORMAT_CASES)
def test_load_samples_masks_exactly_the_assistant_tokens(tmp_path, tokenizers, case):
    record, messages = FORMAT_CASES[case]
    tokenizer = tokenizers[0]
    source = write_jsonl(tmp_path / "data.jsonl", [record])
    (sample,), report = load_samples(source, case.split()[0], tokenizer, max_length=256)
    assert masked_text(tokenizer, sample.input_ids, sample.loss_mask) == messages[-1]["content"] + "<|im_end|>"
    assert sample.source == f"{source}:1"
    assert (report.read, report.kept) == (1, 1)


def test_unknown_format_lists_known_ones():
    with pytest.raises(ValueError, match="known formats: alpaca, gsm8k, messages, sharegpt, text"):
        get_format("chatml")
    assert sorted(FORMATS) == ["alpaca", "gsm8k", "messages", "sharegpt", "text"]


def test_text_role_is_only_valid_alone():
    with pytest.raises(DataError, match="message 0: unknown role 'text'"):
        check_messages([{"role": "text", "content": "a"}, assistant("b")])


@pytest.mark.parametrize("path", ["generation blocks", "character spans"])
@pytest.mark.parametrize("chat", CHATS, ids=["single-turn", "multi-turn", "echo"])
def test_mask_covers_exactly_the_assistant_turns(tokenizers, path, chat):
    tokenizer = tokenizers[0] if path == "generation blocks" else tokenizers[1]
    input_ids, loss_mask, truncated = tokenize_messages(tokenizer, chat, max_length=1024)
    expected = "".join(m["content"] + "<|im_end|>" for m in chat if m["role"] == "assistant")
    assert masked_text(tokenizer, input_ids, loss_mask) == expected
    assert input_ids == tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert not truncated


@pytest.mark.parametrize("chat", CHATS, ids=["single-turn", "multi-turn", "echo"])
def test_both_mask_paths_agree(tokenizers, chat):
    marked, plain = tokenizers
    assert tokenize_messages(marked, chat, 1024) == tokenize_messages(plain, chat, 1024)


def test_spans_follow_templates_that_trim_content(tokenizers):
    # Llama-3 style: BOS from the template, a header, the content trimmed, an end-of-turn token.
    tokenizer = copy.deepcopy(tokenizers[1])
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}<|pad|>\n\n"
        "{{ m['content'] | trim }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant<|pad|>\n\n{% endif %}"
    )
    input_ids, loss_mask, _ = tokenize_messages(tokenizer, CHATS[1], 1024)
    assert input_ids[0] == tokenizer.bos_token_id and loss_mask[0] == 0
    expected = "".join(m["content"].strip() + "<|im_end|>" for m in CHATS[1] if m["role"] == "assistant")
    assert masked_text(tokenizer, input_ids, loss_mask) == expected


def test_text_format_trains_on_every_token(tmp_path, tokenizers):
    assert get_format("text")({"text": "plain"}) == [{"role": "text", "content": "plain"}]
    tokenizer = tokenizers[0]
    source = write_jsonl(tmp_path / "text.jsonl", [{"text": "Plain text, 12 tokens or so."}])
    (sample,), _ = load_samples(source, "text", tokenizer, max_length=256)
    assert sample.input_ids == tokenizer("Plain text, 12 tokens or so.")["input_ids"]
    assert sample.loss_mask == [1] * len(sample.input_ids)


def test_chats_on_a_tokenizer_without_a_template_are_refused_naming_the_way_out(tmp_path, tokenizers):
    base = copy.deepcopy(tokenizers[0])
    base.chat_template = None  # a base model's tokenizer
    source = write_jsonl(tmp_path / "chats.jsonl", [GSM8K_ROW])
    with pytest.raises(ValueError, match=r"chats.jsonl: data.format 'gsm8k' .* has none .*use data.format: text"):
        load_samples(source, "gsm8k", base, max_length=64)
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "Plain text."}])
    assert len(load_samples(text, "text", base, max_length=64)[0]) == 1  # raw text needs no template


def test_truncation_keeps_the_head_and_is_counted(tmp_path, tokenizers, capsys):
    tokenizer = tokenizers[0]
    full_ids, full_mask, _ = tokenize_messages(tokenizer, get_format("gsm8k")(GSM8K_ROW), 1024)
    cut = full_mask.index(1) + 3  # three answer tokens survive
    source = write_jsonl(tmp_path / "data.jsonl", [GSM8K_ROW])
    (sample,), report = load_samples(source, "gsm8k", tokenizer, max_length=cut)
    assert (sample.input_ids, sample.loss_mask) == (full_ids[:cut], full_mask[:cut])
    assert sum(sample.loss_mask) == 3
    assert (report.kept, report.truncated) == (1, 1)
    assert "truncated 1" in capsys.readouterr().out


@pytest.mark.parametrize("tokenizer_index", [0, 1], ids=["generation-blocks", "spans"])
def test_a_conversation_past_max_length_splits_at_its_turn_ends_losing_nothing(tmp_path, tokenizers, tokenizer_index):
    tokenizer, chat = tokenizers[tokenizer_index], CHATS[1]  # system, user, assistant, user, assistant
    full_ids, full_mask, _ = tokenize_messages(tokenizer, chat, 1024)
    turn_end = next(k for k in range(1, len(full_ids)) if full_mask[k - 1] and not full_mask[k])  # first reply's end
    assert len(full_ids) - turn_end < turn_end + 2  # the second exchange alone fits what the first does
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": chat}])
    samples, report = load_samples(source, "messages", tokenizer, max_length=turn_end + 2, over_length="split")
    assert [len(s.input_ids) for s in samples] == [turn_end, len(full_ids) - turn_end]  # cut where the turn ends
    assert sum((s.input_ids for s in samples), []) == full_ids and sum((s.loss_mask for s in samples), []) == full_mask
    assert [s.source for s in samples] == [
        f"{source}:1 (tokens 0-{turn_end - 1})",
        f"{source}:1 (tokens {turn_end}-{len(full_ids) - 1})",
    ]
    assert (report.kept, report.split, report.truncated) == (2, 1, 0)
    # A turn longer than max_length alone is cut inside it: every reply token still trains, no piece past 5 tokens.
    samples, report = load_samples(source, "messages", tokenizer, max_length=5, over_length="split")
    assert sum(sum(s.loss_mask) for s in samples) == sum(full_mask) and max(len(s.input_ids) for s in samples) <= 5
    assert report.split == 1 and report.dropped_empty_mask > 0  # the pieces of only system and user tokens


def test_a_conversation_past_max_length_is_refused_naming_it_when_asked(tmp_path, tokenizers, capsys):
    tokenizer = tokenizers[0]
    full_ids, _, _ = tokenize_messages(tokenizer, CHATS[1], 1024)
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}])
    expected = rf"chats.jsonl:2: the conversation is {len(full_ids)} tokens, past data.max_length={len(full_ids) - 1}"
    with pytest.raises(DataError, match=expected):
        load_samples(source, "messages", tokenizer, max_length=len(full_ids) - 1, over_length="refuse")
    samples, report = load_samples(
        source, "messages", tokenizer, max_length=len(full_ids) - 1, on_error="skip", over_length="refuse"
    )
    assert [s.source for s in samples] == [f"{source}:1"] and (report.skipped, report.truncated) == (1, 0)
    assert "skipping" in capsys.readouterr().out


def test_samples_without_assistant_tokens_are_dropped_and_counted(tmp_path, tokenizers):
    tokenizer = tokenizers[0]
    _, full_mask, _ = tokenize_messages(tokenizer, get_format("gsm8k")(GSM8K_ROW), 1024)
    short = {"question": "Hi?", "answer": "Hello."}
    source = write_jsonl(tmp_path / "data.jsonl", [GSM8K_ROW, short])
    samples, report = load_samples(source, "gsm8k", tokenizer, max_length=full_mask.index(1))
    assert [s.source for s in samples] == [f"{source}:2"]
    assert (report.read, report.kept, report.dropped_empty_mask, report.truncated) == (2, 1, 1, 0)


BAD_RECORDS = {
    "bad JSON": ('{"question": "Q", "answer": ', "gsm8k", r"not valid JSON"),
    "missing field": ({"question": "Q"}, "gsm8k", r"missing field 'answer'"),
    "wrong type": ({"question": "Q", "answer": 42}, "gsm8k", r"field 'answer' is int, expected str"),
    "empty conversation": ({"messages": []}, "messages", r"conversation is empty"),
    "empty content": ({"question": "Q", "answer": " "}, "gsm8k", r"message 1 \(assistant\): content is empty"),
    "unknown role": (
        {"messages": [{"role": "tool", "content": "x"}, assistant("A")]},
        "messages",
        r"message 0: unknown role 'tool'",
    ),
    "unknown speaker": (
        {"conversations": [{"from": "robot", "value": "x"}]},
        "sharegpt",
        r"conversations\[0\]: unknown 'from' value 'robot'",
    ),
    "no assistant turn": (
        {"messages": [SYSTEM, user("Q")]},
        "messages",
        r"conversation has no assistant turn",
    ),
}
GOOD_RECORDS = {
    "gsm8k": GSM8K_ROW,
    "messages": {"messages": CHATS[0]},
    "sharegpt": {"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]},
}


@pytest.mark.parametrize("case", BAD_RECORDS)
def test_bad_record_error_names_file_and_line(tmp_path, tokenizers, case):
    bad, format, reason = BAD_RECORDS[case]
    source = write_jsonl(tmp_path / "bad.jsonl", [GOOD_RECORDS[format], "", bad])
    with pytest.raises(DataError, match=rf"bad.jsonl:3: {reason}") as info:
        load_samples(source, format, tokenizers[0], max_length=256)
    assert info.value.location == f"{source}:3"


def test_template_exceptions_become_data_errors(tmp_path, tokenizers):
    no_system = copy.deepcopy(tokenizers[0])
    no_system.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('system role not supported') }}{% endif %}"
        + CHAT_TEMPLATE
    )
    source = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[1]}])
    with pytest.raises(DataError, match=r"bad.jsonl:1: chat template rejected the conversation: system role not"):
        load_samples(source, "messages", no_system, max_length=256)


def test_skip_counts_bad_records_and_keeps_the_good_ones(tmp_path, tokenizers, capsys):
    source = write_jsonl(tmp_path / "mixed.jsonl", [GSM8K_ROW, "{oops", {"question": "Q"}, GSM8K_ROW])
    samples, report = load_samples(source, "gsm8k", tokenizers[0], max_length=256, on_error="skip")
    assert [s.source for s in samples] == [f"{source}:1", f"{source}:4"]
    assert (report.read, report.kept, report.skipped) == (4, 2, 2)
    assert report.skipped_locations == [f"{source}:2", f"{source}:3"]
    assert report.summary() == (
        "read 4, kept 2, truncated 0, split 0, dropped 0 (no assistant tokens left), skipped 2 bad records"
    )
    assert capsys.readouterr().out.splitlines() == [
        f"skipping {source}:2: not valid JSON (Expecting property name enclosed in double quotes at column 2)",
        f"skipping {source}:3: missing field 'answer' (fields: ['question'])",
        f"{source}: {report.summary()}",
    ]


def test_limit_stops_after_that_many_kept_samples(tmp_path, tokenizers):
    source = write_jsonl(tmp_path / "data.jsonl", [GSM8K_ROW] * 5)
    samples, report = load_samples(source, "gsm8k", tokenizers[0], max_length=256, limit=2)
    assert len(samples) == 2 and report.read == 2


def test_read_conversations_yields_validated_messages(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", [GSM8K_ROW, {"question": "Q"}, GSM8K_ROW, GSM8K_ROW])
    report = RecipeReport()
    conversations = list(read_conversations(source, "gsm8k", on_error="skip", limit=2, report=report))
    assert conversations == [
        (f"{source}:1", get_format("gsm8k")(GSM8K_ROW)),
        (f"{source}:3", get_format("gsm8k")(GSM8K_ROW)),
    ]
    assert (report.read, report.skipped) == (3, 1)


def test_json_and_parquet_sources(tmp_path, tokenizers):
    tokenizer = tokenizers[0]
    rows = [GSM8K_ROW, {"question": "Hi?", "answer": "Hello."}]
    json_path = tmp_path / "data.json"
    json_path.write_text(json.dumps(rows))
    parquet_path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    assert list(read_records(str(json_path))) == [(f"{json_path}:[0]", rows[0]), (f"{json_path}:[1]", rows[1])]
    assert list(read_records(str(parquet_path))) == [
        (f"{parquet_path}:row 0", rows[0]),
        (f"{parquet_path}:row 1", rows[1]),
    ]
    expected = [tokenize_messages(tokenizer, get_format("gsm8k")(row), 256)[0] for row in rows]
    for path in (json_path, parquet_path):
        samples, _ = load_samples(str(path), "gsm8k", tokenizer, max_length=256)
        assert [s.input_ids for s in samples] == expected


def test_jsonl_skips_blank_lines_and_counts_lines_from_one(tmp_path):
    source = write_jsonl(tmp_path / "data.jsonl", [{"a": 1}, "", "  ", {"a": 2}])
    assert list(read_records(source)) == [(f"{source}:1", {"a": 1}), (f"{source}:4", {"a": 2})]


def test_missing_local_file_is_not_looked_up_on_the_hub(tmp_path):
    # DatasetNotFoundError is a FileNotFoundError too: the message shows the hub was never asked.
    with pytest.raises(FileNotFoundError, match=r"^data file not found: .*missing\.jsonl$"):
        list(read_records(str(tmp_path / "missing.jsonl")))
    with pytest.raises(FileNotFoundError, match=r"^data file not found: \./nowhere$"):
        list(read_records("./nowhere"))


def test_a_text_role_in_a_chat_record_is_refused(tmp_path):
    # Only the text format makes a "text" message; from a chat it would train as raw text, every token in the loss.
    text_turn = {"messages": [{"role": "text", "content": "Ann has 3 apples. She buys 4 more."}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [GOOD_RECORDS["messages"], text_turn])
    reason = "message 0: unknown role 'text'; expected one of system, user, assistant"
    with pytest.raises(DataError, match=f"^{re.escape(f'{source}:2: {reason}')}$"):
        list(read_conversations(source, "messages"))
    report = RecipeReport()
    kept = [location for location, _ in read_conversations(source, "messages", on_error="skip", report=report)]
    assert kept == [f"{source}:1"] and report.skipped_locations == [f"{source}:2"]


def test_a_line_that_is_not_utf8_names_file_and_line_and_skip_skips_it(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(GSM8K_ROW).encode()
    latin1 = '{"question": "Café?", "answer": "Oui."}'.encode("latin-1")
    path.write_bytes(b"\n".join([good, latin1, good, b""]))
    reason = "not UTF-8 text (byte 0xe9 at byte 18 of the line): re-encode the file as UTF-8"
    with pytest.raises(DataError, match=f"^{re.escape(f'{path}:2: {reason}')}$"):
        list(read_conversations(str(path), "gsm8k"))
    report = RecipeReport()
    kept = [location for location, _ in read_conversations(str(path), "gsm8k", on_error="skip", report=report)]
    assert kept == [f"{path}:1", f"{path}:3"] and report.skipped_locations == [f"{path}:2"]


def test_a_json_file_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b'[\n{"question": "Q", "answer": "A"},\n{"question": "Caf\xe9"}\n]')
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:3: not UTF-8 text \(byte 0xe9\)"):
        list(read_records(str(path)))


@pytest.mark.parametrize("damage", ["truncated", "not parquet"])
def test_a_corrupt_parquet_file_is_named_with_what_is_wrong(tmp_path, damage):
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GSM8K_ROW] * 3), path)
    path.write_bytes(path.read_bytes()[:-20] if damage == "truncated" else json.dumps(GSM8K_ROW).encode())
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: not a readable Parquet file after 0 rows \(.+\)"):
        list(read_records(str(path), on_bad_record=lambda err: None))  # the whole file, even under skip
