"""The whole pipeline on the bundled target: ``make demo`` runs this.

    python -m scripts.demo --config configs/demo.yaml [key=value ...]

Runs the stages the config lists (regenerate -> capture -> train -> eval -> export) as the same
subprocess commands a user would type, one after the other, then prints the report. Each stage is
resumable on its own (capture keeps finished shards, training resumes from its last complete
checkpoint, writes are atomic), and the demo adds one thing on top: once a stage's command exits 0,
it writes ``<out_dir>/stages/<name>.json`` with a key over the command, the contents of its input
files and the stages before it (their keys and the size and modification time of their outputs), and
its own outputs' sizes and times. A re-run skips every stage whose key still matches and whose outputs
exist, and re-runs the rest: a head retrained in place is evaluated and exported again. A damaged stamp
counts as none. ``<out_dir>/timings.json`` holds each stage's wall time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, model_validator

from headstart.core.config_files import ConfigError, load_config, run_command
from headstart.core.io import atomic_write_text
from headstart.core.settings import Count, Folder, Section, as_dict, parse
from headstart.train.metrics import ACCEPTANCE_PLOT


def plain_name(name: str) -> str:
    """A stage's name is its stamp's file name in <out_dir>/stages: a plain name, never a path out of that folder."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"{name!r} is not a plain name (letters, digits, '.', '_', '-'; a letter or digit first)")
    return name


class DemoStage(Section):
    name: Annotated[str, AfterValidator(plain_name)]
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

    @model_validator(mode="after")
    def _names_unique(self) -> DemoConfig:
        names = [stage.name for stage in self.stages]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"stage names {twice} are given more than once: each stage needs its own stamp")
        return self


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


def command_settings(cfg: DemoConfig) -> dict[str, Any]:
    """The config keys a stage's command, inputs and outputs may name as ``{key}``."""
    return {k: v for k, v in as_dict(cfg).items() if k != "stages"}


def training_plots(cfg: DemoConfig) -> list[Path]:
    """Training's predicted-against-measured tau plot of each head a stage writes (``RUN/head/...`` beside
    ``RUN/acceptance.png``), not of other runs that share the output folder."""
    settings = command_settings(cfg)
    outputs = [path for stage in cfg.stages for path in stage_paths(stage, "outputs", settings)]
    runs = {path.parent.parent for path in outputs if path.parent.name == "head"}
    return sorted(plot for run in runs if (plot := run / ACCEPTANCE_PLOT).is_file())


def expand(stage: DemoStage, settings: dict[str, Any]) -> list[str]:
    """The stage's command line, with ``{python}``, ``{bin}`` (this interpreter's folder) and config keys filled in."""
    fields = {"python": sys.executable, "bin": str(Path(sys.executable).parent), **settings}
    return shlex.split(fill(stage, "cmd", stage.cmd, fields))


def outputs_fingerprint(outputs: list[Path]) -> dict[str, list[int]]:
    """Each output's size and modification time (ns): cheap, and changed by any rewrite (a head retrained in place)."""
    return {str(path): [stat.st_size, stat.st_mtime_ns] for path in outputs if path.exists() for stat in [path.stat()]}


def chained(key: str, fingerprint: dict[str, list[int]]) -> str:
    """What the stages after one are keyed on: its key and what its outputs are now."""
    return hashlib.sha256((key + json.dumps(fingerprint, sort_keys=True)).encode()).hexdigest()[:16]


def read_stamp(path: Path, header: str) -> dict[str, Any] | None:
    """The stamp of a finished stage; None when there is none, or when it is damaged (said, with its path: the stage
    runs again rather than the demo stopping on it)."""
    if not path.is_file():
        return None
    try:
        stamp = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as err:
        why = f"not UTF-8 JSON: {err}"
    else:
        why = stamp_problem(stamp)
        if not why:
            return stamp
    print(f"{header}: its stamp {path} is damaged ({why}); running the stage again", flush=True)
    return None


def stamp_problem(stamp: Any) -> str:
    """What makes a parsed stamp unusable ('' when nothing does)."""
    if not isinstance(stamp, dict):
        return f"a JSON {type(stamp).__name__}, not an object"
    if not isinstance(stamp.get("key"), str):
        return "no key string"
    seconds = stamp.get("seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        return "no seconds number"
    if not isinstance(stamp.get("outputs", {}), dict):
        return "outputs is not an object"
    return ""


@dataclass(frozen=True)
class Step:
    """One stage as this run sees it: its command and key, its outputs, its stamp and the stamps made from it."""

    header: str  # "[3/11] stage train-eagle3"
    command: list[str]
    key: str
    outputs: list[Path]
    stamp: Path
    later_stamps: list[Path]


def run_stages(cfg: DemoConfig, only: set[str] | None = None) -> dict[str, Any]:
    """Run (or skip) every stage in order; returns the timings, also written to ``<out_dir>/timings.json``.

    A stage is skipped when its key (``stage_key``) matches its stamp and its outputs exist. A stage that runs
    first drops the stamps of every stage after it, so what was made from its old outputs runs again (a retrained
    head is evaluated and exported anew); an output that changed since its stage ran changes the keys of the
    stages after it, so they run again too."""
    out_dir = Path(cfg.out_dir)
    stamps = out_dir / "stages"
    settings = command_settings(cfg)
    stages = cfg.stages
    timings: dict[str, Any] = {"stages": {}, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()}
    start = time.perf_counter()
    upstream = ""
    for index, stage in enumerate(stages, 1):
        step = Step(
            header=f"[{index}/{len(stages)}] stage {stage.name}",
            command=expand(stage, settings),
            key=stage_key(stage, settings, upstream),
            outputs=stage_paths(stage, "outputs", settings),
            stamp=stamps / f"{stage.name}.json",
            later_stamps=[stamps / f"{later.name}.json" for later in stages[index:]],
        )
        if only is None or stage.name in only:
            timings["stages"][stage.name] = run_or_skip(step)
        upstream = chained(step.key, outputs_fingerprint(step.outputs))  # a skipped stage keys the ones after it
    timings["total_s"] = time.perf_counter() - start
    timings["all_stages_when_run_s"] = sum(t["seconds_when_run"] for t in timings["stages"].values())
    timings["load_average_at_end"] = os.getloadavg()
    atomic_write_text(out_dir / "timings.json", json.dumps(timings, indent=1) + "\n")
    return timings


def run_or_skip(step: Step) -> dict[str, Any]:
    """Skip the stage when its stamp's key matches and its outputs exist, else run it and stamp it; its timing."""
    stamp = read_stamp(step.stamp, step.header)
    if stamp is not None and stamp["key"] == step.key and all(p.exists() for p in step.outputs):
        now = outputs_fingerprint(step.outputs)
        changed = [path for path, seen in now.items() if stamp.get("outputs", {}).get(path) != seen]
        if changed:  # the stages after it are keyed on the outputs as they are now: they run again once, not always
            atomic_write_text(step.stamp, json.dumps(stamp | {"outputs": now}, indent=1))
        print(f"{step.header}: done, skipped ({skip_reason(step, stamp, changed)})", flush=True)
        return {"status": "skipped", "seconds": 0.0, "seconds_when_run": stamp["seconds"]}
    for later in step.later_stamps:  # made from this stage's old outputs: they run again, even after a kill
        later.unlink(missing_ok=True)
    print(f"{step.header}: running\n    {shlex.join(step.command)}", flush=True)
    began = time.perf_counter()
    code = subprocess.run(step.command).returncode
    seconds = time.perf_counter() - began
    if code != 0:
        raise SystemExit(
            f"{step.header}: failed (exit code {code}) after {seconds:.1f} s; see its message above. "
            f"Run the demo again to resume: finished stages and finished work inside this one are kept."
        )
    stamp = {"key": step.key, "seconds": seconds, "command": step.command, "outputs": outputs_fingerprint(step.outputs)}
    atomic_write_text(step.stamp, json.dumps(stamp, indent=1))
    print(f"{step.header}: done in {seconds:.1f} s", flush=True)
    return {"status": "ran", "seconds": seconds, "seconds_when_run": seconds}


def skip_reason(step: Step, stamp: dict[str, Any], changed: list[str]) -> str:
    """What a skip compared, in words, naming the outputs rewritten since the stage ran."""
    reason = (
        f"outputs complete: {', '.join(map(str, step.outputs)) or 'none listed'}; the same command, input files, "
        f"and earlier stages and their outputs as when it ran, which took {stamp['seconds']:.1f} s"
    )
    if changed:
        reason += f"; {', '.join(changed)} changed since then: the stages after it run again"
    return reason


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
    lines += [f"training acceptance: {p}" for p in training_plots(cfg)]
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
