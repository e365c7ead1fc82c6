"""Requests to an OpenAI-compatible server (vLLM, SGLang), on the standard library alone.

``ChatServer`` sends ``POST {base_url}/chat/completions`` requests (regeneration) and any other POST
(``/completions`` with token-id prompts: capture through vLLM), ``concurrency`` at a time (the
server batches what is in flight), each with a timeout and retried with backoff after what a restart
or an overload looks like: a refused or dropped connection, a timeout, a 5xx or 429 answer. Anything
else (a 4xx: a prompt longer than the server's context, a model it does not serve) is the request's
own fault and fails at once. When a request's retries run out, the error names the server, the
request and the last failure.
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

BACKOFF_S, MAX_BACKOFF_S = 0.5, 8.0  # sleep 0.5, 1, 2, 4, 8, 8, ... s between attempts
SEED_RANGE = 2**63  # the servers take a signed 64-bit seed


class EngineError(RuntimeError):
    """The server could not answer a request, after its retries."""


class RetryableError(Exception):
    """A failure another attempt may not meet: the server restarting, overloaded or slow."""


def chat_request(model: str, messages: list[dict[str, str]], generation: dict[str, Any], seed: int) -> dict[str, Any]:
    """The request body: greedy at temperature 0; sampled with top_p, top_k (vLLM's and SGLang's extra
    field, sent only when set) and a per-request seed, so a retried or resumed request samples the same."""
    body = {"model": model, "messages": messages, "max_tokens": generation["max_new_tokens"]}
    body["temperature"] = generation["temperature"]
    if generation["temperature"] > 0:
        body |= {"top_p": generation["top_p"], "seed": seed % SEED_RANGE}
        if generation["top_k"]:
            body["top_k"] = generation["top_k"]
    return body


class ChatServer:
    """An OpenAI-compatible server's chat completions; use it as a context manager (it owns a thread pool)."""

    def __init__(self, base_url: str, model: str, concurrency: int, timeout_s: float, retries: int) -> None:
        self.base_url = base_url.rstrip("/")
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
        models = self._with_retries(lambda: self._call("GET", "/models"), "GET /models")["data"]
        entry = next((m for m in models if m.get("id") == self.model), None)
        if entry is None:
            served = [m.get("id") for m in models]
            raise EngineError(
                f"{self.base_url} serves {served}, not {self.model!r}: "
                "set the served model name (regenerate.model, capture.model) to one"
            )
        return entry

    def complete_all(self, requests: list[tuple[dict[str, Any], str]]) -> list[tuple[str, str]]:
        """(reply, finish_reason) per ``(body, what)`` request, in order; ``what`` names it in errors."""
        return self._in_flight(self.complete, requests)

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

    def complete(self, body: dict[str, Any], what: str) -> tuple[str, str]:
        answer = self._with_retries(lambda: self._call("POST", "/chat/completions", body), what)
        try:
            choice = answer["choices"][0]
            return choice["message"]["content"] or "", choice["finish_reason"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(f"{self.base_url}: {what}: not a chat completion: {str(answer)[:300]}") from None

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

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            detail = f"HTTP {err.code} from {method} {path}: {err.read().decode(errors='replace')[:300]}"
            if err.code >= 500 or err.code == 429:
                raise RetryableError(detail) from err
            raise EngineError(f"{self.base_url}: {detail}") from err
        except TimeoutError as err:
            raise RetryableError(f"no answer to {method} {path} within {self.timeout_s:g} s") from err
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as err:
            raise RetryableError(f"{method} {path}: {getattr(err, 'reason', err)!r}") from err
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise EngineError(f"{self.base_url}: {method} {path} answered with no JSON: {text[:300]!r}") from None
