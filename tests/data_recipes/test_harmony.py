"""gpt-oss's harmony format: loss masks over what the model writes after its generation prompt, the template's
date pinned, and regenerated replies that keep their reasoning (the analysis channel) for the sample.

The template here is written for these tests in harmony's shape (a system block with the current date, a
developer message for the system prompt, channels, ``<|return|>`` closing the last reply and ``<|end|>`` the
others, the last reply's ``thinking`` as its analysis message); the tokenizer is the bundled target's with
harmony's special tokens added.
"""

import json
import threading
from datetime import datetime
from http.server import ThreadingHTTPServer

import pytest
import torch
from jinja2 import TemplateError
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from headstart.data_recipes.engine_client import ChatServer, EngineError
from headstart.data_recipes.formats import check_messages, get_format
from headstart.data_recipes.harmony import served_message, split_reply
from headstart.data_recipes.prompts import TEMPLATE_DATE, chat_text, render
from headstart.data_recipes.recipes import load_samples, tokenize_messages
from headstart.data_recipes.regenerate import as_record, regenerate_chunk, regenerate_turns, served_replies
from headstart.data_recipes.settings import Generation
from tests.helpers import TARGET, JsonHandler

HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
HARMONY_TEMPLATE = (
    "{%- macro header() -%}"
    "{{- 'You are a test model.\\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: low\\n\\n' -}}"
    "{{- '# Valid channels: analysis, final.' -}}"
    "{%- endmacro -%}"
    "{{- '<|start|>system<|message|>' + header() + '<|end|>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '<|start|>developer<|message|># Instructions\\n\\n' + m.content + '<|end|>' -}}"
    "{%- elif m.role == 'user' -%}{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}"
    "{%- elif loop.last and not add_generation_prompt -%}"
    "{%- if m.thinking -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}"
    "{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|return|>' -}}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "2+3 = 5", "thinking": "Add them: 5."},  # the template drops it
    {"role": "user", "content": "And 5+5?"},
    {"role": "assistant", "content": "10", "thinking": "5+5 makes 10, so 10."},  # "10" is in it too
]
# What the model writes after each generation prompt (<|start|>assistant): all of it is in the loss.
REPLIES = [
    "<|channel|>final<|message|>2+3 = 5<|end|>",
    "<|channel|>analysis<|message|>5+5 makes 10, so 10.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>10<|return|>",
]


@pytest.fixture(scope="module")
def harmony():
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tokenizer.eos_token = "<|return|>"  # gpt-oss's: generation stops where the last reply closes
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def masked_runs(tokenizer, input_ids, loss_mask):
    """The masked tokens' contiguous runs, decoded with their special tokens."""
    runs, run = [], []
    for token, mask in zip(input_ids, loss_mask):
        if mask:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [tokenizer.decode(r) for r in [*runs, run] if r]


def test_the_mask_is_every_token_the_model_writes_after_its_generation_prompt(harmony):
    input_ids, loss_mask, truncated = tokenize_messages(harmony, CHAT, max_length=4096)
    assert masked_runs(harmony, input_ids, loss_mask) == REPLIES and not truncated
    # Every run starts right after a generation prompt, and the unmasked tokens are the prompts exactly.
    ids = harmony(chat_text(harmony, CHAT), add_special_tokens=False)["input_ids"]
    assert input_ids == ids
    prompts = [harmony(chat_text(harmony, CHAT[:k], True), add_special_tokens=False)["input_ids"] for k in (2, 4)]
    first = loss_mask.index(1)
    assert input_ids[:first] == prompts[0] and harmony.decode(prompts[0]).endswith("<|start|>assistant")
    second = len(prompts[1])
    assert input_ids[:second] == prompts[1] and loss_mask[second - 1] == 0 and loss_mask[second] == 1
    assert sum(loss_mask) == sum(len(harmony(r, add_special_tokens=False)["input_ids"]) for r in REPLIES)


def test_a_reply_without_reasoning_masks_its_final_channel_header_too(harmony):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    input_ids, loss_mask, _ = tokenize_messages(harmony, chat, max_length=4096)
    assert masked_runs(harmony, input_ids, loss_mask) == ["<|channel|>final<|message|>Hello<|return|>"]


def on_day(monkeypatch, day):
    """transformers' strftime_now reads the clock through its module's ``datetime``: set it to ``day``."""

    class Clock(datetime):
        @classmethod
        def now(cls, tz=None):
            return cls.fromisoformat(day)

    monkeypatch.setattr(chat_template_utils, "datetime", Clock)


def test_the_same_ids_on_any_day(harmony, monkeypatch):
    samples, raw = [], []
    for day in ("2031-02-03", "2031-02-04"):
        on_day(monkeypatch, day)
        samples.append(tokenize_messages(harmony, CHAT, max_length=4096))
        raw.append(harmony.apply_chat_template(CHAT, tokenize=False))
        assert f"Current date: {TEMPLATE_DATE}" in harmony.decode(render(harmony, CHAT[:2])[0])
    assert samples[0] == samples[1]
    assert f"Current date: {TEMPLATE_DATE}\n" in harmony.decode(samples[0][0])
    # Unpinned, the template writes each day's date: the ids would change at midnight.
    assert "Current date: 2031-02-03" in raw[0] and "Current date: 2031-02-04" in raw[1]


def test_a_date_format_the_template_computes_is_refused():
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    tokenizer.chat_template = "{%- set f = '%Y' -%}{{ strftime_now(f) }}{{ messages[0].content }}"
    with pytest.raises(TemplateError, match=f"pins the chat template's date to {TEMPLATE_DATE}: strftime_now"):
        chat_text(tokenizer, CHAT[1:2])


class ScriptedModel:
    """A target that answers every prompt with the same token ids (its generate's interface, nothing else)."""

    device = torch.device("cpu")

    def __init__(self, reply_ids):
        self.reply_ids, self.prompts = reply_ids, []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **_):
        self.prompts += [row[mask.bool()].tolist() for row, mask in zip(input_ids, attention_mask)]
        new = (self.reply_ids + [pad_token_id] * max_new_tokens)[:max_new_tokens]
        return torch.cat([input_ids, torch.tensor([new] * len(input_ids))], dim=1)


def test_hf_regeneration_keeps_the_analysis_channel_as_thinking(harmony, tmp_path):
    reply = "<|channel|>analysis<|message|>Think: 7.<|end|><|start|>assistant<|channel|>final<|message|>7<|return|>"
    model = ScriptedModel(harmony(reply, add_special_tokens=False)["input_ids"])
    chats = [[{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": "old"}], CHAT]
    rows, cut_off = regenerate_chunk(model, harmony, chats, Generation(max_new_tokens=64))
    assert cut_off == 0
    assert rows[0][1] == {"role": "assistant", "content": "7", "thinking": "Think: 7."}
    assert rows[1][2] == rows[1][4] == rows[0][1] and rows[1][:2] == CHAT[:2]
    # Turn 2 was asked after the regenerated turn 1, which its prompt holds without the reasoning.
    assert harmony.decode(model.prompts[-1]).endswith(
        "<|start|>assistant<|channel|>final<|message|>7<|end|><|start|>user<|message|>And 5+5?<|end|><|start|>assistant"
    )
    source = tmp_path / "regen.jsonl"
    source.write_text("".join(json.dumps(as_record(r)) + "\n" for r in rows))
    samples, report = load_samples(str(source), "messages", harmony, max_length=4096)
    assert report.kept == 2
    runs = masked_runs(harmony, samples[0].input_ids, samples[0].loss_mask)
    assert runs == [reply]  # the sample holds exactly the ids the target generated after its prompt
    assert samples[0].input_ids[-len(model.reply_ids) :] == model.reply_ids


def test_a_reply_cut_off_in_its_reasoning_keeps_the_reasoning(harmony):
    ids = harmony("<|channel|>analysis<|message|>Let me think", add_special_tokens=False)["input_ids"]
    rows, cut_off = regenerate_chunk(ScriptedModel(ids), harmony, [CHAT[1:3]], Generation(max_new_tokens=len(ids)))
    assert cut_off == 1 and rows[0][1] == {"role": "assistant", "content": "", "thinking": "Let me think"}
    check_messages(rows[0])  # a valid conversation: its reasoning is what there is to train on


def test_split_reply_reads_channels_and_tells_no_harmony():
    assert split_reply("<|channel|>final<|message|> Hi <|return|>") == ("", "Hi")
    two = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
    assert split_reply(two + "<|start|>assistant<|channel|>final<|message|>c") == ("a\n\nb", "c")
    assert split_reply("plain text") is None


class ReasoningServer(JsonHandler):
    """A chat server that answers as vLLM with gpt-oss's reasoning parser: reasoning beside the content."""

    answers = {  # by the question asked last
        "What is 2+3?": {"reasoning_content": "Add: 5.", "content": "5", "finish_reason": "stop"},
        "Hi": {"reasoning_content": "Still thinking", "content": None, "finish_reason": "length"},  # cut off
        "And 5+5?": {"reasoning": "Double it.", "content": "10", "finish_reason": "stop"},  # newer vLLM's key
    }

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        answer = dict(self.answers[body["messages"][-1]["content"]])
        finish = answer.pop("finish_reason")
        choice = {"index": 0, "message": {"role": "assistant", **answer}, "finish_reason": finish}
        self.answer(200, {"choices": [choice], "usage": {"completion_tokens": 5}})


@pytest.fixture
def reasoning_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), ReasoningServer)
    server.requests = []
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", server.requests
    server.shutdown()
    server.server_close()


def test_served_replies_keep_the_servers_reasoning(harmony, reasoning_server):
    url, requests = reasoning_server
    chats = [CHAT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"}]]
    with ChatServer(url, "gpt-oss", 2, 10, 0) as server:
        rows, cut_off = regenerate_turns(chats, served_replies(server, Generation(max_new_tokens=16), 0, len))
    assert rows[0][2] == {"role": "assistant", "content": "5", "thinking": "Add: 5."}
    assert rows[0][4] == {"role": "assistant", "content": "10", "thinking": "Double it."}
    assert rows[1][1] == {"role": "assistant", "content": "", "thinking": "Still thinking"} and cut_off == 1
    assert all("thinking" not in m for r in requests for m in r["messages"])  # prompts go without reasoning
    # The stored record reads back through the messages format with its reasoning, and renders it.
    messages = get_format("messages")(json.loads(json.dumps(as_record(rows[0]))))
    assert messages == rows[0]
    assert "<|channel|>analysis<|message|>Double it.<|end|>" in chat_text(harmony, messages)


def test_an_answer_with_neither_content_nor_reasoning_is_refused():
    empty = {"choices": [{"message": {"content": None, "reasoning_content": " "}, "finish_reason": "stop"}]}
    with pytest.raises(EngineError, match="conversation 3: the reply is null, not a non-empty string"):
        served_message(empty, "http://x/v1", "conversation 3")


def test_the_messages_format_reads_reasoning_under_its_names():
    to_messages = get_format("messages")
    for key in ("thinking", "reasoning_content", "reasoning"):
        record = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: "r"}]}
        assert to_messages(record)[1] == {"role": "assistant", "content": "a", "thinking": "r"}
    with pytest.raises(Exception, match="only an assistant turn has reasoning"):
        check_messages([{"role": "user", "content": "q", "thinking": "r"}, {"role": "assistant", "content": "a"}])
