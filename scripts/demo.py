"""The whole pipeline on the bundled target: ``make demo`` runs this.

    python -m scripts.demo --config configs/demo.yaml [key=value ...]

Runs the stages the config lists (regenerate -> capture -> train -> eval -> export) as the same
subprocess commands a user would type, one after the other, then prints the report. Each stage is
resumable on its own (capture keeps finished shards, training resumes from its last complete
checkpoint, writes are atomic), and the demo adds one thing on top: once a stage's command exits 0,
it writes ``<out_dir>/stages/<name>.json`` with a key over the command, the contents of its input
files and the keys of the stages before it. A re-run skips every stage whose key still matches and
whose outputs exist, and re-runs the rest. ``<out_dir>/timings.json`` holds each stage's wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field

from headstart.core.config import ConfigError, load_config, run_command
from headstart.core.io import atomic_write_text
from headstart.core.settings import Count, Folder, Section, as_dict, parse
from headstart.train.metrics import ACCEPTANCE_PLOT


class DemoStage(Section):
    name: str
    cmd: str  # {python}, {bin} and {key} (a top-level key of the config) are filled in
    inputs: list[str] = []  # files whose bytes key the stage
    outputs: list[str] = []  # files that must exist for the stage to count as done


class DemoConfig(Section):
    """configs/demo.yaml, read by scripts/demo.py."""

    command: ClassVar[str] = "demo"

    out_dir: Folder
    report: Folder
    nproc_per_node: Count = 1
    target: str | None = None  # a folder the stage commands name as {target}
    heads: str | None = None  # where stages after training read the heads, as {heads}
    stages: Annotated[list[DemoStage], Field(min_length=1)]


def stage_key(stage: DemoStage, settings: dict[str, Any], upstream: str) -> str:
    """What decides a stage's outputs: its command, its input files' bytes and everything upstream.

    The interpreter's path is left out, so the same pipeline run from another venv is still complete.
    """
    command = stage.cmd.format(**settings, python="{python}", bin="{bin}")
    digest = hashlib.sha256((upstream + "\0" + command).encode())
    for path in stage_paths(stage, "inputs", settings):
        if not path.is_file():
            raise FileNotFoundError(f"stage {stage.name}: input {path} not found")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fill(stage: DemoStage, field: str, text: str, fields: dict[str, Any]) -> str:
    """``text`` from the stage's ``field`` with ``{key}`` placeholders filled in; an unknown key is a config error."""
    try:
        return text.format(**fields)
    except KeyError as err:
        raise ConfigError(f"stage {stage.name}: {{{err.args[0]}}} in its {field} is not a config key") from None


def stage_paths(stage: DemoStage, field: Literal["inputs", "outputs"], settings: dict[str, Any]) -> list[Path]:
    """A stage's ``inputs`` or ``outputs``, with config keys filled in as in its command (``{heads}/eagle3/head``)."""
    return [Path(fill(stage, field, name, settings)) for name in getattr(stage, field)]


def expand(stage: DemoStage, settings: dict[str, Any]) -> list[str]:
    """The stage's command line, with ``{python}``, ``{bin}`` (this interpreter's folder) and config keys filled in."""
    fields = {"python": sys.executable, "bin": str(Path(sys.executable).parent), **settings}
    return shlex.split(fill(stage, "cmd", stage.cmd, fields))


def is_complete(stamp_path: Path, key: str, outputs: list[Path]) -> bool:
    if not stamp_path.is_file() or json.loads(stamp_path.read_text())["key"] != key:
        return False
    return all(p.exists() for p in outputs)


def run_stages(cfg: DemoConfig, only: set[str] | None = None) -> dict[str, Any]:
    """Run (or skip) every stage in order; returns the timings, also written to ``<out_dir>/timings.json``.

    A stage is skipped when its key (``stage_key``) matches its stamp and its outputs exist. A stage that runs
    first drops the stamps of every stage after it, so what was made from its old outputs runs again (a retrained
    head is evaluated and exported anew)."""
    out_dir = Path(cfg.out_dir)
    stamps = out_dir / "stages"
    settings = {k: v for k, v in as_dict(cfg).items() if k != "stages"}  # the {key}s a command may name
    stages = cfg.stages
    timings: dict[str, Any] = {"stages": {}, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    start = time.perf_counter()
    upstream = ""
    for index, stage in enumerate(stages, 1):
        name = stage.name
        command = expand(stage, settings)
        key = stage_key(stage, settings, upstream)
        upstream = key
        stamp_path = stamps / f"{name}.json"
        if only is not None and name not in only:
            continue  # its key still feeds the stages after it, so a partial run keys them as a full one does
        header = f"[{index}/{len(stages)}] stage {name}"
        if is_complete(stamp_path, key, stage_paths(stage, "outputs", settings)):
            seconds = json.loads(stamp_path.read_text())["seconds"]
            print(f"{header}: done, skipped (outputs complete; it took {seconds:.1f} s when it ran)", flush=True)
            timings["stages"][name] = {"status": "skipped", "seconds": 0.0, "seconds_when_run": seconds}
            continue
        for later in stages[index:]:  # made from this stage's old outputs: they run again, even after a kill
            (stamps / f"{later.name}.json").unlink(missing_ok=True)
        print(f"{header}: running\n    {shlex.join(command)}", flush=True)
        began = time.perf_counter()
        code = subprocess.run(command).returncode
        seconds = time.perf_counter() - began
        if code != 0:
            raise SystemExit(
                f"{header}: failed (exit code {code}) after {seconds:.1f} s; see its message above. "
                f"Run the demo again to resume: finished stages and finished work inside this one are kept."
            )
        atomic_write_text(stamp_path, json.dumps({"key": key, "seconds": seconds, "command": command}, indent=1))
        print(f"{header}: done in {seconds:.1f} s", flush=True)
        timings["stages"][name] = {"status": "ran", "seconds": seconds, "seconds_when_run": seconds}
    timings["total_s"] = time.perf_counter() - start
    timings["all_stages_when_run_s"] = sum(t["seconds_when_run"] for t in timings["stages"].values())
    timings["load_average_at_end"] = os.getloadavg()
    atomic_write_text(out_dir / "timings.json", json.dumps(timings, indent=1) + "\n")
    return timings


def summary(cfg: DemoConfig, timings: dict[str, Any]) -> str:
    """The stage table, then the evaluation's report and where its plots are."""
    lines = ["", "| stage | this run | wall s (when it ran) |", "|---|---|---|"]
    for name, t in timings["stages"].items():
        lines.append(f"| {name} | {t['status']} | {t['seconds_when_run']:.1f} |")
    lines.append(f"\nthis run: {timings['total_s']:.1f} s; every stage's own time summed: ")
    lines[-1] += f"{timings['all_stages_when_run_s']:.1f} s ({Path(cfg.out_dir) / 'timings.json'})"
    report = Path(cfg.report)
    if report.is_file():
        lines += ["", report.read_text().rstrip(), ""]
        lines += [f"plot: {p}" for p in sorted(report.parent.glob("*.png"))]
        lines.append(f"report: {report.with_suffix('.json')}")
    # Training's predicted against measured tau (train.eval_prompts), one plot per trained head.
    lines += [f"training acceptance: {p}" for p in sorted(Path(cfg.out_dir).glob(f"*/{ACCEPTANCE_PLOT}"))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--stages", help="comma-separated stage names to run (default: all, in order)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = parser.parse_args(argv)
    cfg = parse(load_config(args.config, args.overrides), DemoConfig, args.config)
    names = [stage.name for stage in cfg.stages]
    only = set(args.stages.split(",")) if args.stages else None
    if only and only - set(names):
        raise ConfigError(f"--stages: no stage named {sorted(only - set(names))} in {args.config} (it has {names})")
    print(summary(cfg, run_stages(cfg, only)))


if __name__ == "__main__":
    run_command(main, "python -m scripts.demo")
