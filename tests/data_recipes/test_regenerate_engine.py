"""Regeneration through an OpenAI-compatible server (``regenerate.engine: openai``).

The server here is a small http.server that answers /v1/chat/completions (and /v1/completions of token-id
prompts, raw text's) with the real bundled target through transformers, so the engine path's replies can be
checked against the hf path's;
it can be told to answer 503, drop the connection (a killed server) or hang, and to answer what a
broken server does: a byte a second, a reply longer than asked, a reply that is not text, no JSON,
a /models that is not a list of models.
"""

import json
import re
import threading
import time
from http.server import ThreadingHTTPServer

import pytest
import torch
from transformers import AutoTokenizer

from headstart.core.config_files import ConfigError
from headstart.data_recipes.engine_client import ChatServer, EngineError
from headstart.data_recipes.prompts import raw_ids, text_prompt_length
from headstart.data_recipes.regenerate import run_regenerate
from tests.helpers import TARGET, JsonHandler

SERVED = "demo-target"  # served under another name than its path: regenerate.model is sent
QUESTIONS = [f"Tom has {n} pens and gets {n + 5} more. How many pens does he have now?" for n in range(4)]
CONVERSATIONS = [[{"role": "user", "content": q}, {"role": "assistant", "content": "old"}] for q in QUESTIONS] + [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7+8?"},
        {"role": "assistant", "content": "old"},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "old again"},
    ],
]
TURNS = 6  # assistant turns in CONVERSATIONS: the requests a whole run sends
TRICKLE_S = 12  # a trickling answer gives up after this: a client without a deadline fails in seconds, not minutes
NOT_JSON = b"\x1b[2J\x1b[31m<html>" + b"A" * 500 + b"</html>"  # a terminal escape, then more than any error shows


class ServerState:
    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.generate_lock = threading.Lock()  # one generate at a time: the target is shared
        self.count_lock = threading.Lock()
        self.release = threading.Event()  # ends hanging requests at teardown
        # What the next requests get, in order: ok, 400, 503, drop, hang, trickle, trickle_body, long, overcount,
        # content:<JSON> (that reply), notjson200, notjson503.
        self.plan: list[str] = []
        self.then = "ok"  # ... once the plan is used up
        self.requests: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.models: object = {"object": "list", "data": [{"id": SERVED, "object": "model", "root": str(TARGET)}]}

    def next_action(self, body: dict) -> str:
        with self.count_lock:
            self.requests.append(body)
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            return self.plan.pop(0) if self.plan else self.then

    def complete(self, body: dict) -> tuple[str, str]:
        """The target's reply, as vLLM gives it: greedy at temperature 0, else sampled with the request's seed;
        a completion's token ids continued as they are, its text decoded in their context."""
        tok = self.tokenizer
        if "prompt" in body:
            prompt = {"input_ids": torch.tensor([body["prompt"]])}
        else:
            prompt = tok.apply_chat_template(
                body["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
            )
        sampling = {"do_sample": False}
        if body["temperature"] > 0:
            sampling = {"do_sample": True, "temperature": body["temperature"], "top_p": body["top_p"], "top_k": 0}
        with self.generate_lock, torch.no_grad():
            if body["temperature"] > 0:
                torch.manual_seed(body["seed"])
            out = self.model.generate(
                **prompt, max_new_tokens=body["max_tokens"], eos_token_id=tok.eos_token_id, **sampling
            )
        new = out[0, prompt["input_ids"].shape[1] :]
        finish = "stop" if (new == tok.eos_token_id).any() else "length"
        if "prompt" in body:
            before = tok.decode(body["prompt"], skip_special_tokens=True)
            return tok.decode(out[0], skip_special_tokens=True).removeprefix(before), finish
        return tok.decode(new, skip_special_tokens=True), finish


class ChatHandler(JsonHandler):
    def answer_raw(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def trickle(self, payload: dict, body_only: bool) -> None:
        """The answer a byte a second, from its status line or (``body_only``) after its headers: every read
        the client makes gets a byte in time. Gives up after TRICKLE_S, or when the client hangs up."""
        data = json.dumps(payload).encode()
        head = b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
        self.close_connection = True  # HTTP/1.0: the client takes the socket off its connection before the body
        if body_only:
            self.wfile.write(head)
        for byte in (data if body_only else head + data)[:TRICKLE_S]:
            if self.server.state.release.wait(1):
                return
            try:
                self.wfile.write(bytes([byte]))
            except OSError:
                return

    def do_GET(self):
        assert self.path == "/v1/models", self.path
        self.answer(200, self.server.state.models)

    def do_POST(self):
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == ("/v1/completions" if "prompt" in body else "/v1/chat/completions"), self.path
        action = state.next_action(body)
        try:
            if action in ("400", "503"):
                self.answer(int(action), {"error": {"message": f"error {action}"}})
            elif action == "drop":  # killed mid-request: the connection closes with no answer
                self.close_connection = True
            elif action == "hang":
                state.release.wait(30)
            elif action.startswith("notjson"):
                self.answer_raw(int(action.removeprefix("notjson")), NOT_JSON)
            elif action.startswith("trickle"):
                self.trickle(completion(body, "Four.", "stop"), body_only=action == "trickle_body")
            elif action == "long":  # a server that ignores max_tokens, and says nothing of usage
                self.answer(200, completion(body, "word " * 5000, "stop"))
            elif action == "overcount":  # its own count says it ignored max_tokens
                usage = {"prompt_tokens": 30, "completion_tokens": body["max_tokens"] + 1}
                self.answer(200, completion(body, "Four.", "length") | {"usage": usage})
            elif action.startswith("content:"):
                self.answer(200, completion(body, json.loads(action.removeprefix("content:")), "stop"))
            else:
                self.answer(200, completion(body, *state.complete(body)))
        finally:
            with state.count_lock:
                state.in_flight -= 1


def completion(body: dict, content: object, finish: str) -> dict:
    if "prompt" in body:  # vLLM's /v1/completions answer
        choice = {"index": 0, "text": content, "finish_reason": finish}
        return {"object": "text_completion", "model": body["model"], "choices": [choice]}
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
    return {"object": "chat.completion", "model": body["model"], "choices": [choice]}


@pytest.fixture
def serve(demo_target):
    """Start a chat server on a free port: returns (base_url, state); every one started is stopped after."""
    started = []

    def start():
        server = ThreadingHTTPServer(("127.0.0.1", 0), ChatHandler)
        server.daemon_threads = True
        server.state = ServerState(*demo_target)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/v1", server.state

    yield start
    for server in started:
        server.state.release.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def messages_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    return path


def config(source, out, base_url=None, data_format="messages", **regenerate):
    engine = {"engine": "openai", "base_url": base_url, "model": SERVED} if base_url else {}
    return {
        "target": {"path": str(TARGET), "device": "cpu", "dtype": "fp32"},
        "data": {"source": str(source), "format": data_format},
        "regenerate": {"out": str(out), "max_new_tokens": 16, "chunk_size": 2, **engine, **regenerate},
    }


def test_engine_replies_equal_the_hf_paths_at_temperature_0(serve, messages_file, tmp_path, one_thread, capsys):
    hf = run_regenerate(config(messages_file, tmp_path / "hf.jsonl")).read_text()
    hf_report = capsys.readouterr().out.splitlines()[-1]
    url, state = serve()
    served = run_regenerate(config(messages_file, tmp_path / "served.jsonl", url, concurrency=2)).read_text()
    assert served == hf
    # finish_reason "length" is counted as the hf path counts a reply with no eos.
    assert capsys.readouterr().out.splitlines()[-1] == hf_report.replace("hf.jsonl", "served.jsonl")
    assert "6 replies this run stopped at max_new_tokens=16" in hf_report
    rows = [json.loads(line)["messages"] for line in served.splitlines()]
    assert [[m["role"] for m in r] for r in rows] == [[m["role"] for m in c] for c in CONVERSATIONS]
    assert "old" not in served and rows[4][3] == CONVERSATIONS[4][3]
    # The last turn was asked after the regenerated first one, in its context.
    assert state.requests[-1]["messages"] == rows[4][:4]
    assert len(state.requests) == TURNS and state.peak_in_flight == 2  # both slots used, never more
    assert {(r["model"], r["max_tokens"], r["temperature"]) for r in state.requests} == {(SERVED, 16, 0.0)}
    assert not any("seed" in r or "top_k" in r for r in state.requests)  # greedy: nothing to seed


def test_texts_go_to_completions_as_token_ids_and_equal_the_hf_paths(serve, tmp_path, one_thread):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": q}) + "\n" for q in QUESTIONS))
    hf_config = config(texts, tmp_path / "hf.jsonl", data_format="text")
    hf_config["target"]["dtype"] = "bf16"  # the served target's (the session fixture loads it as its config says)
    hf = run_regenerate(hf_config).read_text()
    url, state = serve()
    served = run_regenerate(config(texts, tmp_path / "served.jsonl", url, "text", concurrency=2)).read_text()
    assert served == hf and len(state.requests) == len(QUESTIONS)
    # The server got the texts' first tokens themselves (raw_ids: as a completion API tokenizes them).
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    ids = [raw_ids(tokenizer, q) for q in QUESTIONS]
    assert sorted(r["prompt"] for r in state.requests) == sorted(i[: text_prompt_length(len(i))] for i in ids)
    assert {r["max_tokens"] for r in state.requests} == {16}


def test_503s_are_retried_and_the_replies_are_the_same(serve, messages_file, tmp_path, one_thread):
    url, state = serve()
    reference = run_regenerate(config(messages_file, tmp_path / "ref.jsonl", url)).read_text()
    url, state = serve()
    state.plan = ["503", "503"]
    out = run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, retries=2)).read_text()
    assert out == reference and len(state.requests) == TURNS + 2


def test_a_killed_server_keeps_the_finished_parts_and_a_rerun_resumes_them(serve, messages_file, tmp_path, one_thread):
    url, state = serve()
    reference = run_regenerate(config(messages_file, tmp_path / "ref.jsonl", url)).read_text()
    out, parts = tmp_path / "out.jsonl", tmp_path / "out.jsonl.parts"
    url, state = serve()
    state.plan, state.then = ["ok", "ok"], "drop"  # chunk 0 (two single-turn conversations), then it dies
    with pytest.raises(EngineError) as err:
        run_regenerate(config(messages_file, out, url, retries=1))
    # Chunk 1's two requests fail together; the first failure is reported.
    assert re.search(rf"the server at {url} did not answer conversation [23] after 2 attempt\(s\)", str(err.value))
    assert "last error: POST /chat/completions: RemoteDisconnected" in str(err.value)
    assert f"1 of 3 parts are kept in {parts}: re-run to resume" in str(err.value)
    assert [p.name for p in parts.glob("part-*")] == ["part-00000.jsonl"] and not out.exists()
    # The hf engine's replies are not mixed with the server's.
    with pytest.raises(ValueError, match=r"holds 1 parts made with other settings \(.*engine 'openai' -> None"):
        run_regenerate(config(messages_file, out))
    # A healthy server on another port resumes: what it serves, not where, decides the parts.
    url, state = serve()
    assert run_regenerate(config(messages_file, out, url)).read_text() == reference
    assert len(state.requests) == TURNS - 2  # chunk 0 was not asked again


def test_a_hanging_server_is_a_timeout_error(serve, messages_file, tmp_path):
    url, state = serve()
    state.then = "hang"
    # 2 s, not less: the same timeout bounds GET /models, which a loaded machine can answer slowly. Chunk 0's two
    # conversations are asked at once and both hang: whichever times out first is the one reported.
    with pytest.raises(EngineError, match=r"did not answer conversation [01] after 1 attempt\(s\) .*within 2 s"):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, timeout_s=2.0, retries=0))
    assert not (tmp_path / "out.jsonl").exists()


def test_a_failed_request_stops_the_others_retrying(serve, messages_file, tmp_path):
    url, state = serve()
    state.plan, state.then = ["400"], "503"  # one request is refused for good, the other one retried
    start = time.monotonic()
    with pytest.raises(EngineError, match=rf"{url}: HTTP 400 from POST /chat/completions: .*error 400"):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, retries=5))
    # Five retries of the 503s would sleep 0.5 + 1 + 2 + 4 + 8 s: the failure ended them after the first.
    assert time.monotonic() - start < 5 and len(state.requests) <= 3


def test_no_server_or_another_model_fails_before_any_part(serve, messages_file, tmp_path):
    url, _ = serve()
    with pytest.raises(EngineError, match=rf"{url} serves \['demo-target'\], not 'other': set the served model name"):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, model="other"))
    down = "http://127.0.0.1:9/v1"  # the discard port: nothing listens
    with pytest.raises(EngineError, match=rf"the server at {down} did not answer GET /models .*Connection refused"):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", down, retries=0))
    assert not list(tmp_path.glob("out.jsonl*"))


def test_sampled_replies_do_not_depend_on_concurrency(serve, messages_file, tmp_path, one_thread):
    url, state = serve()
    sampled = {"temperature": 1.0, "top_p": 0.9, "seed": 3}
    one = run_regenerate(config(messages_file, tmp_path / "one.jsonl", url, concurrency=1, **sampled)).read_text()
    seeds = [r["seed"] for r in state.requests]
    many = run_regenerate(config(messages_file, tmp_path / "many.jsonl", url, concurrency=4, **sampled)).read_text()
    assert many == one and len(set(seeds)) == TURNS  # a seed of its own per conversation and turn
    assert sorted(r["seed"] for r in state.requests[TURNS:]) == sorted(seeds)
    greedy = run_regenerate(config(messages_file, tmp_path / "greedy.jsonl", url)).read_text()
    assert greedy != one  # it did sample


@pytest.mark.parametrize("trickle", ["trickle", "trickle_body"])
def test_a_trickling_server_times_out_within_the_deadline(serve, messages_file, tmp_path, trickle):
    """A byte a second answers every socket read in time: only a deadline on the whole request ends it."""
    url, state = serve()
    state.then = trickle
    start = time.monotonic()
    with pytest.raises(EngineError, match=r"did not answer conversation [01] after 1 attempt\(s\) .*within 2 s"):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, timeout_s=2.0, retries=0))
    assert time.monotonic() - start < TRICKLE_S - 2  # the deadline ended it, not the server giving up
    # A trickled attempt is retried like any timeout (the other replies are canned: no generate to wait for).
    url, state = serve()
    state.plan, state.then = [trickle], 'content:"Four."'
    out = run_regenerate(config(messages_file, tmp_path / "retried.jsonl", url, timeout_s=2.0, retries=1))
    assert len(out.read_text().splitlines()) == len(CONVERSATIONS) and len(state.requests) == TURNS + 1


@pytest.mark.parametrize(
    ("action", "how"), [("long", r"counted with the target's tokenizer"), ("overcount", r"usage.completion_tokens")]
)
def test_a_reply_longer_than_max_tokens_fails_its_conversation(serve, messages_file, tmp_path, action, how):
    url, state = serve()
    state.then = action
    with pytest.raises(
        EngineError,
        match=rf"{url}: conversation [01]: the reply is \d+ tokens long \({how}\), the request's max_tokens 16: "
        "the server does not honour max_tokens",
    ) as err:
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url))
    tokens = int(re.search(r"is (\d+) tokens", str(err.value)).group(1))
    assert tokens == 17 if action == "overcount" else tokens >= 5000  # 5,000 words: a token or more each
    assert len(state.requests) == 2  # the reply is wrong, not the server down: not retried
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("content", [None, 7, ["Four."], {"text": "Four."}, "", " \n"])
def test_a_reply_that_is_not_text_fails_its_conversation(serve, messages_file, tmp_path, content):
    url, state = serve()
    state.then = f"content:{json.dumps(content)}"
    with pytest.raises(
        EngineError,
        match=rf"{url}: conversation [01]: the reply is {re.escape(json.dumps(content))}, not a non-empty string",
    ):
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url))
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("status", [200, 503])
def test_an_answer_that_is_not_json_is_quoted_only_in_part(serve, messages_file, tmp_path, status):
    url, state = serve()
    state.then = f"notjson{status}"
    with pytest.raises(EngineError) as err:
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url, retries=0))
    message = str(err.value)
    # Its length and 80 characters, of printable ASCII only: the escape codes are not sent to the terminal.
    assert f"{len(NOT_JSON)} bytes of no JSON, starting '?[2J?[31m<html>AAA" in message
    assert "A" * 65 in message and "A" * 66 not in message and "\x1b" not in message
    assert message.isprintable() and "</html>" not in message


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://localhost/v1", "localhost:8000/v1", "http:///v1", "http://localhost:99999/v1"]
)
def test_only_an_http_url_is_a_server(url):
    with pytest.raises(ValueError, match="is not an http\\(s\\) URL"):
        ChatServer(url, SERVED, 1, 1.0, 0)  # capture's client too


def test_a_file_url_is_refused_before_it_is_read(messages_file, tmp_path):
    """A file:// base_url once had the client read {base_url}/models and quote the file in its error."""
    (tmp_path / "api").mkdir()
    (tmp_path / "api/models").write_text("SECRET " * 50)
    url = f"file://{tmp_path / 'api'}"
    with pytest.raises(ConfigError, match=r"regenerate.base_url: must be an http\(s\) URL") as err:
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url))
    assert "SECRET" not in str(err.value)
    with pytest.raises(ValueError, match="is not an http") as err:
        ChatServer(url, SERVED, 1, 1.0, 0)
    assert "SECRET" not in str(err.value)


@pytest.mark.parametrize(
    "models",
    [{"object": "list"}, {"data": SERVED}, [{"id": SERVED}], {"data": [SERVED]}, {"data": None}, "demo-target", 3],
)
def test_a_models_list_that_is_not_one_is_named(serve, messages_file, tmp_path, models):
    url, state = serve()
    state.models = models
    with pytest.raises(EngineError, match=rf"{url}: GET /models answered .*: not a list of models") as err:
        run_regenerate(config(messages_file, tmp_path / "out.jsonl", url))
    assert json.dumps(models) in str(err.value)
    assert not list(tmp_path.glob("out.jsonl*"))
