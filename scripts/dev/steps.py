"""The steps ``scripts.dev.gpu_check`` runs: subprocesses in order, each step's log and check, and the cause of a
failure read from its log. A step past its time is killed with every process below it (torchrun's workers)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Step:
    """Subprocesses run in order (the first to fail ends the step) and the check of what they wrote: ``check``
    returns (passed, details)."""

    name: str
    commands: list[list[str]]
    check: Callable[[], tuple[bool, dict[str, Any]]]
    out_dir: Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux; elsewhere none): torchrun starts its workers in sessions
    of their own, out of reach of a signal to its process group."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        children = parents.get(frontier.pop(), [])
        found += children
        frontier += children
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (listed first: they are orphaned once it dies)."""
    below = descendants(pid)
    for target in [pid, *below]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def failure_tail(log: str, lines: int = 15, longest: int = 30) -> list[str]:
    """What a failed step's report shows of its log: the end of the last Python traceback that is not torchrun's
    own (a rank's traceback comes first, then the launcher's ChildFailedError, which names no cause), else the last
    ``lines`` lines."""
    text = log.splitlines()
    starts = [i for i, line in enumerate(text) if "Traceback (most recent call last)" in line]
    summary = next((i for i, line in enumerate(text) if line.startswith("====")), len(text))  # torchrun's
    blocks = [text[start:end] for start, end in zip(starts, [*starts[1:], summary], strict=False) if start < end]
    causes = [block for block in blocks if not any("ChildFailedError" in line for line in block)]
    if not (causes or blocks):
        return text[-lines:]
    return (causes or blocks)[-1][-longest:]


def run_step(step: Step, logs: Path, timeout_s: float, cwd: Path) -> dict[str, Any]:
    """The step's commands (run in ``cwd``) in a fresh folder, their output in ``logs``; the check only when they
    exited 0. A step past
    ``timeout_s`` (a collective that hangs) is killed with its whole process group, torchrun's workers included."""
    shutil.rmtree(step.out_dir, ignore_errors=True)  # a capture that finished before would skip its work
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.setdefault("WANDB_MODE", "disabled")
    log = logs / f"{step.name}.log"
    start, returncode = time.perf_counter(), 0
    with log.open("w") as f:
        for command in step.commands:
            f.write(f"$ {shlex.join(command)}\n")
            f.flush()
            proc = subprocess.Popen(
                command, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = proc.wait(timeout=max(timeout_s - (time.perf_counter() - start), 0))
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                returncode = proc.wait()
            if returncode:
                break
    wall = time.perf_counter() - start
    record: dict[str, Any] = {
        "name": step.name,
        "command": " && ".join(shlex.join(command) for command in step.commands),
        "wall_s": round(wall, 1),
        "returncode": returncode,
        "log": str(log),
    }
    if returncode:
        why = f"killed after {timeout_s:.0f} s (--step-timeout)" if wall >= timeout_s else f"exit {returncode}"
        return record | {
            "passed": False,
            "details": {"why": why, "log_tail": failure_tail(log.read_text(errors="replace"))},
        }
    try:
        passed, details = step.check()
    except (OSError, KeyError, ValueError) as error:  # an output missing or not as expected
        passed, details = False, {"why": f"{type(error).__name__}: {error}"}
    return record | {"passed": passed, "details": details}
