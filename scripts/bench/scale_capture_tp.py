"""``scripts.bench.scale``'s stage 6, capture throughput of a split target: ``data_recipes.capture`` on the bundled
target in one process (tp 1) against torchrun tp N, and whether every tp size wrote the same tokens.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from headstart.data_recipes.capture_diff import compare_captures
from headstart.data_recipes.shards import read_manifest

REPO = Path(__file__).resolve().parents[2]  # capture runs here: --capture-config names repository paths
CAPTURE_RATE = re.compile(r"capture: wrote .* \(([\d,.]+) tokens/s")


def capture_command(config: str, tp_size: int, out_dir: Path, samples: int, device: str) -> list[str]:
    """``data_recipes.capture`` of ``samples`` samples into ``out_dir``: one process for tp 1, else ``tp_size``
    torchrun processes splitting the target."""
    overrides = [f"data.limit={samples}", f"capture.out_dir={out_dir}", f"target.device={device}"]
    if tp_size == 1:
        return [sys.executable, "-m", "data_recipes.capture", "--config", config, *overrides]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(tp_size)]
    return [*torchrun, "-m", "data_recipes.capture", "--config", config, *overrides, f"target.tp_size={tp_size}"]


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def measure_capture_tp(
    tp_sizes: list[int], config: str, samples: int, device: str, repeats: int, out: Path
) -> dict[str, Any]:
    """Capture tokens/s (the rate capture prints: its capture loop, rank 0's) and process wall time at each tp
    size, best of ``repeats`` with the sizes alternating; each process gets cores / tp threads, so every size
    uses the whole CPU."""
    runs: dict[int, dict[str, Any]] = {
        tp: {"tp_size": tp, "threads_per_process": max(1, cpu_cores() // tp), "tokens_per_s": [], "wall_s": []}
        for tp in tp_sizes
    }
    with tempfile.TemporaryDirectory(dir=out, prefix="capture-tp-") as tmp:
        last: dict[int, Path] = {}
        for repeat in range(repeats):
            for tp in tp_sizes:
                out_dir = Path(tmp) / f"tp{tp}-{repeat}"
                cmd = capture_command(config, tp, out_dir, samples, device)
                env = {**os.environ, "OMP_NUM_THREADS": str(runs[tp]["threads_per_process"])}
                start = time.perf_counter()
                done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
                wall = time.perf_counter() - start
                rate = CAPTURE_RATE.search(done.stdout)
                if done.returncode or rate is None:
                    raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
                runs[tp]["command"] = " ".join(cmd)
                runs[tp]["tokens_per_s"].append(float(rate.group(1).replace(",", "")))
                runs[tp]["wall_s"].append(wall)
                if tp in last:
                    shutil.rmtree(last[tp])
                last[tp] = out_dir
                print(f"capture-tp: tp {tp}, {runs[tp]['tokens_per_s'][-1]:,.0f} tokens/s, {wall:.1f} s", flush=True)
        base = last[tp_sizes[0]]
        manifest = read_manifest(base)
        same = {tp: compare_captures(base, last[tp]) for tp in tp_sizes[1:]}
    best = {tp: max(run["tokens_per_s"]) for tp, run in runs.items()}
    return {
        "config": config,
        "samples": manifest["samples"],
        "tokens": manifest["tokens"],
        "compute_dtype": manifest["compute_dtype"],
        "device": device,
        "cores": cpu_cores(),
        "repeats": repeats,
        "runs": {
            str(tp): {
                **run,
                "best_tokens_per_s": best[tp],
                "best_wall_s": min(run["wall_s"]),
                "vs_first": best[tp] / best[tp_sizes[0]],
            }
            for tp, run in runs.items()
        },
        "same_as_first": {str(tp): entry for tp, entry in same.items()},
    }
