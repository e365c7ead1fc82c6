"""Requests to an OpenAI-compatible server (vLLM, SGLang), on the standard library alone.

``ChatServer`` sends ``POST {base_url}/chat/completions`` requests (regeneration of chats), ``/completions``
requests (regeneration of raw text: a token-id prompt continued) and any other POST (capture through
vLLM), ``concurrency`` at a time (the
server batches what is in flight), each within a deadline and retried with backoff after what a
restart or an overload looks like: a refused or dropped connection, a timeout, a 5xx or 429 answer.
Anything else (a 4xx: a prompt longer than the server's context, a model it does not serve) is the
request's own fault and fails at once. When a request's retries run out, the error names the server,
the request and the last failure.

The deadline (``timeout_s``) bounds a request's whole exchange, not each read of it: a server that
sends a byte a second answers every read in time. Requests go straight to the server (``http.client``,
no proxy from the environment), to http(s) URLs only. What the server answers is checked before it
is used (a chat reply is a non-empty string within ``max_tokens``, a continuation a string within it,
``/models`` a list of models), and
errors quote an answer that is not JSON only as a short printable prefix: it may be anything.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

from headstart.data_recipes.settings import Generation

BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0  # sleep 0.5, 1, 2, 4, 8, 8, ... s between attempts
SEED_RANGE = 2**63  # the servers take a signed 64-bit seed
QUOTE_JSON, QUOTE_TEXT = 300, 80  # characters of an answer an error quotes: JSON, anything else


class EngineError(RuntimeError):
    """The server could not answer a request, after its retries."""


class RetryableError(Exception):
    """A failure another attempt may not meet: the server restarting, overloaded or slow."""


def http_url(url: str) -> urllib.parse.SplitResult:
    """``url`` split, if it is an http(s) URL with a host: anything else (``file://``, a bare host) is refused
    before a request, which would otherwise read a local file or fail on a name. Errors show the URL without
    its user and password (``redacted_url``)."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # raises on a port out of range or not a number
    except ValueError as err:
        raise ValueError(f"{redacted_url(url)!r} is not an http(s) URL: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{redacted_url(url)!r} is not an http(s) URL (the server's API root, e.g. http://localhost:8000/v1)"
        )
    return parts


def redacted_url(url: str) -> str:
    """``url`` as errors, logs and saved configs may show it: a user and password in it (``http://u:p@host``)
    become ``***``. The client never sends them (no auth header), so nothing is lost; a URL that does not
    even split is shown as a placeholder, as it may hold anything."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "<a URL that does not parse>"
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def quote(answer: Any) -> str:
    """What an error may show of a server's answer (the body's bytes, or its parsed JSON): JSON as JSON, cut to
    300 characters; anything else as its length and its first 80 characters of printable ASCII, the rest as
    ``?``. A body that is not JSON may be a page, a binary or a file's content: not ours to print whole."""
    if isinstance(answer, bytes):
        try:
            answer = json.loads(answer)
        except (ValueError, RecursionError):
            prefix = "".join(c if " " <= c <= "~" else "?" for c in answer[:QUOTE_TEXT].decode("latin-1"))
            return f"{len(answer)} bytes of no JSON, starting {prefix!r}"
    return json.dumps(answer)[:QUOTE_JSON]


def chat_request(model: str, messages: list[dict[str, str]], generation: Generation, seed: int) -> dict[str, Any]:
    """A ``/chat/completions`` body: the reply to ``messages`` (``sampling``)."""
    return {"model": model, "messages": messages, **sampling(generation, seed)}


def completion_request(model: str, prompt: list[int], generation: Generation, seed: int) -> dict[str, Any]:
    """A ``/completions`` body: the continuation of the token ids ``prompt``, fed to the target as they are (no
    BOS added, nothing re-tokenized), ``sampling`` as a chat request samples."""
    return {"model": model, "prompt": prompt, **sampling(generation, seed)}


def sampling(generation: Generation, seed: int) -> dict[str, Any]:
    """A request's sampling fields: greedy at temperature 0; sampled with top_p, top_k (vLLM's and SGLang's extra
    field, sent only when set) and a per-request seed, so a retried or resumed request samples the same."""
    body: dict[str, Any] = {"max_tokens": generation.max_new_tokens, "temperature": generation.temperature}
    if generation.temperature > 0:
        body |= {"top_p": generation.top_p, "seed": seed % SEED_RANGE}
        if generation.top_k:
            body["top_k"] = generation.top_k
    return body


class ChatServer:
    """An OpenAI-compatible server's chat completions and completions; use it as a context manager (it owns a
    thread pool)."""

    def __init__(self, base_url: str, model: str, concurrency: int, timeout_s: float, retries: int) -> None:
        self._url = http_url(base_url.rstrip("/"))
        self.base_url = redacted_url(base_url.rstrip("/"))  # what errors name: never a password
        self.model = model
        self.timeout_s = timeout_s
        self.retries = retries
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="chat")
        self._stopping = threading.Event()

    def __enter__(self) -> ChatServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()  # after a failure or Ctrl-C, the requests in flight make no further attempt
        self._pool.shutdown(wait=True, cancel_futures=True)

    def served_model(self) -> dict[str, Any]:
        """The server's entry for ``model`` in ``GET /models`` (vLLM adds ``root``, the folder it loaded)."""
        answer = self._with_retries(lambda: self._call("GET", "/models"), "GET /models")
        models = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise EngineError(
                f"{self.base_url}: GET /models answered {quote(answer)}: not a list of models "
                '({"data": [{"id": ...}, ...]}); is base_url an OpenAI-compatible server\'s API root?'
            )
        entry = next((m for m in models if m.get("id") == self.model), None)
        if entry is None:
            served = [m.get("id") for m in models]
            raise EngineError(
                f"{self.base_url} serves {served}, not {self.model!r}: "
                "set the served model name (regenerate.model, capture.model) to one"
            )
        return entry

    def complete_all(
        self, requests: list[tuple[dict[str, Any], str]], count_tokens: Callable[[str], int] | None = None
    ) -> list[tuple[str, str]]:
        """(reply, finish_reason) per ``(body, what)`` request, in order; ``what`` names it in errors.
        ``count_tokens`` counts a reply's tokens where the answer reports no ``usage`` (see ``complete``)."""
        return self._in_flight(lambda body, what: self.complete(body, what, count_tokens), requests)

    def post_all(self, path: str, requests: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
        """The JSON answer of ``POST {base_url}{path}`` per ``(body, what)`` request, in order, with the retries
        and failure rules of the chat requests (``/completions`` with token-id prompts, for instance)."""
        return self._in_flight(
            lambda body, what: self._with_retries(lambda: self._call("POST", path, body), what), requests
        )

    def _in_flight(
        self, send: Callable[[dict[str, Any], str], Any], requests: list[tuple[dict[str, Any], str]]
    ) -> list:
        """``send(body, what)`` for every request, ``concurrency`` at a time; the answers in order."""
        futures = [self._pool.submit(send, body, what) for body, what in requests]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)  # one failure ends the batch, whichever it is
        error = next((e for f in futures if f in done and (e := f.exception()) is not None), None)
        if error is not None:
            for future in futures:
                future.cancel()  # not yet sent: never is; in flight: ends within its timeout, retried no more
            raise error
        return [future.result() for future in futures]

    def complete(
        self, body: dict[str, Any], what: str, count_tokens: Callable[[str], int] | None = None
    ) -> tuple[str, str]:
        """The reply to a chat request (``chat_request``) or the continuation of a completion request
        (``completion_request``) and its finish_reason, checked: a string of at most ``max_tokens`` tokens, and a
        chat reply a non-empty one (null or blank is what a server answers when the text went elsewhere, a
        reasoning or tool-call field; a continuation may end at once, its first token the end of text)."""
        chat = "messages" in body
        path = "/chat/completions" if chat else "/completions"
        answer = self._with_retries(lambda: self._call("POST", path, body), what)
        try:
            choice = answer["choices"][0]
            reply, finish_reason = choice["message"]["content"] if chat else choice["text"], choice["finish_reason"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"{self.base_url}: {what}: not an answer of POST {path}: {quote(answer)}") from None
        if not isinstance(reply, str) or (chat and not reply.strip()):
            kind = "a non-empty string" if chat else "a string"
            raise EngineError(f"{self.base_url}: {what}: the reply is {quote(reply)}, not {kind}")
        self.check_length(answer, reply, body["max_tokens"], what, count_tokens)
        return reply, finish_reason

    def check_length(
        self, answer: dict[str, Any], reply: str, max_tokens: int, what: str, count_tokens: Callable[[str], int] | None
    ) -> None:
        """A reply longer than the request allowed is a server that ignores max_tokens: its replies are not what
        the target says under these settings. The answer's own count is exact; the reply counted again with the
        target's tokenizer may split the same text otherwise, so it gets some slack."""
        usage = answer.get("usage")
        reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if isinstance(reported, int) and not isinstance(reported, bool):
            tokens, how, allowed = reported, "usage.completion_tokens", max_tokens
        elif count_tokens is not None:
            tokens, how = count_tokens(reply), "counted with the target's tokenizer"
            allowed = max_tokens + max_tokens // 10 + 4
        else:
            return
        if tokens > allowed:
            raise EngineError(
                f"{self.base_url}: {what}: the reply is {tokens} tokens long ({how}), the request's max_tokens "
                f"{max_tokens}: the server does not honour max_tokens"
            )

    def _with_retries(self, call: Callable[[], Any], what: str) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return call()
            except RetryableError as err:
                last = err
            if attempt == self.retries or self._stopping.wait(min(BACKOFF_S * 2**attempt, MAX_BACKOFF_S)):
                break
        raise EngineError(
            f"the server at {self.base_url} did not answer {what} after {self.retries + 1} attempt(s) "
            f"(timeout {self.timeout_s:g} s each); last error: {last}"
        )

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The server's JSON answer, whatever its shape: the callers check it."""
        data = None if body is None else json.dumps(body).encode()
        status, text = self._exchange(method, path, data)
        if not 200 <= status < 300:
            detail = f"HTTP {status} from {method} {path}: {quote(text)}"
            if status >= 500 or status == 429:
                raise RetryableError(detail)
            raise EngineError(f"{self.base_url}: {detail}")
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            raise EngineError(f"{self.base_url}: {method} {path} answered with no JSON: {quote(text)}") from None

    def _exchange(self, method: str, path: str, data: bytes | None) -> tuple[int, bytes]:
        """One request's status and body, the whole exchange within ``timeout_s``: the socket's timeout bounds
        each read, a watchdog the whole, shutting the socket at the deadline, which ends a read in progress."""
        kind = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
        connection = kind(self._url.hostname or "", self._url.port, timeout=self.timeout_s)
        expired = threading.Event()
        # The socket, kept here: an answer that closes the connection takes it off ``connection`` before its body.
        sockets: list[socket.socket] = []
        watchdog = threading.Timer(self.timeout_s, _cut, (connection, sockets, expired))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.connect()
            sockets.append(connection.sock)
            if expired.is_set():  # the deadline passed while connecting, maybe before there was a socket to shut
                raise TimeoutError
            connection.request(method, self._url.path + path, data, {"Content-Type": "application/json"})
            response = connection.getresponse()
            status, text = response.status, response.read()
        except (OSError, http.client.HTTPException) as err:  # TimeoutError, ConnectionError, RemoteDisconnected
            if expired.is_set() or isinstance(err, TimeoutError):
                raise RetryableError(self._late(method, path)) from err
            raise RetryableError(f"{method} {path}: {err!r}") from err
        finally:
            watchdog.cancel()
            watchdog.join()  # the socket is closed only once the watchdog can no longer shut it
            connection.close()
        if expired.is_set():  # an answer cut short where nothing told its length
            raise RetryableError(self._late(method, path))
        return status, text

    def _late(self, method: str, path: str) -> str:
        return f"no complete answer to {method} {path} within {self.timeout_s:g} s"


def _cut(connection: http.client.HTTPConnection, sockets: list[socket.socket], expired: threading.Event) -> None:
    """The watchdog: shut the request's socket (``connection``'s while it connects, then the one kept), which
    wakes the thread reading it with an end of file. The plain socket's shutdown, for a TLS one too: only the
    file descriptor is shut, the TLS state is left to its reader."""
    expired.set()
    for sock in [connection.sock, *sockets]:
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
